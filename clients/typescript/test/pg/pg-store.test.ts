// The Postgres store against a real server: RELAY_TEST_PG (default
// postgres://postgres@127.0.0.1:5432/postgres). Each store of these tests gets a schema of its
// own, dropped at the end.

import { after, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { Client, PoolClient } from 'pg';
import { PgStore } from '../../src/pg-store';
import { Handlers } from '../../src/store';
import { endpointId, story, upsert } from '../helpers';
import { storeSuite } from '../store-suite';

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
  const schema = `relay_ts_test_${randomBytes(6).toString('hex')}`;
  await admin((c) => c.query(`CREATE SCHEMA ${schema}`));
  schemas.push(schema);
  return schema;
}

function storeIn(schema: string, handlers: Handlers<PoolClient> = {}): PgStore {
  return new PgStore({ connection: { connectionString: URL, max: 4, options: `-c search_path=${schema}` }, handlers });
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

storeSuite('postgres store', {
  async make(handlers) {
    const schema = await freshSchema();
    const store = storeIn(schema, handlers);
    return {
      store,
      items: async (e) => {
        const rows = await query<{ subject: string; item: Record<string, unknown> }>(
          schema, 'SELECT subject, item FROM relay_feed_items WHERE endpoint_id = $1 AND NOT tombstone ORDER BY subject', [e]);
        return new Map(rows.map((r) => [r.subject, r.item]));
      },
      tombstones: async (e) =>
        (await query<{ subject: string }>(schema, 'SELECT subject FROM relay_feed_items WHERE endpoint_id = $1 AND tombstone ORDER BY subject', [e]))
          .map((r) => r.subject),
      stories: async (e) => {
        const rows = await query<{ story_id: string; version: string; closed: boolean; merged_into: string | null; story: Record<string, unknown> | null }>(
          schema, 'SELECT story_id, version, closed, merged_into, story FROM relay_stories WHERE endpoint_id = $1', [e]);
        return new Map(rows.map((r) => [r.story_id, { version: Number(r.version), closed: r.closed, merged_into: r.merged_into, story: r.story }]));
      },
    };
  },
});

test('postgres store: a handler that throws rolls the whole batch back, its position with it', async () => {
  const schema = await freshSchema();
  let fail = true;
  const store = storeIn(schema, {
    upsert: async (change, { client }) => {
      await client.query('CREATE TABLE IF NOT EXISTS mine (seq bigint)');
      await client.query('INSERT INTO mine VALUES ($1)', [change.change_seq]);
      if (fail && change.change_seq === 2) throw new Error('the handler failed');
    },
  });
  const e = endpointId();
  const run = [upsert(e, 1, 1, 'a', 1, '1', {}), upsert(e, 1, 2, 'b', 1, '1', {})];
  await assert.rejects(store.apply(run), /the handler failed/);
  assert.equal((await store.positions()).has(e), false);
  assert.deepEqual(await query(schema, 'SELECT subject FROM relay_feed_items'), []);
  fail = false;
  assert.equal((await store.apply(run)).applied, 2);
  // What the handler wrote through the transaction's client committed with the changes.
  assert.deepEqual((await query<{ seq: string }>(schema, 'SELECT seq FROM mine ORDER BY seq')).map((r) => Number(r.seq)), [1, 2]);
  assert.deepEqual((await store.positions()).get(e), { epoch: 1, lastChangeSeq: 2 });
  await store.close();
});

test('postgres store: two stores applying the same changes at once apply each once', async () => {
  const schema = await freshSchema();
  const a = storeIn(schema);
  await a.positions(); // the tables exist before the race
  const b = storeIn(schema);
  const e = endpointId();
  const run = Array.from({ length: 40 }, (_, i) => upsert(e, 1, i + 1, `s${i % 7}`, 1, String(i).padStart(4, '0'), { i }));
  const [x, y] = await Promise.all([a.apply(run), b.apply(run)]);
  assert.equal(x.applied + y.applied, 40);
  assert.equal(x.skipped + y.skipped, 40);
  assert.deepEqual((await a.positions()).get(e), { epoch: 1, lastChangeSeq: 40 });
  const rows = await query<{ subject: string; item: { i: number } }>(schema, 'SELECT subject, item FROM relay_feed_items ORDER BY subject');
  assert.deepEqual(rows.map((r) => [r.subject, r.item.i]), [['s0', 35], ['s1', 36], ['s2', 37], ['s3', 38], ['s4', 39], ['s5', 33], ['s6', 34]]);
  await a.close();
  await b.close();
});

test('postgres store: positions and pending notifications survive a restart', async () => {
  const schema = await freshSchema();
  const e = endpointId();
  const first = storeIn(schema);
  await first.apply([story(e, 1, 1, { story_id: 'x' }), story(e, 1, 2, { story_id: 'x', operation: 'notified' })]);
  await first.close(); // stopped before handing the notification
  const handed: string[] = [];
  const second = storeIn(schema, { notification: (n) => void handed.push(`${n.story_id}@${n.change_seq}`) });
  assert.deepEqual((await second.positions()).get(e), { epoch: 1, lastChangeSeq: 2 });
  assert.equal((await second.apply([story(e, 1, 2, { story_id: 'x', operation: 'notified' })])).skipped, 1);
  assert.equal(await second.handPending(), 1);
  assert.deepEqual(handed, ['x@2']);
  assert.equal(await second.handPending(), 0);
  const [row] = await query<{ handed_at: Date | null }>(schema, 'SELECT handed_at FROM relay_notifications');
  assert.ok(row && row.handed_at instanceof Date);
  await second.close();
});

test('postgres store: what the notification handler writes commits with the hand-over, or neither', async () => {
  const schema = await freshSchema();
  const e = endpointId();
  let fail = true;
  const store = storeIn(schema, {
    notification: async (n, { client }) => {
      await client.query('CREATE TABLE IF NOT EXISTS outbox (story_id text)');
      await client.query('INSERT INTO outbox VALUES ($1)', [n.story_id]);
      if (fail) throw new Error('send failed');
    },
  });
  await store.apply([story(e, 1, 1, { story_id: 'x', operation: 'notified' })]);
  await assert.rejects(store.handPending(), /send failed/);
  const pending = await query<{ n: string }>(schema, 'SELECT count(*) AS n FROM relay_notifications WHERE handed_at IS NULL');
  assert.equal(Number(pending[0]!.n), 1);
  fail = false;
  assert.equal(await store.handPending(), 1);
  assert.deepEqual(await query(schema, 'SELECT story_id FROM outbox'), [{ story_id: 'x' }]);
  await store.close();
});
