// The store schema, version 1 (clients/README.md): its migration from nothing and from either
// library's tables before versioning, a newer schema refused, held changes kept durably, the
// snapshot flag, repeated notifications counted; and a consumer whose database connections are
// terminated mid-run (as a restart does) carrying on to the same result. RELAY_TEST_PG, a schema
// of its own per test.

import { after, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { Client } from 'pg';
import { RelayConsumer } from '../../src/consumer';
import { PermanentError } from '../../src/errors';
import { MemoryStore } from '../../src/memory-store';
import { Change } from '../../src/message';
import { LIBRARY, PgStore } from '../../src/pg-store';
import { FakeBroker, until } from '../support/broker';
import { endpointId, feed, remove, story, TENANT, upsert } from '../helpers';
import { rng } from '../support/rng';

const URL = process.env.RELAY_TEST_PG ?? 'postgres://postgres@127.0.0.1:5432/postgres';
const schemas: string[] = [];

async function admin<T>(run: (client: Client) => Promise<T>): Promise<T> {
  const client = new Client({ connectionString: URL });
  await client.connect();
  try {
    return await run(client);
  } finally {
    await client.end();
  }
}

async function freshSchema(): Promise<string> {
  const schema = `relay_ts_schema_${randomBytes(6).toString('hex')}`;
  await admin((c) => c.query(`CREATE SCHEMA ${schema}`));
  schemas.push(schema);
  return schema;
}

function storeIn(schema: string, name = 'relay-ts-test'): PgStore {
  return new PgStore({ connection: { connectionString: URL, max: 4, options: `-c search_path=${schema}`, application_name: name } });
}

async function query<R extends Record<string, unknown>>(schema: string, text: string, values: unknown[] = []): Promise<R[]> {
  return admin(async (c) => {
    await c.query(`SET search_path = ${schema}`);
    return (await c.query<R>(text, values)).rows;
  });
}

after(async () => {
  await admin(async (c) => {
    for (const schema of schemas) await c.query(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
  });
});

/** The TypeScript library's tables before version 1 (its SCHEMA_SQL then). */
const TS_BEFORE = `
CREATE TABLE relay_positions (endpoint_id uuid PRIMARY KEY, tenant_id uuid NOT NULL, epoch bigint NOT NULL,
  last_change_seq bigint NOT NULL, updated_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE relay_feed_items (endpoint_id uuid NOT NULL, subject text NOT NULL, item_kind text, generation bigint NOT NULL,
  sequence text COLLATE "C", tombstone boolean NOT NULL, item jsonb, epoch bigint NOT NULL, change_seq bigint NOT NULL,
  changed_at timestamptz NOT NULL, PRIMARY KEY (endpoint_id, subject));
CREATE TABLE relay_stories (endpoint_id uuid NOT NULL, story_id text NOT NULL, ticker text, version bigint NOT NULL,
  closed boolean NOT NULL, merged_into text, story jsonb, epoch bigint NOT NULL, change_seq bigint NOT NULL,
  changed_at timestamptz NOT NULL, PRIMARY KEY (endpoint_id, story_id));
CREATE TABLE relay_notifications (endpoint_id uuid NOT NULL, story_id text NOT NULL, ticker text, version bigint NOT NULL,
  event_id text, story jsonb, epoch bigint NOT NULL, change_seq bigint NOT NULL, changed_at timestamptz NOT NULL,
  recorded_at timestamptz NOT NULL DEFAULT now(), handed_at timestamptz, PRIMARY KEY (endpoint_id, story_id));
CREATE INDEX relay_notifications_pending ON relay_notifications (recorded_at) WHERE handed_at IS NULL;
`;

/** The Python library's tables before version 1 (its SCHEMA then). */
const PYTHON_BEFORE = `
CREATE TABLE relay_positions (endpoint_id uuid PRIMARY KEY, epoch bigint NOT NULL, last_change_seq bigint NOT NULL,
  snapshot_open boolean NOT NULL DEFAULT false, updated_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE relay_items (endpoint_id uuid NOT NULL, subject text NOT NULL, item_kind text, generation bigint NOT NULL,
  sequence text, item jsonb NOT NULL, epoch bigint NOT NULL, change_seq bigint NOT NULL, changed_at timestamptz NOT NULL,
  PRIMARY KEY (endpoint_id, subject));
CREATE TABLE relay_stories (endpoint_id uuid NOT NULL, story_id text NOT NULL, ticker text, version bigint NOT NULL,
  closed boolean NOT NULL, story jsonb, merged_into text, epoch bigint NOT NULL, change_seq bigint NOT NULL,
  changed_at timestamptz NOT NULL, PRIMARY KEY (endpoint_id, story_id));
CREATE TABLE relay_notifications (endpoint_id uuid NOT NULL, story_id text NOT NULL, ticker text, version bigint NOT NULL,
  event_id text, story jsonb, epoch bigint NOT NULL, change_seq bigint NOT NULL, changed_at timestamptz NOT NULL,
  recorded_at timestamptz NOT NULL DEFAULT now(), handed_at timestamptz, repeats integer NOT NULL DEFAULT 0,
  PRIMARY KEY (endpoint_id, story_id));
CREATE INDEX relay_notifications_unhanded ON relay_notifications (recorded_at) WHERE handed_at IS NULL;
CREATE TABLE relay_held (endpoint_id uuid NOT NULL, epoch bigint NOT NULL, change_seq bigint NOT NULL, body jsonb NOT NULL,
  held_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (endpoint_id, epoch, change_seq));
`;

interface Column {
  table_name: string;
  column_name: string;
  data_type: string;
  is_nullable: string;
  collation_name: string | null;
}

/** The layout of the store's tables: columns (type, nullability, collation) and indexes. */
async function layout(schema: string): Promise<{ columns: string[]; indexes: string[] }> {
  const columns = await query<Column & Record<string, unknown>>(schema,
    `SELECT table_name, column_name, data_type, is_nullable, collation_name FROM information_schema.columns
     WHERE table_schema = $1 AND table_name LIKE 'relay_%' AND table_name <> 'relay_consumer_schema'`, [schema]);
  const indexes = await query<{ indexname: string; indexdef: string }>(schema,
    `SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = $1 AND tablename LIKE 'relay_%'`, [schema]);
  return {
    columns: columns.map((c) => `${c.table_name}.${c.column_name} ${c.data_type} ${c.is_nullable === 'YES' ? 'null' : 'not null'}${c.collation_name ? ` collate ${c.collation_name}` : ''}`).sort(),
    // Without the name: the primary key of a renamed table keeps its name (relay_feed_items_pkey).
    indexes: indexes.map((i) => i.indexdef.replace(`${schema}.`, '').replace(/INDEX \S+ ON/, 'INDEX ON')).sort(),
  };
}

test('schema: version 1 from nothing, recorded once; a second open applies nothing', async () => {
  const schema = await freshSchema();
  const store = storeIn(schema);
  assert.deepEqual(await store.migrate(), [1]);
  assert.deepEqual(await store.migrate(), []);
  const rows = await query<{ version: number; library: string }>(schema, 'SELECT version, library FROM relay_consumer_schema');
  assert.deepEqual(rows, [{ version: 1, library: LIBRARY }]);
  assert.equal(LIBRARY, 'relay-consumer-typescript 1.0.0');
  const { columns, indexes } = await layout(schema);
  assert.ok(columns.includes('relay_items.sequence text null collate C'));
  assert.ok(columns.includes('relay_items.tombstone boolean not null'));
  assert.ok(columns.includes('relay_positions.tenant_id uuid null'));
  assert.ok(columns.includes('relay_held.body jsonb not null'));
  assert.ok(indexes.some((i) => i.includes('ON relay_notifications USING btree (recorded_at) WHERE (handed_at IS NULL)')));
  await store.close();
  await store.close(); // a second close does nothing
});

test('schema: both libraries\' tables before version 1 migrate to the layout made from nothing, rows kept', async () => {
  const fresh = await freshSchema();
  const made = storeIn(fresh);
  await made.migrate();
  await made.close();
  const expected = await layout(fresh);

  const e = endpointId();
  for (const [name, before, item] of [
    ['typescript', TS_BEFORE, `INSERT INTO relay_feed_items VALUES ('${e}', 's', 'k', 1, '0001', false, '{"a":1}', 1, 2, now());
      INSERT INTO relay_positions VALUES ('${e}', '${TENANT}', 1, 2, now());`],
    ['python', PYTHON_BEFORE, `INSERT INTO relay_items VALUES ('${e}', 's', 'k', 1, '0001', '{"a":1}', 1, 2, now());
      INSERT INTO relay_positions VALUES ('${e}', 1, 2, false, now());`],
  ] as const) {
    const schema = await freshSchema();
    await query(schema, `${before}${item}`);
    const store = storeIn(schema);
    assert.deepEqual(await store.migrate(), [1], name);
    assert.deepEqual(await layout(schema), expected, `${name}: the same layout as a store made from nothing`);
    assert.deepEqual((await store.positions()).get(e), { epoch: 1, lastChangeSeq: 2 }, name);
    const items = await query<{ subject: string; item: unknown; tombstone: boolean }>(schema, 'SELECT subject, item, tombstone FROM relay_items');
    assert.deepEqual(items, [{ subject: 's', item: { a: 1 }, tombstone: false }], name);
    // And it is written on as any store: a removal leaves a tombstone.
    await store.apply([remove(e, 1, 3, 's', 1, '0002')]);
    assert.deepEqual(await query(schema, 'SELECT subject, item, tombstone FROM relay_items'), [{ subject: 's', item: null, tombstone: true }], name);
    await store.close();
  }
});

test('schema: a newer schema is refused (schema_newer); a missing database is store_missing', async () => {
  const schema = await freshSchema();
  const first = storeIn(schema);
  await first.migrate();
  await first.close();
  await query(schema, `INSERT INTO relay_consumer_schema (version, library) VALUES (2, 'relay-consumer-python 2.0.0')`);
  await assert.rejects(
    PgStore.open({ connectionString: URL, options: `-c search_path=${schema}` }),
    (error: Error) => error instanceof PermanentError && error.causeKind === 'schema_newer' && /version 2 \(relay-consumer-python 2\.0\.0\)/.test(error.message),
  );
  const lazy = storeIn(schema);
  await assert.rejects(lazy.positions(), (error: Error) => error instanceof PermanentError && error.causeKind === 'schema_newer');
  await lazy.close();

  const missing = new globalThis.URL(URL);
  missing.pathname = `/relay_ts_no_such_${randomBytes(4).toString('hex')}`;
  await assert.rejects(PgStore.open(missing.toString()), (error: Error) => error instanceof PermanentError && error.causeKind === 'store_missing');
});

test('schema: stores opened at once migrate once', async () => {
  const schema = await freshSchema();
  const stores = Array.from({ length: 4 }, () => storeIn(schema));
  const applied = await Promise.all(stores.map((s) => s.migrate()));
  assert.deepEqual(applied.map((a) => a.length).sort(), [0, 0, 0, 1]);
  assert.equal((await query(schema, 'SELECT * FROM relay_consumer_schema')).length, 1);
  for (const s of stores) await s.close();
});

test('schema: held changes kept with their batch, forgotten when applied or when their epoch ends', async () => {
  const schema = await freshSchema();
  const store = storeIn(schema);
  const e = endpointId();
  const held = async () => (await store.held()).map((c) => `${c.epoch}:${c.change_seq}`).sort();
  await store.apply([feed(e, 1, 1)], [], [feed(e, 1, 3), story(e, 1, 5, { operation: 'notified' })]);
  assert.deepEqual(await held(), ['1:3', '1:5']);
  const [row] = await query<{ body: Record<string, unknown> }>(schema, `SELECT body FROM relay_held WHERE change_seq = 5`);
  assert.equal(row!.body.kind, 'notification', 'the message as it came');
  // 2 comes, 3 follows: both applied, 3 forgotten; 5 still held.
  await store.apply([feed(e, 1, 2), feed(e, 1, 3)]);
  assert.deepEqual(await held(), ['1:5']);
  // A change of epoch 2 held: epoch 1's are forgotten.
  await store.apply([], [], [feed(e, 2, 4)]);
  assert.deepEqual(await held(), ['2:4']);
  // The position reaching epoch 3: epoch 2's forgotten.
  await store.apply([feed(e, 3, 1, { operation: 'snapshot_begin' })]);
  assert.deepEqual(await held(), []);
  await store.close();
});

test('schema: snapshot_open while a snapshot is received; repeated notifications counted', async () => {
  const schema = await freshSchema();
  const store = storeIn(schema);
  const e = endpointId();
  const open = async () => (await query<{ snapshot_open: boolean }>(schema, 'SELECT snapshot_open FROM relay_positions'))[0]!.snapshot_open;
  await store.apply([feed(e, 1, 1, { operation: 'snapshot_begin' }), upsert(e, 1, 2, 'a', 1, '1', {})]);
  assert.equal(await open(), true);
  await store.apply([feed(e, 1, 3, { operation: 'snapshot_end' })]);
  assert.equal(await open(), false);
  await store.apply([story(e, 1, 4, { story_id: 'x', operation: 'notified' }), story(e, 1, 5, { story_id: 'x', operation: 'notified' })]);
  await store.apply([story(e, 1, 6, { story_id: 'x', operation: 'notified' })]);
  assert.deepEqual(await query(schema, 'SELECT story_id, repeats, change_seq FROM relay_notifications'), [{ story_id: 'x', repeats: 2, change_seq: '4' }]);
  // A late one (of an ended epoch) is not a repeat of the stream.
  const outcome = await store.apply([], [story(e, 1, 7, { story_id: 'x', operation: 'notified' })]);
  assert.equal(outcome.repeatedNotifications, 1);
  assert.deepEqual(await query(schema, 'SELECT repeats FROM relay_notifications'), [{ repeats: 2 }]);
  await store.close();
});

test('consumer and Postgres store: connections terminated mid-run (a restart), it carries on to the same copy', async () => {
  const schema = await freshSchema();
  const name = `relay-ts-restart-${randomBytes(3).toString('hex')}`;
  const store = storeIn(schema, name);
  const broker = new FakeBroker();
  const errors: string[] = [];
  const consumer = new RelayConsumer({
    amqpUrl: 'amqp://x', queue: `relay.tenant.${TENANT}`, store, connect: broker.connect, batchMax: 7, prefetch: 20,
    backoffInitialMs: 20, onError: (e) => errors.push(e.cause),
  });
  await consumer.start();
  const random = rng(7);
  const endpoints = [endpointId(), endpointId()];
  const changes: Change[] = [];
  for (const e of endpoints) {
    for (let i = 1; i <= 150; i++) changes.push(upsert(e, 1, i, `s${i % 9}`, 1, String(i).padStart(4, '0'), { i }));
  }
  // Out of order a little (some held), both endpoints interleaved.
  for (let i = 0; i < changes.length - 1; i++) if (random() < 0.2) [changes[i], changes[i + 1]] = [changes[i + 1]!, changes[i]!];
  const terminate = () => admin((c) => c.query('SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1', [name]));
  for (let k = 0; k < changes.length; k += 60) {
    broker.publish(...changes.slice(k, k + 60));
    await new Promise((r) => setTimeout(r, 15));
    await terminate();
  }
  await until(() => endpoints.every((e) => consumer.stats().endpoints[e]?.lastChangeSeq === 150), 20_000, 'both streams applied');
  const expected = new MemoryStore();
  await expected.apply(endpoints.flatMap((e) => changes.filter((c) => c.webhook_endpoint_id === e).sort((a, b) => a.change_seq - b.change_seq)));
  for (const e of endpoints) {
    const rows = await query<{ subject: string; item: Record<string, unknown> }>(schema, 'SELECT subject, item FROM relay_items WHERE endpoint_id = $1', [e]);
    assert.deepEqual(new Map(rows.map((r) => [r.subject, r.item])), expected.items(e));
  }
  assert.deepEqual(await query(schema, 'SELECT * FROM relay_held'), []);
  assert.ok(errors.length >= 1, 'the terminations were reported');
  // The query under way fails (57P01, or the connection gone), or the next one on a connection
  // the pool had not yet seen end.
  assert.ok(errors.every((c) => /57P01|terminat|not queryable/i.test(c)), errors.join('\n'));
  await consumer.stop();
  assert.equal(broker.inFlight, 0);
});
