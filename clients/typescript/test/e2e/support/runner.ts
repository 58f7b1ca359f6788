// The consumer the end-to-end test runs as a child process, so that killing it is a real
// SIGKILL: the library's RelayConsumer into a PgStore, as a user would write it. Each
// notification is handed to a callback that
//   - inserts it into `e2e_outbox` with the transaction's client (the exactly-once variant:
//     the row commits with the store's mark that it was handed, or neither does), and
//   - appends a line to RUNNER_HANDED_LOG before that commit (a side effect outside the
//     transaction: at least once, repeated only when the process dies before the commit).
// SIGTERM stops it cleanly (exit 0); the consumer stopping on an error exits 1. Each failure it
// reports (onError) is a JSON line: {"event":"error","transient":...,"cause":...}.
//
// Environment: RELAY_STORE_DSN, RELAY_AMQP_URL, RELAY_QUEUE, RELAY_API_URL, RELAY_API_TOKEN,
// RUNNER_HANDED_LOG, and optionally RUNNER_PREFETCH, RUNNER_MAX_BATCH,
// RUNNER_MAX_HELD_PER_ENDPOINT, RUNNER_MAX_HELD_TOTAL, RUNNER_GAP_TIMEOUT_MS.

import { appendFileSync } from 'node:fs';
import { PgStore, RelayApi, RelayConsumer } from '@relay/consumer';

function need(name: string): string {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
}

function numberOf(name: string): number | undefined {
  const value = process.env[name];
  return value ? Number(value) : undefined;
}

function say(line: Record<string, unknown>): void {
  process.stdout.write(`${JSON.stringify({ pid: process.pid, at: Date.now(), ...line })}\n`);
}

async function main(): Promise<void> {
  // Taken from the first moment: a SIGTERM that comes while the runner is still starting (the
  // test stops it soon after a restart) stops it as cleanly as one that comes later.
  let stopRequested = false;
  let stopStarted: (() => void) | undefined;
  const onSignal = () => {
    stopRequested = true;
    stopStarted?.();
  };
  process.once('SIGTERM', onSignal);
  process.once('SIGINT', onSignal);
  const handedLog = need('RUNNER_HANDED_LOG');
  const store = new PgStore({
    connection: need('RELAY_STORE_DSN'),
    handlers: {
      notification: async (n, { client }) => {
        await client.query('INSERT INTO e2e_outbox (endpoint_id, story_id, pid) VALUES ($1, $2, $3)', [n.endpoint, n.story_id, process.pid]);
        appendFileSync(handedLog, `${n.endpoint} ${n.story_id} ${process.pid}\n`);
      },
    },
  });
  // The outbox the callback writes to, made before the first hand-over (no unique key: a second
  // hand-over of a story would show as a second row).
  await store.pool.query(`CREATE TABLE IF NOT EXISTS e2e_outbox (
    id bigserial PRIMARY KEY, endpoint_id uuid NOT NULL, story_id text NOT NULL, pid integer NOT NULL,
    written_at timestamptz NOT NULL DEFAULT now())`);
  const consumer = new RelayConsumer({
    amqpUrl: need('RELAY_AMQP_URL'),
    queue: need('RELAY_QUEUE'),
    store,
    api: new RelayApi(need('RELAY_API_URL'), need('RELAY_API_TOKEN')),
    prefetch: numberOf('RUNNER_PREFETCH'),
    batchMax: numberOf('RUNNER_MAX_BATCH'),
    maxHeldPerEndpoint: numberOf('RUNNER_MAX_HELD_PER_ENDPOINT'),
    maxHeldTotal: numberOf('RUNNER_MAX_HELD_TOTAL'),
    gapTimeoutMs: numberOf('RUNNER_GAP_TIMEOUT_MS') ?? 3_000,
    onError: (e) => say({ event: 'error', transient: e.transient, cause: e.cause, retry_in_ms: e.retryInMs ?? null, cause_kind: e.causeKind ?? null }),
  });
  consumer.on('gap', (gap) => say({ event: 'gap', endpoint: gap.endpoint, epoch: gap.epoch, from: gap.from, to: gap.to, held: gap.held }));
  consumer.on('replay', (r) => say({ event: 'replay', endpoint: r.endpoint, from: r.from, error: r.error?.message, answer: r.answer }));
  consumer.on('refused', (error) => say({ event: 'refused', reason: error.reason, message_id: error.messageId, error: error.message }));

  if (stopRequested) {
    await store.close().catch(() => {});
    say({ event: 'stopped', error: null, before: 'consuming' });
    process.exitCode = 0;
    return;
  }
  stopStarted = () => void consumer.stop();
  await consumer.start();
  say({ event: 'consuming' });
  let error: Error | undefined;
  await consumer.done.catch((e: Error) => (error = e));
  say({ event: 'stopped', error: error?.message ?? null, stats: consumer.stats() });
  process.exitCode = error ? 1 : 0;
}

main().catch((error: Error) => {
  say({ event: 'failed', error: error.stack ?? error.message });
  process.exitCode = 1;
});
