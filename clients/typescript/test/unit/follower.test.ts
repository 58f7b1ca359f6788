import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Follower, Verdict } from '../../src/follower';
import { endpointId, feed, story } from '../helpers';

function seqs(verdict: Verdict): number[] {
  return verdict.outcome === 'apply' ? verdict.apply.map((c) => c.change_seq) : [];
}

test('applies a gapless stream in order and drops repeats', () => {
  const e = endpointId();
  const f = new Follower();
  assert.deepEqual(seqs(f.receive(feed(e, 1, 1))), [1]);
  assert.deepEqual(seqs(f.receive(feed(e, 1, 2))), [2]);
  assert.equal(f.receive(feed(e, 1, 2)).outcome, 'duplicate');
  assert.equal(f.receive(feed(e, 1, 1)).outcome, 'duplicate');
  assert.deepEqual(f.position(e), { epoch: 1, lastChangeSeq: 2 });
  assert.equal(f.stats.duplicates, 2);
});

test('holds a change ahead of its predecessors and applies it when they come', () => {
  const e = endpointId();
  const f = new Follower();
  f.receive(feed(e, 1, 1));
  const held = f.receive(feed(e, 1, 4));
  assert.ok(held.outcome === 'held' && held.expected === 2);
  assert.equal(f.receive(feed(e, 1, 3)).outcome, 'held');
  assert.equal(f.receive(feed(e, 1, 4)).outcome, 'duplicate', 'a change held already is a repeat');
  assert.equal(f.held, 2);
  const gaps = f.gaps();
  assert.deepEqual(gaps.map((g) => [g.endpoint, g.epoch, g.from, g.to, g.held]), [[e, 1, 2, 2, 2]]);
  const verdict = f.receive(feed(e, 1, 2));
  assert.deepEqual(seqs(verdict), [2, 3, 4]);
  assert.equal(f.held, 0);
  assert.deepEqual(f.gaps(), []);
});

test('a change of an older epoch is stale; a greater epoch starts over at change_seq 1', () => {
  const e = endpointId();
  const f = new Follower();
  f.receive(feed(e, 2, 1));
  f.receive(feed(e, 2, 2));
  f.receive(feed(e, 2, 5));
  assert.equal(f.receive(feed(e, 1, 3)).outcome, 'stale');
  // Epoch 3 begins: what was held of epoch 2 can never apply, it comes back as stale.
  const v = f.receive(feed(e, 3, 1, { operation: 'snapshot_begin' }));
  assert.ok(v.outcome === 'apply');
  assert.deepEqual(v.stale.map((c) => [c.epoch, c.change_seq]), [[2, 5]]);
  assert.deepEqual(f.position(e), { epoch: 3, lastChangeSeq: 1 });
  assert.equal(f.held, 0);
  assert.equal(f.stats.snapshots, 1);
  // A greater epoch's change that is not its first waits for change_seq 1.
  const g = endpointId();
  f.receive(feed(g, 1, 1));
  const w = f.receive(feed(g, 2, 2));
  assert.ok(w.outcome === 'held' && w.expected === 1);
  assert.deepEqual(seqs(f.receive(feed(g, 2, 1))), [1, 2]);
});

test('past a hold bound a change is an overflow and nothing changes', () => {
  const e = endpointId();
  const other = endpointId();
  let now = 1000;
  const f = new Follower({ maxHeldPerEndpoint: 2, maxHeldTotal: 3 }, () => now);
  f.receive(feed(e, 1, 1));
  f.receive(feed(e, 1, 5));
  now = 1500;
  f.receive(feed(e, 1, 3));
  const v = f.receive(feed(e, 1, 4));
  assert.ok(v.outcome === 'overflow');
  assert.deepEqual(v.gap, { endpoint: e, epoch: 1, from: 2, to: 2, held: 2, since: 1000 });
  assert.equal(f.heldOf(e), 2);
  assert.equal(f.receive(feed(other, 1, 3)).outcome, 'held');
  const w = f.receive(feed(other, 1, 4));
  assert.ok(w.outcome === 'overflow', 'the total bound');
  assert.equal(f.held, 3);
  assert.equal(f.stats.overflows, 2);
  // The next change still applies, with what it releases.
  assert.deepEqual(seqs(f.receive(feed(e, 1, 2))), [2, 3]);
  assert.throws(() => new Follower({ maxHeldPerEndpoint: 0, maxHeldTotal: 1 }), RangeError);
});

test('a greater epoch frees its endpoint\'s holds before the bounds are checked', () => {
  const e = endpointId();
  const f = new Follower({ maxHeldPerEndpoint: 1, maxHeldTotal: 1 });
  f.receive(feed(e, 1, 1));
  f.receive(feed(e, 1, 3));
  const v = f.receive(feed(e, 2, 4));
  assert.ok(v.outcome === 'held');
  assert.deepEqual(v.stale.map((c) => c.change_seq), [3]);
});

test('resume takes a saved position: changes up to it are repeats', () => {
  const e = endpointId();
  const f = new Follower();
  f.resume(e, { epoch: 4, lastChangeSeq: 10 });
  assert.equal(f.receive(feed(e, 4, 10)).outcome, 'duplicate');
  assert.equal(f.receive(feed(e, 3, 99)).outcome, 'stale');
  assert.deepEqual(seqs(f.receive(feed(e, 4, 11))), [11]);
});

test('restore takes a store\'s positions and held changes', () => {
  const e = endpointId();
  const g = endpointId();
  const f = new Follower();
  f.receive(feed(g, 1, 1));
  const ready = f.restore(new Map([[e, { epoch: 2, lastChangeSeq: 3 }]]), [
    feed(e, 2, 6), feed(e, 2, 2), story(e, 2, 9, { operation: 'notified' }),
  ]);
  assert.deepEqual(ready, []);
  assert.deepEqual(f.position(g), { epoch: 0, lastChangeSeq: 0 }, 'what it followed before is forgotten');
  assert.equal(f.heldOf(e), 2, 'a held change at or before the position is left out');
  assert.equal(f.receive(feed(e, 2, 6)).outcome, 'duplicate', 'a held change redelivered is a repeat');
  assert.deepEqual(seqs(f.receive(feed(e, 2, 4))), [4]);
  assert.deepEqual(seqs(f.receive(feed(e, 2, 5))), [5, 6]);
  // Held changes that follow their position already are answered, to apply.
  const h = new Follower();
  const now = h.restore(new Map([[e, { epoch: 2, lastChangeSeq: 3 }]]), [feed(e, 2, 5), feed(e, 2, 4), feed(e, 2, 7)]);
  assert.deepEqual(now.map((c) => c.change_seq), [4, 5]);
  assert.deepEqual(h.position(e), { epoch: 2, lastChangeSeq: 5 });
  assert.equal(h.heldOf(e), 1);
});

test('gaps are reported only once held longer than asked', () => {
  let now = 1000;
  const e = endpointId();
  const f = new Follower(undefined, () => now);
  f.receive(feed(e, 1, 3));
  assert.deepEqual(f.gaps(500), []);
  now = 1600;
  const [gap] = f.gaps(500);
  assert.ok(gap);
  assert.equal(gap.from, 1);
  assert.equal(gap.to, 2);
  assert.equal(gap.since, 1000);
  assert.deepEqual(f.endpointStates(), [{ endpoint: e, epoch: 1, lastChangeSeq: 0, held: 1 }]);
});
