// Rebuilds a tenant's copies in Postgres from the relay's snapshots, and says so per endpoint.
//
// Each endpoint's change stream is numbered in epochs. A resync (POST /v1/endpoints/{id}/resync)
// or a restore of the relay's database (`relay restored`, docs/restore.md) begins a new epoch of
// the endpoint, opened by a snapshot of the relay's copy: `snapshot_begin`, the copy's rows
// (`snapshot: true`), `snapshot_end`, then the live changes. At `snapshot_begin` the store forgets
// what it held of the endpoint (its items or stories; the notifications recorded are kept) and the
// snapshot rebuilds it. This example consumes into a PgStore and prints, once each is committed:
//
//   endpoint <id>: epoch <n> begins, rebuilding from its snapshot
//   endpoint <id>: rebuilt (epoch <n>: <i> items, <s> stories, <t> s)
//
// and each notification handed (`endpoint <id>: notification <story id> (<ticker>)`).
//
//   RELAY_AMQP_URL='amqp://<username>:<password>@<host>:<port>/<vhost>' \
//   RELAY_QUEUE=relay.tenant.<tenant id> RELAY_STORE_DSN=postgres://postgres@127.0.0.1:5432/mycopy \
//   RELAY_API_URL=http://127.0.0.1:8081 RELAY_API_TOKEN=<token> \
//   node dist/examples/rebuild.js --from-scratch
//
// RELAY_API_URL and RELAY_API_TOKEN (a token of the tenant) are needed with --from-scratch;
// without it they are optional (a gap that does not fill in time is then asked for again with a
// replay).
//
// --from-scratch (or RELAY_FROM_SCRATCH=1): start from an empty store and have the relay send
// everything again. Name a fresh database (`createdb mycopy`; the store makes its tables), or
// the store's database: its copies, positions and held changes are emptied (relay_items,
// relay_stories, relay_positions, relay_held; relay_notifications is kept, so a notification
// handed before is not handed again). Stop every other consumer of that store first, and empty any table of yours that your
// handlers derive from the copy in `emptyStore` below. Then every endpoint of the tenant
// (GET /v1/endpoints) is resynced: a new epoch each, its snapshot the relay's copy as it is now.
// A 409 says the endpoint's current epoch's snapshot is still being sent (a resync or restore
// just begun): asked again after a pause. Then it consumes, as without the flag. Changes of the
// older epochs still in the queue are dropped as stale once the new epoch begins.
//
// After a restore: run it without the flag (or keep the one that runs). The restored relay begins
// a new epoch of every endpoint itself, so no resync is needed: the same lines are printed for
// each endpoint as its snapshot arrives, and the copy is the backup's until the relay's rewind or
// reload brings it up to date with the live changes that follow.
//
// Stop it with SIGINT (Ctrl-C) or SIGTERM: it finishes its batch. Killed at any moment, it resumes
// from the positions saved with the rows when started again (without --from-scratch).

import { PgStore, RelayApi, RelayApiError, RelayConsumer } from '@relay/consumer';

const RESYNC_PAUSE_MS = 1_000;
const RESYNC_PATIENCE_MS = 10 * 60_000;

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** Empties the store's copies, positions and held changes, in one transaction. */
async function emptyStore(store: PgStore): Promise<number> {
  const client = await store.pool.connect();
  try {
    await client.query('BEGIN');
    const { rows } = await client.query<{ n: string }>('SELECT count(*) AS n FROM relay_positions');
    await client.query('TRUNCATE relay_positions, relay_items, relay_stories, relay_held');
    // Tables of yours derived from the copy: empty them here, with the store's.
    await client.query('COMMIT');
    return Number(rows[0]!.n);
  } catch (error) {
    await client.query('ROLLBACK').catch(() => {});
    throw error;
  } finally {
    client.release();
  }
}

/** Resyncs the endpoint, asking again while its current epoch's snapshot is still being sent. */
async function resync(api: RelayApi, endpoint: string, stopping: () => boolean): Promise<number | undefined> {
  const deadline = Date.now() + RESYNC_PATIENCE_MS;
  let told = false;
  for (;;) {
    try {
      return (await api.resync(endpoint)).epoch;
    } catch (error) {
      if (!(error instanceof RelayApiError && error.status === 409) || Date.now() > deadline) throw error;
      if (!told) console.log(`endpoint ${endpoint}: the last epoch's snapshot is still being sent; asking again`);
      told = true;
    }
    await sleep(RESYNC_PAUSE_MS);
    if (stopping()) return undefined;
  }
}

