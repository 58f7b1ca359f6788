import { test } from 'node:test';
import assert from 'node:assert/strict';
import { Follower } from '../../src/follower';
import { endpointId, feed } from '../helpers';

function seqs(verdict: ReturnType<Follower<string>['receive']>): number[] {
  return verdict.outcome === 'apply' ? verdict.apply.map((p) => p.change.change_seq) : [];
}

test('applies a gapless stream in order and drops repeats', () => {
  const e = endpointId();
  const f = new Follower<string>();
  assert.deepEqual(seqs(f.receive(feed(e, 1, 1), 'a')), [1]);
  assert.deepEqual(seqs(f.receive(feed(e, 1, 2), 'b')), [2]);
  assert.equal(f.receive(feed(e, 1, 2), 'b2').outcome, 'duplicate');
  assert.equal(f.receive(feed(e, 1, 1), 'a2').outcome, 'duplicate');
  assert.deepEqual(f.position(e), { epoch: 1, lastChangeSeq: 2 });
  assert.equal(f.stats.duplicates, 2);
});

test('holds a change ahead of its predecessors and applies it when they come', () => {
  const e = endpointId();
  const f = new Follower<string>();
  f.receive(feed(e, 1, 1), 't1');
  const held = f.receive(feed(e, 1, 4), 't4');
  assert.equal(held.outcome, 'held');
  assert.ok(held.outcome === 'held' && held.expected === 2 && held.released.length === 0);
  assert.equal(f.receive(feed(e, 1, 3), 't3').outcome, 'held');
  assert.equal(f.receive(feed(e, 1, 4), 't4again').outcome, 'duplicate', 'a change held already is a repeat');
  assert.equal(f.held, 2);
  const gaps = f.gaps();
  assert.deepEqual(gaps.map((g) => [g.endpoint, g.epoch, g.from, g.to, g.held]), [[e, 1, 2, 2, 2]]);
  const verdict = f.receive(feed(e, 1, 2), 't2');
  assert.deepEqual(seqs(verdict), [2, 3, 4]);
  assert.ok(verdict.outcome === 'apply');
  assert.deepEqual(verdict.apply.map((p) => p.token), ['t2', 't3', 't4']);
  assert.equal(f.held, 0);
  assert.deepEqual(f.gaps(), []);
});

test('a change of an older epoch is stale; a greater epoch starts over at change_seq 1', () => {
  const e = endpointId();
  const f = new Follower<string>();
  f.receive(feed(e, 2, 1), 'a');
  f.receive(feed(e, 2, 2), 'b');
  f.receive(feed(e, 2, 5), 'held-old');
  assert.equal(f.receive(feed(e, 1, 3), 'old').outcome, 'stale');
  // Epoch 3 begins: what was held of epoch 2 can never apply, its tokens come back as stale.
  const v = f.receive(feed(e, 3, 1, { operation: 'snapshot_begin' }), 'snap');
  assert.ok(v.outcome === 'apply');
  assert.deepEqual(v.stale.map((p) => p.token), ['held-old']);
  assert.deepEqual(f.position(e), { epoch: 3, lastChangeSeq: 1 });
  assert.equal(f.held, 0);
  assert.equal(f.stats.snapshots, 1);
  // A greater epoch's change that is not its first waits for change_seq 1.
  const g = endpointId();
  f.receive(feed(g, 1, 1), 'g1');
  const w = f.receive(feed(g, 2, 2), 'g2');
  assert.ok(w.outcome === 'held' && w.expected === 1);
  assert.deepEqual(seqs(f.receive(feed(g, 2, 1), 'g21')), [1, 2]);
});

test('the hold bounds give back the furthest-ahead changes', () => {
  const e = endpointId();
  const other = endpointId();
  const f = new Follower<string>({ maxHeldPerEndpoint: 2, maxHeldTotal: 3 });
  f.receive(feed(e, 1, 1), 'e1');
  f.receive(feed(e, 1, 5), 'e5');
  f.receive(feed(e, 1, 3), 'e3');
  const v = f.receive(feed(e, 1, 4), 'e4');
  assert.ok(v.outcome === 'held');
  assert.deepEqual(v.released.map((p) => p.token), ['e5']);
  assert.equal(f.heldOf(e), 2);
  f.receive(feed(other, 1, 3), 'o3');
  const w = f.receive(feed(other, 1, 4), 'o4');
  assert.ok(w.outcome === 'held');
  assert.equal(w.released.length, 1);
  assert.equal(f.held, 3);
  assert.equal(f.stats.released, 2);
  assert.throws(() => new Follower({ maxHeldPerEndpoint: 0, maxHeldTotal: 1 }), RangeError);
});

test('resume takes a saved position: changes up to it are repeats', () => {
  const e = endpointId();
  const f = new Follower<string>();
  f.resume(e, { epoch: 4, lastChangeSeq: 10 });
  assert.equal(f.receive(feed(e, 4, 10), 'x').outcome, 'duplicate');
  assert.equal(f.receive(feed(e, 3, 99), 'y').outcome, 'stale');
  assert.deepEqual(seqs(f.receive(feed(e, 4, 11), 'z')), [11]);
});

test('gaps are reported only once held longer than asked', () => {
  let now = 1000;
  const e = endpointId();
  const f = new Follower<string>(undefined, () => now);
  f.receive(feed(e, 1, 3), 'x');
  assert.deepEqual(f.gaps(500), []);
  now = 1600;
  const [gap] = f.gaps(500);
  assert.ok(gap);
  assert.equal(gap.from, 1);
  assert.equal(gap.to, 2);
  assert.equal(gap.since, 1000);
  assert.deepEqual(f.heldTokens(), ['x']);
});
