// Child processes of the end-to-end tests: each spawned one is remembered, so that whatever
// happens to the test (a failed assertion, a throw, the runner exiting) none is left running.

import { ChildProcess, spawn, SpawnOptions } from 'node:child_process';
import { createWriteStream, readFileSync, WriteStream } from 'node:fs';

const living = new Set<ChildProcess>();

// Last resort (the test process exiting with children alive): SIGKILL them, synchronously.
process.on('exit', () => {
  for (const child of living) {
    try {
      child.kill('SIGKILL');
    } catch {
      // gone already
    }
  }
});

export interface Child {
  process: ChildProcess;
  /** Settles with the exit code (or the signal's name) once the process exited. */
  exited: Promise<number | string>;
  /** Whether it has exited. */
  readonly done: boolean;
  /** Sends `signal`, then SIGKILL after `graceMs` if still running; settles with the exit. */
  stop(signal?: NodeJS.Signals, graceMs?: number): Promise<number | string>;
}

/**
 * Spawns `command` with its stderr (and stdout unless `onLine` takes it) appended to `logPath`.
 * `onLine` gets each line of stdout.
 */
export function start(command: string, args: string[], logPath: string, options: SpawnOptions & { onLine?: (line: string) => void } = {}): Child {
  const log: WriteStream = createWriteStream(logPath, { flags: 'a' });
  const child = spawn(command, args, { ...options, stdio: ['ignore', 'pipe', 'pipe'] });
  living.add(child);
  let done = false;
  const exited = new Promise<number | string>((resolve) => {
    child.once('exit', (code, signal) => {
      done = true;
      living.delete(child);
      resolve(code ?? signal ?? 'unknown');
    });
    child.once('error', (error) => {
      done = true;
      living.delete(child);
      log.write(`spawn failed: ${error.message}\n`);
      resolve(`spawn failed: ${error.message}`);
    });
  });
  let pending = '';
  child.stdout!.on('data', (chunk: Buffer) => {
    if (!options.onLine) {
      log.write(chunk);
      return;
    }
    pending += chunk.toString('utf8');
    let newline: number;
    while ((newline = pending.indexOf('\n')) >= 0) {
      const line = pending.slice(0, newline);
      pending = pending.slice(newline + 1);
      log.write(`${line}\n`);
      options.onLine(line);
    }
  });
  child.stderr!.on('data', (chunk: Buffer) => log.write(chunk));
  // The log is closed once both pipes are drained.
  child.once('close', () => log.end());
  return {
    process: child,
    exited,
    get done() {
      return done;
    },
    async stop(signal: NodeJS.Signals = 'SIGTERM', graceMs = 30_000) {
      if (done) return exited;
      child.kill(signal);
      const timer = setTimeout(() => {
        if (!done) child.kill('SIGKILL');
      }, graceMs);
      const code = await exited;
      clearTimeout(timer);
      return code;
    },
  };
}

/** The last `lines` lines of a log file (for an assertion's message). */
export function tail(path: string, lines = 30): string {
  try {
    return readFileSync(path, 'utf8').split('\n').slice(-lines - 1).join('\n');
  } catch {
    return `(no ${path})`;
  }
}

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** Polls `check` every `everyMs` until it answers a value (not undefined), or throws after `timeoutMs`. */
export async function until<T>(what: string, timeoutMs: number, check: () => Promise<T | undefined> | T | undefined, everyMs = 250): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value !== undefined) return value;
    if (Date.now() > deadline) throw new Error(`${what}: not within ${timeoutMs} ms`);
    await sleep(everyMs);
  }
}