async function main(): Promise<void> {
  const env = process.env;
  const fromScratch = process.argv.slice(2).includes('--from-scratch') || ['1', 'true', 'yes'].includes((env.RELAY_FROM_SCRATCH ?? '').toLowerCase());
  const amqpUrl = env.RELAY_AMQP_URL;
  const queue = env.RELAY_QUEUE;
  const database = env.RELAY_STORE_DSN;
  if (!amqpUrl || !queue || !database) throw new Error('set RELAY_AMQP_URL, RELAY_QUEUE and RELAY_STORE_DSN');
  const api = env.RELAY_API_URL && env.RELAY_API_TOKEN ? new RelayApi(env.RELAY_API_URL, env.RELAY_API_TOKEN) : undefined;
  if (fromScratch && !api) throw new Error('--from-scratch resyncs through the API: set RELAY_API_URL and RELAY_API_TOKEN');

  let consumer: RelayConsumer | undefined;
  let stopping = false;
  const stop = () => {
    stopping = true;
    if (consumer) void consumer.stop();
  };
  process.once('SIGINT', stop);
  process.once('SIGTERM', stop);

  // What the handlers saw, printed once their batch is committed (the 'applied' event): a batch
  // rolled back and tried again prints nothing twice.
  let pending: string[] = [];
  const begun = new Map<string, number>();
  const store = new PgStore({
    connection: database,
    migrate: false,
    handlers: {
      snapshotBegin: (change) => {
        begun.set(change.webhook_endpoint_id, Date.now());
        pending.push(`endpoint ${change.webhook_endpoint_id}: epoch ${change.epoch} begins, rebuilding from its snapshot`);
      },
      // Called after the batch's writes: the counts are the copy as the batch left it.
      snapshotEnd: async (change, { client }) => {
        const endpoint = change.webhook_endpoint_id;
        const { rows } = await client.query<{ items: string; stories: string }>(
          `SELECT (SELECT count(*) FROM relay_items WHERE endpoint_id = $1 AND NOT tombstone) AS items,
                  (SELECT count(*) FROM relay_stories WHERE endpoint_id = $1) AS stories`,
          [endpoint],
        );
        const since = begun.get(endpoint);
        begun.delete(endpoint);
        const took = since === undefined ? '' : `, ${((Date.now() - since) / 1000).toFixed(1)} s`;
        pending.push(`endpoint ${endpoint}: rebuilt (epoch ${change.epoch}: ${rows[0]!.items} items, ${rows[0]!.stories} stories${took})`);
      },
      // Handed once each, after its batch committed, in a transaction of its own.
      notification: (n) => console.log(`endpoint ${n.endpoint}: notification ${n.story_id} (${n.ticker ?? '-'})`),
    },
  });
  try {
    await store.migrate();
    if (fromScratch) {
      const held = await emptyStore(store);
      console.log(`the store is empty (it held ${held} endpoints' positions)`);
      let endpoints = 0;
      for (const endpoint of await api!.endpoints()) {
        if (stopping) break;
        const epoch = await resync(api!, endpoint.id, () => stopping);
        if (epoch === undefined) break;
        endpoints += 1;
        console.log(`endpoint ${endpoint.id} (${endpoint.source}): resync asked, epoch ${epoch}`);
      }
      if (!stopping) console.log(`${endpoints} endpoints resynced`);
    }
    if (stopping) return;

    const starting = new RelayConsumer({ amqpUrl, queue, store, api });
    starting.on('applied', () => {
      for (const line of pending) console.log(line);
      pending = [];
    });
    // A batch that did not commit (the store or the broker lost) comes again: what its handlers
    // saw is not printed.
    starting.on('error', (error: Error) => {
      pending = [];
      console.warn(`relay-consumer: ${error.message}`);
    });
    starting.on('gap', (gap) => console.warn(`endpoint ${gap.endpoint}: waiting for change_seq ${gap.from}..${gap.to} of epoch ${gap.epoch}`));
    starting.on('replay', (r) => console.warn(`endpoint ${r.endpoint}: replay from ${r.from}: ${r.error ? r.error.message : JSON.stringify(r.answer)}`));
    starting.on('refused', (error) => console.error(error.message));
    await starting.start();
    consumer = starting;
    console.log(`consuming ${queue}`);
    if (stopping) void starting.stop();
    await starting.done;
    console.log(`stopped: ${JSON.stringify(starting.stats())}`);
  } finally {
    await store.close();
  }
}

main().catch((error) => {
  console.error(error);
  process.exitCode = 1;
});
