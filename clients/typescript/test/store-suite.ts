// The behaviour both stores share, run against each (test/unit/memory-store.test.ts,
// test/pg/pg-store.test.ts).

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Handlers, NotificationRecord, Store } from '../src/store';
import { endpointId, feed, remove, story, upsert } from './helpers';

export interface StoryState {
  version: number;
  closed: boolean;
  merged_into: string | null;
  story: Record<string, unknown> | null;
}

export interface Harness {
  store: Store;
  items(endpoint: string): Promise<Map<string, Record<string, unknown>>>;
  /** Subjects held as tombstones. */
  tombstones(endpoint: string): Promise<string[]>;
  stories(endpoint: string): Promise<Map<string, StoryState>>;
}

export interface SuiteOptions {
  /** Makes a store with these handlers (an empty store of its own). */
  make(handlers: Handlers<any>): Promise<Harness>;
}

export function storeSuite(name: string, options: SuiteOptions): void {
  const make = options.make;

  test(`${name}: applies a run in order with its position; a repeat of it is skipped`, async () => {
    const h = await make({});
    const e = endpointId();
    const run = [upsert(e, 1, 1, 'a', 1, '0001', { n: 1 }), upsert(e, 1, 2, 'b', 1, '0001', { n: 2 }), upsert(e, 1, 3, 'a', 1, '0002', { n: 3 })];
    assert.deepEqual(await h.store.apply(run), { applied: 3, skipped: 0, declined: 0, notifications: 0, repeatedNotifications: 0 });
    assert.deepEqual((await h.store.positions()).get(e), { epoch: 1, lastChangeSeq: 3 });
    assert.deepEqual(await h.items(e), new Map([['a', { n: 3 }], ['b', { n: 2 }]]));
    const again = await h.store.apply(run);
    assert.equal(again.applied, 0);
    assert.equal(again.skipped, 3);
    assert.deepEqual(await h.items(e), new Map([['a', { n: 3 }], ['b', { n: 2 }]]));
    // A change that does not follow the position (a gap) is not applied.
    const ahead = await h.store.apply([upsert(e, 1, 5, 'c', 1, '0001', { n: 5 })]);
    assert.equal(ahead.skipped, 1);
    assert.deepEqual((await h.store.positions()).get(e), { epoch: 1, lastChangeSeq: 3 });
    assert.equal((await h.items(e)).has('c'), false);
    // A first change of an endpoint other than change_seq 1 is not applied either.
    const g = endpointId();
    assert.equal((await h.store.apply([upsert(g, 1, 2, 'x', 1, '0001', {})])).skipped, 1);
    assert.equal((await h.store.positions()).has(g), false);
    await h.store.close();
  });

  test(`${name}: a feed write wins only when newer (generation, then sequence as bytes, then a removal)`, async () => {
    const h = await make({});
    const e = endpointId();
    let seq = 0;
    const next = () => ++seq;
    await h.store.apply([upsert(e, 1, next(), 's', 1, '0002', { v: 'first' })]);
    const older = await h.store.apply([upsert(e, 1, next(), 's', 1, '0001', { v: 'older' })]);
    assert.equal(older.applied, 1);
    assert.equal(older.declined, 1, 'an older sequence is declined, the position still moves');
    assert.deepEqual((await h.store.positions()).get(e), { epoch: 1, lastChangeSeq: 2 });
    assert.deepEqual((await h.items(e)).get('s'), { v: 'first' });
    // 'a' (0x61) is after 'Z' (0x5a) as bytes, whatever a locale would say.
    await h.store.apply([upsert(e, 1, next(), 't', 1, 'Z', { v: 'Z' })]);
    assert.equal((await h.store.apply([upsert(e, 1, next(), 't', 1, 'a', { v: 'a' })])).declined, 0);
    assert.equal((await h.store.apply([upsert(e, 1, next(), 't', 1, 'Zz', { v: 'Zz' })])).declined, 1);
    // 'é' (0xc3 0xa9) is after 'z' (0x7a) as UTF-8 bytes.
    await h.store.apply([upsert(e, 1, next(), 'u', 1, 'z', { v: 'z' })]);
    assert.equal((await h.store.apply([upsert(e, 1, next(), 'u', 1, 'é', { v: 'é' })])).declined, 0);
    assert.deepEqual((await h.items(e)).get('u'), { v: 'é' });
    // A newer generation wins whatever its sequence.
    assert.equal((await h.store.apply([upsert(e, 1, next(), 's', 2, '0000', { v: 'gen2' })])).declined, 0);
    assert.deepEqual((await h.items(e)).get('s'), { v: 'gen2' });
    // A removal at the same sequence over an item wins: a tombstone; an upsert at it does not.
    assert.equal((await h.store.apply([remove(e, 1, next(), 's', 2, '0000')])).declined, 0);
    assert.equal((await h.items(e)).has('s'), false);
    assert.deepEqual(await h.tombstones(e), ['s']);
    assert.equal((await h.store.apply([upsert(e, 1, next(), 's', 2, '0000', { v: 'back' })])).declined, 1);
    assert.equal((await h.store.apply([remove(e, 1, next(), 's', 2, '0000')])).declined, 1);
    assert.equal((await h.store.apply([upsert(e, 1, next(), 's', 2, '0001', { v: 'back' })])).declined, 0);
    assert.deepEqual((await h.items(e)).get('s'), { v: 'back' });
    await h.store.close();
  });

  test(`${name}: a reload's removal drops only a row of an older generation`, async () => {
    const h = await make({});
    const e = endpointId();
    await h.store.apply([upsert(e, 1, 1, 'old', 1, '0001', {}), upsert(e, 1, 2, 'new', 2, '0001', {})]);
    const drop = (seq: number, subject: string) =>
      feed(e, 1, seq, { operation: 'remove', subject, generation: 2, sequence: null, event_id: null, reload_generation: 2 });
    const out = await h.store.apply([drop(3, 'old'), drop(4, 'new')]);
    assert.equal(out.applied, 2);
    assert.equal(out.declined, 1);
    assert.deepEqual([...(await h.items(e)).keys()], ['new']);
    assert.deepEqual(await h.tombstones(e), []);
    await h.store.close();
  });

  test(`${name}: snapshot_begin of a new epoch forgets what was held; the snapshot rebuilds it`, async () => {
    const h = await make({});
    const e = endpointId();
    await h.store.apply([upsert(e, 1, 1, 'a', 1, '0001', {}), upsert(e, 1, 2, 'b', 1, '0001', {}), story(e, 1, 3)]);
    const snap = [
      feed(e, 2, 1, { operation: 'snapshot_begin' }),
      feed(e, 2, 2, { operation: 'upsert', subject: 'b', generation: 1, sequence: '0001', item: { again: true }, event_id: null, snapshot: true }),
      feed(e, 2, 3, { operation: 'snapshot_end' }),
    ];
    const out = await h.store.apply(snap);
    assert.equal(out.applied, 3);
    assert.equal(out.declined, 0);
    assert.deepEqual(await h.items(e), new Map([['b', { again: true }]]));
    assert.equal((await h.stories(e)).size, 0);
    assert.deepEqual((await h.store.positions()).get(e), { epoch: 2, lastChangeSeq: 3 });
    // The old epoch's changes are past now.
    assert.equal((await h.store.apply([upsert(e, 1, 3, 'z', 1, '0001', {})])).skipped, 1);
    await h.store.close();
  });

  test(`${name}: stories are saved when newer, closed for good (merges kept), dropped while open`, async () => {
    const h = await make({});
    const e = endpointId();
    const s = (seq: number, extra: Parameters<typeof story>[3]) => story(e, 1, seq, extra);
    await h.store.apply([s(1, { story_id: 'x', version: 1 }), s(2, { story_id: 'x', version: 2 })]);
    assert.equal((await h.store.apply([s(3, { story_id: 'x', version: 1 })])).declined, 1);
    assert.deepEqual((await h.stories(e)).get('x'), { version: 2, closed: false, merged_into: null, story: { id: 'x', headline: 'v2' } });
    await h.store.apply([s(4, { story_id: 'x', version: 3, operation: 'closed', merged_into: 'y' })]);
    assert.deepEqual((await h.stories(e)).get('x'), { version: 3, closed: true, merged_into: 'y', story: null });
    // Closed for good: neither a later save nor a drop brings it back or removes it.
    const after = await h.store.apply([
      s(5, { story_id: 'x', version: 9 }),
      s(6, { story_id: 'x', operation: 'dropped', event_id: null, reload_round: 1 }),
      s(7, { story_id: 'x', version: 2, operation: 'closed' }),
    ]);
    assert.equal(after.applied, 3);
    assert.equal(after.declined, 3);
    assert.deepEqual((await h.stories(e)).get('x'), { version: 3, closed: true, merged_into: 'y', story: null });
    // A close at a greater version is kept as the greatest.
    assert.equal((await h.store.apply([s(8, { story_id: 'x', version: 5, operation: 'closed' })])).declined, 0);
    assert.equal((await h.stories(e)).get('x')?.version, 5);
    // An open story dropped goes.
    await h.store.apply([s(9, { story_id: 'o', version: 1 }), s(10, { story_id: 'o', operation: 'dropped', event_id: null, reload_round: 2 })]);
    assert.equal((await h.stories(e)).has('o'), false);
    // A close of a story never seen is recorded closed.
    await h.store.apply([s(11, { story_id: 'n', version: 4, operation: 'closed' })]);
    assert.deepEqual((await h.stories(e)).get('n'), { version: 4, closed: true, merged_into: null, story: null });
    await h.store.close();
  });

  test(`${name}: a notification is recorded and handed once per story id`, async () => {
    const handed: NotificationRecord[] = [];
    let failNext = false;
    const h = await make({
      notification: (n: NotificationRecord) => {
        if (failNext) {
          failNext = false;
          throw new Error('the user could not take it now');
        }
        handed.push(n);
      },
    });
    const e = endpointId();
    const first = await h.store.apply([
      story(e, 1, 1, { story_id: 'x' }),
      story(e, 1, 2, { story_id: 'x', operation: 'notified', event_id: 'evt-a' }),
      story(e, 1, 3, { story_id: 'y', operation: 'notified', event_id: 'evt-b' }),
    ]);
    assert.equal(first.notifications, 2);
    // The same story notified again under another message (a publisher's resend after a crash,
    // or the new epoch after a resync): recorded once.
    const again = await h.store.apply([
      story(e, 1, 4, { story_id: 'x', operation: 'notified', event_id: 'evt-a' }),
      feed(e, 2, 1, { operation: 'snapshot_begin' }),
      feed(e, 2, 2, { operation: 'snapshot_end' }),
      story(e, 2, 3, { story_id: 'y', operation: 'notified', event_id: 'evt-b' }),
    ]);
    assert.equal(again.applied, 4);
    assert.equal(again.notifications, 0);
    assert.equal(again.repeatedNotifications, 2);
    assert.equal(again.declined, 0);
    // A handler that throws leaves the notification pending: handed by the next call.
    failNext = true;
    await assert.rejects(h.store.handPending(), /could not take it/);
    assert.equal(handed.length, 0);
    assert.equal(await h.store.handPending(), 2);
    assert.deepEqual(handed.map((n) => n.story_id).sort(), ['x', 'y']);
    assert.equal(await h.store.handPending(), 0);
    const x = handed.find((n) => n.story_id === 'x')!;
    assert.equal(x.endpoint, e);
    assert.equal(x.event_id, 'evt-a');
    assert.equal(x.epoch, 1);
    assert.equal(x.change_seq, 2);
    assert.deepEqual(x.story, { id: 'x', headline: 'v1' });
    assert.equal(x.changed_at, '2026-12-01T10:00:00.000Z');
    await h.store.close();
  });

  test(`${name}: handlers are called once per change applied, in order, with whether the row was written`, async () => {
    const calls: string[] = [];
    const rec = (what: string) => (c: { change_seq: number }, ctx: { written: boolean }) => {
      calls.push(`${what}:${c.change_seq}:${ctx.written}`);
    };
    const h = await make({
      upsert: rec('upsert'), remove: rec('remove'), snapshotBegin: rec('begin'), snapshotEnd: rec('end'),
      storySaved: rec('saved'), storyClosed: rec('closed'), storyDropped: rec('dropped'),
    });
    const e = endpointId();
    const run = [
      upsert(e, 1, 1, 'a', 1, '0002', {}),
      upsert(e, 1, 2, 'a', 1, '0001', {}),
      remove(e, 1, 3, 'a', 1, '0003'),
      story(e, 1, 4, { story_id: 's' }),
      story(e, 1, 5, { story_id: 's', operation: 'closed' }),
      story(e, 1, 6, { story_id: 's', operation: 'dropped', event_id: null, reload_round: 1 }),
      feed(e, 2, 1, { operation: 'snapshot_begin' }),
      feed(e, 2, 2, { operation: 'snapshot_end' }),
    ];
    await h.store.apply(run);
    await h.store.apply(run);
    assert.deepEqual(calls, [
      'upsert:1:true', 'upsert:2:false', 'remove:3:true', 'saved:4:true', 'closed:5:true', 'dropped:6:false', 'begin:1:true', 'end:2:true',
    ]);
    await h.store.close();
  });
}
