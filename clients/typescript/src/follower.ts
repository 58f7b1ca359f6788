// The stream rules, pure (no IO): per endpoint the epoch followed and the last change_seq
// applied; a change of an older epoch is stale, a greater epoch starts over at change_seq 1, a
// change_seq applied or held already is a repeat, the next one is applied with every held one
// that then follows, one further ahead is held (bounded: past a bound it is an overflow, and
// nothing changes). The same rules as the relay's reference consumer
// (services/publisher/src/consumer.rs).
//
// A held change is the store's to keep (relay_held, in the transaction of its batch): the
// consumer acknowledges it once that commits, and a restart or a reconnection restores the
// follower from the store's positions and held changes.

import { Change } from './message';

export interface Position {
  epoch: number;
  lastChangeSeq: number;
}

export type Verdict =
  /** Apply these, in order (the change received first, then the held ones it released). */
  | { outcome: 'apply'; apply: Change[]; stale: Change[] }
  /** Already applied, or held already: drop it (acknowledge it). */
  | { outcome: 'duplicate'; stale: Change[] }
  /** Of an epoch older than the one followed: drop it (acknowledge it). */
  | { outcome: 'stale'; stale: Change[] }
  /** Ahead of the next change: held (the store keeps it) until its predecessors come. */
  | { outcome: 'held'; expected: number; stale: Change[] }
  /**
   * Ahead of the next change, and holding it would pass a hold bound: not held, nothing changed.
   * The caller has it sent again (a replay that covers it) or gives it back to the queue.
   */
  | { outcome: 'overflow'; gap: Gap };

// `stale` (on every verdict but overflow): changes held of an older epoch, which a change of a
// greater epoch ended; they can never be applied (their `notified` ones are recorded anyway).

export interface Gap {
  endpoint: string;
  epoch: number;
  /** The first and last change_seq missing before the first one held. */
  from: number;
  to: number;
  /** How many changes of the endpoint are held waiting for them. */
  held: number;
  /** Since when (ms since the epoch) changes have been held waiting. */
  since: number;
}

export interface FollowerLimits {
  /** Changes held out of order per endpoint, at most. */
  maxHeldPerEndpoint: number;
  /** Changes held out of order in all, at most. */
  maxHeldTotal: number;
}

interface EndpointState {
  epoch: number;
  last: number;
  held: Map<number, Change>;
  heldSince: number;
}

export interface FollowerStats {
  received: number;
  applied: number;
  duplicates: number;
  stale: number;
  reordered: number;
  overflows: number;
  snapshots: number;
}

export const DEFAULT_LIMITS: FollowerLimits = { maxHeldPerEndpoint: 1_000, maxHeldTotal: 10_000 };

export class Follower {
  private readonly endpoints = new Map<string, EndpointState>();
  private heldTotal = 0;
  readonly stats: FollowerStats = { received: 0, applied: 0, duplicates: 0, stale: 0, reordered: 0, overflows: 0, snapshots: 0 };

  constructor(
    private readonly limits: FollowerLimits = DEFAULT_LIMITS,
    private readonly now: () => number = Date.now,
  ) {
    if (limits.maxHeldPerEndpoint < 1 || limits.maxHeldTotal < 1) throw new RangeError('the hold bounds must be 1 or more');
  }

  /**
   * Starts over from what a store saved: its positions, and the changes it holds (kept whatever
   * the bounds; one at or before its endpoint's position is left out). Answers the held changes
   * that follow their position already (none, from a store written by these libraries): the
   * caller applies them.
   */
  restore(positions: Map<string, Position>, held: Change[]): Change[] {
    this.endpoints.clear();
    this.heldTotal = 0;
    for (const [endpoint, position] of positions) this.resume(endpoint, position);
    const ordered = [...held].sort((a, b) => a.epoch - b.epoch || a.change_seq - b.change_seq);
    for (const change of ordered) {
      const state = this.state(change.webhook_endpoint_id);
      if (change.epoch < state.epoch) continue;
      if (change.epoch > state.epoch) {
        this.heldTotal -= state.held.size;
        state.held.clear();
        state.epoch = change.epoch;
        state.last = 0;
      }
      if (change.change_seq <= state.last || state.held.has(change.change_seq)) continue;
      if (state.held.size === 0) state.heldSince = this.now();
      state.held.set(change.change_seq, change);
      this.heldTotal += 1;
    }
    const ready: Change[] = [];
    for (const state of this.endpoints.values()) {
      for (;;) {
        const next = state.held.get(state.last + 1);
        if (!next) break;
        state.held.delete(state.last + 1);
        this.heldTotal -= 1;
        ready.push(next);
        state.last = next.change_seq;
      }
    }
    return ready;
  }

