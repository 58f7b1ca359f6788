// `relay demo --external-consumer`, started by a test: every tier of the relay and the faulty
// simulated upstream in one process, a tenant registered with feed endpoints and a stories
// endpoint, the tenant's queue left to us. Its stdout is JSON lines: `started`, `credentials`,
// `restored` when it restores its database from a backup mid-run, then `verdict` once the upstream stopped and the relay settled; it runs on until SIGTERM,
// when it removes its database, broker user and queues, and exits 0.

import { join } from 'node:path';
import { Child, start, tail } from './processes';

export interface Started {
  event: 'started';
  api_base_url: string;
  metrics_url: string;
  tenant_id: string;
  queue: string;
  webhook_endpoint_ids: string[];
  stories_endpoint_id: string;
  seed: number;
}

export interface Credentials {
  event: 'credentials';
  tenant_id: string;
  tenant_token: string;
  operator_token: string;
  queue: string;
  tenant_amqp_url: string;
}

export interface Restored {
  event: 'restored';
  database_url: string;
  /** `relay restored`'s line of each endpoint. */
  endpoints: { webhook_endpoint_id: string; change_epoch: number; plan: string }[];
  /** Each feed endpoint's rewind, as the API answered it. */
  rewinds: Record<string, { plan: string; outcome: string }>;
}

export interface Verdict {
  event: 'verdict';
  ok: boolean;
  interrupted: boolean;
  settled_in_s: number | null;
  feed_changes: number | null;
  story_changes: number | null;
  endpoints: unknown[];
  stories_endpoint: Record<string, unknown>;
}

export interface DemoOptions {
  relayBin: string;
  seed: number;
  durationS: number;
  endpoints?: number;
  rate?: number;
  storiesRate?: number;
  faults?: string;
  settleTimeoutS?: number;
  /**
   * Seconds into the run to back the relay's database up, and to restore it (every tier
   * stopped, `pg_restore`, `relay restored`, the tiers started again at the same addresses,
   * each feed endpoint rewound: docs/restore.md); the demo prints a `restored` line.
   */
  restore?: { backupAtS: number; restoreAtS: number };
  logDir: string;
  /** More of the relay's settings (RELAY_* variables). */
  env?: Record<string, string>;
}

export class Demo {
  readonly child: Child;
  readonly logPath: string;
  private readonly events = new Map<string, Record<string, unknown>>();
  private readonly waiters = new Map<string, ((line: Record<string, unknown>) => void)[]>();

  constructor(readonly options: DemoOptions) {
    this.logPath = join(options.logDir, 'demo.log');
    const args = [
      'demo', '--external-consumer',
      '--duration-s', String(options.durationS),
      '--endpoints', String(options.endpoints ?? 3),
      '--faults', options.faults ?? 'all',
      '--seed', String(options.seed),
      '--settle-timeout-s', String(options.settleTimeoutS ?? 120),
      '--listen', '127.0.0.1:0', '--api-listen', '127.0.0.1:0', '--metrics-listen', '127.0.0.1:0',
    ];
    if (options.restore) args.push('--backup-at-s', String(options.restore.backupAtS), '--restore-at-s', String(options.restore.restoreAtS));
    if (options.rate !== undefined) args.push('--rate', String(options.rate));
    if (options.storiesRate !== undefined) args.push('--stories-rate', String(options.storiesRate));
    const env: NodeJS.ProcessEnv = { ...process.env, ...options.env };
    delete env.NODE_TEST_CONTEXT;
    env.RELAY_DATABASE_URL ??= process.env.RELAY_TEST_PG ?? 'postgres://postgres@127.0.0.1:5432/postgres';
    env.RELAY_LOG_FORMAT ??= 'text';
    env.RUST_LOG ??= 'warn';
    this.child = start(options.relayBin, args, this.logPath, {
      env,
      onLine: (line) => {
        let parsed: Record<string, unknown>;
        try {
          parsed = JSON.parse(line) as Record<string, unknown>;
        } catch {
          return;
        }
        const event = parsed.event;
        if (typeof event !== 'string') return;
        this.events.set(event, parsed);
        for (const resolve of this.waiters.get(event) ?? []) resolve(parsed);
        this.waiters.delete(event);
      },
    });
  }

  /** The demo's `event` line, once printed; throws when the demo exits first or after `timeoutMs`. */
  async event<T>(event: string, timeoutMs: number): Promise<T> {
    const seen = this.events.get(event);
    if (seen) return seen as T;
    let timer: NodeJS.Timeout | undefined;
    const line = new Promise<Record<string, unknown>>((resolve) => {
      const list = this.waiters.get(event) ?? [];
      list.push(resolve);
      this.waiters.set(event, list);
    });
    const exited = this.child.exited.then((code) => {
      throw new Error(`the demo exited (${code}) before its "${event}" line; its log ends:\n${tail(this.logPath)}`);
    });
    const late = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`no "${event}" line from the demo within ${timeoutMs} ms; its log ends:\n${tail(this.logPath)}`)), timeoutMs);
    });
    try {
      return (await Promise.race([line, exited, late])) as T;
    } finally {
      clearTimeout(timer);
    }
  }

  /** The sum of the series of a metric (a counter or gauge) the demo's tiers export. */
  async metric(metricsUrl: string, name: string): Promise<number> {
    const text = await (await fetch(metricsUrl, { signal: AbortSignal.timeout(5_000) })).text();
    let sum = 0;
    for (const line of text.split('\n')) {
      if (line.startsWith(`${name} `) || line.startsWith(`${name}{`)) sum += Number(line.slice(line.lastIndexOf(' ') + 1));
    }
    return sum;
  }

  /** SIGTERM: the demo removes what it made and exits (0 expected). */
  stop(graceMs = 60_000): Promise<number | string> {
    return this.child.stop('SIGTERM', graceMs);
  }
}
