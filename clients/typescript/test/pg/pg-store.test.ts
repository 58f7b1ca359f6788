// The Postgres store against a real server: RELAY_TEST_PG (default
// postgres://postgres@127.0.0.1:5432/postgres). Each store of these tests gets a schema of its
// own, dropped at the end.

import { after, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { Client, PoolClient } from 'pg';
import { MemoryStore } from '../../src/memory-store';
import { Change, StoryMessage } from '../../src/message';
import { PgStore } from '../../src/pg-store';
import { Handlers } from '../../src/store';
import { endpointId, feed, remove, story, upsert } from '../helpers';
import { pick, rng } from '../support/rng';
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
          schema, 'SELECT subject, item FROM relay_items WHERE endpoint_id = $1 AND NOT tombstone ORDER BY subject', [e]);
        return new Map(rows.map((r) => [r.subject, r.item]));
      },
      tombstones: async (e) =>
        (await query<{ subject: string }>(schema, 'SELECT subject FROM relay_items WHERE endpoint_id = $1 AND tombstone ORDER BY subject', [e]))
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
  assert.deepEqual(await query(schema, 'SELECT subject FROM relay_items'), []);
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
  const rows = await query<{ subject: string; item: { i: number } }>(schema, 'SELECT subject, item FROM relay_items ORDER BY subject');
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

// The store writes a batch in a few statements (each row written at most once per statement), not
// one statement per change: the result must be that of applying the changes one by one. The
// memory store applies them one by one; both are given the same random batches (rows written
// several times in a batch, snapshots of new epochs in the middle, repeats, changes out of
// order, late notifications) and must agree on every outcome, every handler call, the
// positions and the tables.
test('postgres store: a batch written in a few statements does as the changes one by one (the memory store)', async () => {
  for (const seed of [1, 2, 3, 4, 5, 6]) {
    const random = rng(seed);
    const schema = await freshSchema();
    const pgCalls: string[] = [];
    const memoryCalls: string[] = [];
    const recorder = (calls: string[]) => {
      const rec = (what: string) => (c: { webhook_endpoint_id: string; epoch: number; change_seq: number }, ctx: { written: boolean }) => {
        calls.push(`${what}:${c.webhook_endpoint_id.slice(0, 4)}:${c.epoch}:${c.change_seq}:${ctx.written}`);
      };
      return {
        upsert: rec('upsert'), remove: rec('remove'), snapshotBegin: rec('begin'), snapshotEnd: rec('end'),
        storySaved: rec('saved'), storyClosed: rec('closed'), storyDropped: rec('dropped'),
      };
    };
    const pg = storeIn(schema, recorder(pgCalls));
    const memory = new MemoryStore({ handlers: recorder(memoryCalls) });
    const endpoints = [endpointId(), endpointId(), endpointId()];

    // Each endpoint's stream: epochs opened by a snapshot, a few subjects and stories written
    // over and over.
    const streams = endpoints.map((e) => {
      const out: Change[] = [];
      let epoch = 1;
      let seq = 0;
      while (out.length < 160) {
        const roll = random();
        if (roll < 0.03 && seq > 0) {
          epoch += 1;
          seq = 0;
          out.push(feed(e, epoch, ++seq, { operation: 'snapshot_begin' }));
          continue;
        }
        if (roll < 0.05) {
          out.push(feed(e, epoch, ++seq, { operation: 'snapshot_end' }));
          continue;
        }
        const subject = pick(random, ['a', 'b', 'c', 'é']);
        const generation = 1 + Math.floor(random() * 3);
        const sequence = pick(random, ['0001', '0002', '0003', 'Z', 'a', 'é']);
        if (roll < 0.35) {
          out.push(upsert(e, epoch, ++seq, subject, generation, sequence, { seq, seed }));
        } else if (roll < 0.45) {
          out.push(remove(e, epoch, ++seq, subject, generation, sequence));
        } else if (roll < 0.5) {
          out.push(feed(e, epoch, ++seq, { operation: 'remove', subject, generation, sequence: null, event_id: null, reload_generation: generation }));
        } else {
          const storyId = pick(random, ['x', 'y', 'z']);
          const version = 1 + Math.floor(random() * 5);
          const r = random();
          if (r < 0.5) out.push(story(e, epoch, ++seq, { story_id: storyId, version, ticker: pick(random, ['A', 'B']) }));
          else if (r < 0.7) out.push(story(e, epoch, ++seq, { story_id: storyId, version, operation: 'closed', ...(random() < 0.5 ? { merged_into: 'w' } : {}) }));
          else if (r < 0.85) out.push(story(e, epoch, ++seq, { story_id: storyId, operation: 'dropped', event_id: null, reload_round: 1 }));
          else out.push(story(e, epoch, ++seq, { story_id: pick(random, ['x', 'y', 'z', 'v']), version, operation: 'notified' }));
        }
      }
      return out;
    });
    const stream: Change[] = [];
    const cursors = streams.map(() => 0);
    while (stream.length < streams.length * 160) {
      const i = Math.floor(random() * streams.length);
      if (cursors[i]! < streams[i]!.length) stream.push(streams[i]![cursors[i]!++]!);
    }

    const applied = async (c: Change) => {
      const at = (await memory.positions()).get(c.webhook_endpoint_id);
      return at !== undefined && (c.epoch < at.epoch || (c.epoch === at.epoch && c.change_seq <= at.lastChangeSeq));
    };
    let multiWrites = 0;
    for (let round = 0; round < 400; round++) {
      let cursor = 0;
      while (cursor < stream.length && (await applied(stream[cursor]!))) cursor += 1;
      if (cursor >= stream.length) break;
      const from = Math.max(0, cursor - Math.floor(random() * 6));
      const batch = stream.slice(from, from + 1 + Math.floor(random() * 60));
      if (random() < 0.3 && batch.length > 2) {
        const i = Math.floor(random() * batch.length);
        const j = Math.floor(random() * batch.length);
        [batch[i], batch[j]] = [batch[j]!, batch[i]!];
      }
      const seen = new Set<string>();
      for (const c of batch) {
        const key = 'kind' in c ? `s:${c.webhook_endpoint_id}:${c.story_id}` : `f:${c.webhook_endpoint_id}:${c.subject}`;
        if (seen.has(key)) multiWrites += 1;
        seen.add(key);
      }
      const late = random() < 0.2
        ? stream.slice(0, from).filter((c): c is StoryMessage => 'kind' in c && c.operation === 'notified' && random() < 0.3)
        : [];
      const context = `seed ${seed}, round ${round}`;
      assert.deepEqual(await pg.apply(batch, late), await memory.apply(batch, late), context);
      assert.deepEqual(pgCalls, memoryCalls, context);
    }
    assert.ok(multiWrites > 50, `seed ${seed}: rows written several times in a batch (${multiWrites})`);

    assert.deepEqual(await pg.positions(), await memory.positions(), `seed ${seed}`);
    for (const e of endpoints) {
      const items = await query<{ subject: string; item_kind: string | null; generation: string; sequence: string | null; tombstone: boolean; item: Record<string, unknown> | null; epoch: string; change_seq: string }>(
        schema, 'SELECT subject, item_kind, generation, sequence, tombstone, item, epoch, change_seq FROM relay_items WHERE endpoint_id = $1 ORDER BY subject', [e]);
      const memoryItems = [...(memory.feed.get(e) ?? new Map()).values()].sort((a, b) => (a.subject < b.subject ? -1 : 1));
      assert.deepEqual(
        items.map((r) => ({ ...r, generation: Number(r.generation), epoch: Number(r.epoch), change_seq: Number(r.change_seq) })),
        memoryItems.map((r) => ({ subject: r.subject, item_kind: r.item_kind, generation: r.generation, sequence: r.sequence, tombstone: r.tombstone, item: r.item, epoch: r.epoch, change_seq: r.change_seq })),
        `seed ${seed}: items of ${e}`);
      const stories = await query<{ story_id: string; ticker: string | null; version: string; closed: boolean; merged_into: string | null; story: Record<string, unknown> | null }>(
        schema, 'SELECT story_id, ticker, version, closed, merged_into, story FROM relay_stories WHERE endpoint_id = $1 ORDER BY story_id', [e]);
      assert.deepEqual(
        stories.map((r) => ({ ...r, version: Number(r.version) })),
        [...memory.storyRows(e).values()].sort((a, b) => (a.story_id < b.story_id ? -1 : 1)),
        `seed ${seed}: stories of ${e}`);
      const notifications = await query<{ story_id: string; epoch: string; change_seq: string }>(
        schema, 'SELECT story_id, epoch, change_seq FROM relay_notifications WHERE endpoint_id = $1 ORDER BY story_id', [e]);
      assert.deepEqual(
        notifications.map((r) => ({ story_id: r.story_id, epoch: Number(r.epoch), change_seq: Number(r.change_seq) })),
        [...(memory.notifications.get(e) ?? new Map()).values()].map((n) => ({ story_id: n.story_id, epoch: n.epoch, change_seq: n.change_seq }))
          .sort((a, b) => (a.story_id < b.story_id ? -1 : 1)),
        `seed ${seed}: notifications of ${e}`);
    }
    await pg.close();
  }
});

