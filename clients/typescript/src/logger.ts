// The consumer's logging: a logger of yours, quiet by default. One line per reconnect and per
// error (warn, error), and a few about what it does (info: consuming, stopping, replays asked).

export interface Logger {
  info(message: string): void;
  warn(message: string): void;
  error(message: string): void;
}

/** Says nothing (the default). */
export const quietLogger: Logger = {
  info() {},
  warn() {},
  error() {},
};

/**
 * Writes each line to stderr, prefixed with the time and the level (the command's logger):
 * `2026-01-31T10:00:00.000Z WARN the broker connection closed: ...`.
 */
export function stderrLogger(options: { level?: 'info' | 'warn' | 'error' } = {}): Logger {
  const order = { info: 0, warn: 1, error: 2 };
  const min = order[options.level ?? 'info'];
  const line = (level: keyof typeof order) => (message: string) => {
    if (order[level] >= min) process.stderr.write(`${new Date().toISOString()} ${level.toUpperCase()} ${message}\n`);
  };
  return { info: line('info'), warn: line('warn'), error: line('error') };
}