  /** Takes the endpoint as at `position` (what a store saved): changes up to it are repeats. */
  resume(endpoint: string, position: Position): void {
    const state = this.state(endpoint);
    this.heldTotal -= state.held.size;
    state.held.clear();
    state.epoch = position.epoch;
    state.last = position.lastChangeSeq;
  }

  position(endpoint: string): Position {
    const state = this.endpoints.get(endpoint);
    return state ? { epoch: state.epoch, lastChangeSeq: state.last } : { epoch: 0, lastChangeSeq: 0 };
  }

  /** Every endpoint seen (resumed or received), with its position and how many it holds. */
  endpointStates(): { endpoint: string; epoch: number; lastChangeSeq: number; held: number }[] {
    return [...this.endpoints].map(([endpoint, s]) => ({ endpoint, epoch: s.epoch, lastChangeSeq: s.last, held: s.held.size }));
  }

  get held(): number {
    return this.heldTotal;
  }

  heldOf(endpoint: string): number {
    return this.endpoints.get(endpoint)?.held.size ?? 0;
  }

  receive(change: Change): Verdict {
    this.stats.received += 1;
    const state = this.state(change.webhook_endpoint_id);
    const { epoch, change_seq: seq } = change;
    if (epoch < state.epoch) {
      this.stats.stale += 1;
      return { outcome: 'stale', stale: [] };
    }
    // A greater epoch ends the older one's stream: what was held of it can never be applied.
    const switching = epoch > state.epoch;
    const last = switching ? 0 : state.last;
    if (!switching && (seq <= last || state.held.has(seq))) {
      this.stats.duplicates += 1;
      return { outcome: 'duplicate', stale: [] };
    }
    const expected = last + 1;
    if (seq > expected) {
      const heldHere = switching ? 0 : state.held.size;
      const heldAll = this.heldTotal - (switching ? state.held.size : 0);
      if (heldHere + 1 > this.limits.maxHeldPerEndpoint || heldAll + 1 > this.limits.maxHeldTotal) {
        this.stats.overflows += 1;
        const first = heldHere > 0 ? Math.min(...state.held.keys()) : seq;
        const gap: Gap = {
          endpoint: change.webhook_endpoint_id, epoch, from: expected, to: first - 1, held: heldHere,
          since: heldHere > 0 ? state.heldSince : this.now(),
        };
        return { outcome: 'overflow', gap };
      }
    }
    const stale = switching ? this.switchEpoch(state, epoch) : [];
    if (seq > expected) {
      this.stats.reordered += 1;
      if (state.held.size === 0) state.heldSince = this.now();
      state.held.set(seq, change);
      this.heldTotal += 1;
      return { outcome: 'held', expected, stale };
    }
    const apply: Change[] = [change];
    this.advance(state, change);
    for (;;) {
      const next = state.held.get(state.last + 1);
      if (!next) break;
      state.held.delete(state.last + 1);
      this.heldTotal -= 1;
      apply.push(next);
      this.advance(state, next);
    }
    if (state.held.size > 0) state.heldSince = this.now();
    return { outcome: 'apply', apply, stale };
  }

  /** Endpoints with changes held for longer than `olderThanMs`, and what they wait for. */
  gaps(olderThanMs = 0): Gap[] {
    const now = this.now();
    const out: Gap[] = [];
    for (const [endpoint, state] of this.endpoints) {
      if (state.held.size === 0 || now - state.heldSince < olderThanMs) continue;
      const first = Math.min(...state.held.keys());
      out.push({ endpoint, epoch: state.epoch, from: state.last + 1, to: first - 1, held: state.held.size, since: state.heldSince });
    }
    return out;
  }

  private switchEpoch(state: EndpointState, epoch: number): Change[] {
    const stale = [...state.held.values()].sort((a, b) => a.change_seq - b.change_seq);
    this.stats.stale += stale.length;
    this.heldTotal -= state.held.size;
    state.held.clear();
    state.epoch = epoch;
    state.last = 0;
    return stale;
  }

  private advance(state: EndpointState, change: Change): void {
    state.last = change.change_seq;
    this.stats.applied += 1;
    if (!('kind' in change) && change.operation === 'snapshot_begin') this.stats.snapshots += 1;
  }

  private state(endpoint: string): EndpointState {
    let state = this.endpoints.get(endpoint);
    if (!state) {
      state = { epoch: 0, last: 0, held: new Map(), heldSince: 0 };
      this.endpoints.set(endpoint, state);
    }
    return state;
  }
}