test('postgres store: two stores racing on several endpoints, batch by batch, apply each change once', async () => {
  const schema = await freshSchema();
  const a = storeIn(schema);
  await a.positions();
  const b = storeIn(schema);
  const endpoints = [endpointId(), endpointId(), endpointId()];
  const run = endpoints.flatMap((e) => Array.from({ length: 60 }, (_, i) => upsert(e, 1, i + 1, `s${i % 5}`, 1, String(i).padStart(4, '0'), { i })));
  // Interleaved, each endpoint in order; each store applies it in batches of its own size.
  const interleaved = Array.from({ length: 60 }, (_, i) => endpoints.map((_, k) => run[k * 60 + i]!)).flat();
  const inBatches = async (store: PgStore, size: number) => {
    let applied = 0;
    for (let i = 0; i < interleaved.length; i += size) applied += (await store.apply(interleaved.slice(i, i + size))).applied;
    return applied;
  };
  const [x, y] = await Promise.all([inBatches(a, 17), inBatches(b, 23)]);
  assert.equal(x + y, 180);
  const positions = await a.positions();
  for (const e of endpoints) assert.deepEqual(positions.get(e), { epoch: 1, lastChangeSeq: 60 });
  const rows = await query<{ n: string }>(schema, 'SELECT count(*) AS n FROM relay_items WHERE (item->>\'i\')::int >= 55');
  assert.equal(Number(rows[0]!.n), 15);
  await a.close();
  await b.close();
});
