// The stream rules, pure (no IO): per endpoint the epoch followed and the last change_seq
// applied; a change of an older epoch is stale, a greater epoch starts over at change_seq 1, a
// change_seq applied or held already is a repeat, the next one is applied with every held one
// that then follows, one further ahead is held (bounded). The same rules as the relay's
// reference consumer (services/publisher/src/consumer.rs).
//
// Each change travels with a token (the consumer's: its AMQP delivery), handed back with the
// verdict so the caller acknowledges exactly what was applied or dropped.

import { Change } from './message';

export interface Position {
  epoch: number;
  lastChangeSeq: number;
}

export interface Placed<T> {
  change: Change;
  token: T;
}

export type Verdict<T> =
  /** Apply these, in order (the change received first, then the held ones it released). */
  | { outcome: 'apply'; apply: Placed<T>[]; stale: Placed<T>[] }
  /** Already applied, or held already: drop it (acknowledge it). */
  | { outcome: 'duplicate'; stale: Placed<T>[] }
  /** Of an epoch older than the one followed: drop it (acknowledge it). */
  | { outcome: 'stale'; stale: Placed<T>[] }
  /**
   * Ahead of the next change: held until its predecessors come. `released` are changes that
   * no longer fit in the bound (the furthest ahead; possibly this one): give them back to the
   * queue (nack with requeue), they come again.
   */
  | { outcome: 'held'; expected: number; released: Placed<T>[]; stale: Placed<T>[] };

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
  held: Map<number, Placed<unknown>>;
  heldSince: number;
}

export interface FollowerStats {
  received: number;
  applied: number;
  duplicates: number;
  stale: number;
  reordered: number;
  released: number;
  snapshots: number;
}

export class Follower<T> {
  private readonly endpoints = new Map<string, EndpointState>();
  private heldTotal = 0;
  readonly stats: FollowerStats = { received: 0, applied: 0, duplicates: 0, stale: 0, reordered: 0, released: 0, snapshots: 0 };

  constructor(
    private readonly limits: FollowerLimits = { maxHeldPerEndpoint: 200, maxHeldTotal: 400 },
    private readonly now: () => number = Date.now,
  ) {
    if (limits.maxHeldPerEndpoint < 1 || limits.maxHeldTotal < 1) throw new RangeError('the hold bounds must be 1 or more');
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

  get held(): number {
    return this.heldTotal;
  }

  heldOf(endpoint: string): number {
    return this.endpoints.get(endpoint)?.held.size ?? 0;
  }

  /** Every token held now (to give back when stopping). */
  heldTokens(): T[] {
    const out: T[] = [];
    for (const state of this.endpoints.values()) for (const placed of state.held.values()) out.push(placed.token as T);
    return out;
  }

  receive(change: Change, token: T): Verdict<T> {
    this.stats.received += 1;
    const state = this.state(change.webhook_endpoint_id);
    const { epoch, change_seq: seq } = change;
    if (epoch < state.epoch) {
      this.stats.stale += 1;
      return { outcome: 'stale', stale: [] };
    }
    const stale: Placed<T>[] = [];
    if (epoch > state.epoch) {
      // The older epoch's stream is over: what was held of it can never be applied.
      for (const placed of state.held.values()) stale.push(placed as Placed<T>);
      this.stats.stale += state.held.size;
      this.heldTotal -= state.held.size;
      state.held.clear();
      state.epoch = epoch;
      state.last = 0;
    }
    if (seq <= state.last || state.held.has(seq)) {
      this.stats.duplicates += 1;
      return { outcome: 'duplicate', stale };
    }
    const expected = state.last + 1;
    if (seq > expected) {
      this.stats.reordered += 1;
      if (state.held.size === 0) state.heldSince = this.now();
      state.held.set(seq, { change, token });
      this.heldTotal += 1;
      const released = this.enforceBounds(state);
      return { outcome: 'held', expected, released, stale };
    }
    const apply: Placed<T>[] = [{ change, token }];
    this.advance(state, change);
    for (;;) {
      const next = state.held.get(state.last + 1);
      if (!next) break;
      state.held.delete(state.last + 1);
      this.heldTotal -= 1;
      apply.push(next as Placed<T>);
      this.advance(state, next.change);
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

  private advance(state: EndpointState, change: Change): void {
    state.last = change.change_seq;
    this.stats.applied += 1;
    if (!('kind' in change) && change.operation === 'snapshot_begin') this.stats.snapshots += 1;
  }

  /** Gives back the furthest-ahead changes held while a bound is passed. */
  private enforceBounds(state: EndpointState): Placed<T>[] {
    const released: Placed<T>[] = [];
    const giveBack = (from: EndpointState) => {
      const furthest = Math.max(...from.held.keys());
      const placed = from.held.get(furthest)!;
      from.held.delete(furthest);
      this.heldTotal -= 1;
      this.stats.released += 1;
      released.push(placed as Placed<T>);
    };
    while (state.held.size > this.limits.maxHeldPerEndpoint) giveBack(state);
    while (this.heldTotal > this.limits.maxHeldTotal) {
      // The endpoint holding the most gives back its furthest.
      let fullest = state;
      for (const other of this.endpoints.values()) if (other.held.size > fullest.held.size) fullest = other;
      giveBack(fullest);
    }
    return released;
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
