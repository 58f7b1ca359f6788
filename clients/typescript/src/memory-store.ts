// A store in memory: the copies, positions and notifications in maps. Gone with the process, so
// for tests, for a copy rebuilt at each start (from a resync), or as a base for callbacks that
// keep what they need themselves.

import { Position } from './follower';
import { Change, FeedChange, StoryMessage } from './message';
import {
  ApplyOutcome, callHandler, callNotificationHandler, feedWriteWins, FeedRow, Handlers, NotificationRecord, Store, StoryRow,
} from './store';

export interface MemoryStoreOptions {
  handlers?: Handlers<MemoryStore>;
  /** Positions to start from (e.g. saved by the user's own callbacks). */
  positions?: Map<string, Position>;
}

export class MemoryStore implements Store {
  readonly feed = new Map<string, Map<string, FeedRow>>();
  readonly stories = new Map<string, Map<string, StoryRow>>();
  /** Notifications recorded, by endpoint and story id. */
  readonly notifications = new Map<string, Map<string, NotificationRecord & { handed: boolean }>>();
  private readonly saved = new Map<string, Position>();
  private readonly pending: (NotificationRecord & { handed: boolean })[] = [];
  /** Changes held, by endpoint, then `<epoch>:<change_seq>`. */
  private readonly heldChanges = new Map<string, Map<string, Change>>();
  private readonly handlers: Handlers<MemoryStore>;

  constructor(options: MemoryStoreOptions = {}) {
    this.handlers = options.handlers ?? {};
    for (const [endpoint, position] of options.positions ?? []) this.saved.set(endpoint, { ...position });
  }

  async positions(): Promise<Map<string, Position>> {
    return new Map([...this.saved].map(([e, p]) => [e, { ...p }]));
  }

  /** The endpoint's items (tombstones left out), by subject. */
  items(endpoint: string): Map<string, Record<string, unknown>> {
    const out = new Map<string, Record<string, unknown>>();
    for (const [subject, row] of this.feed.get(endpoint) ?? []) if (!row.tombstone && row.item) out.set(subject, row.item);
    return out;
  }

  storyRows(endpoint: string): Map<string, StoryRow> {
    return new Map(this.stories.get(endpoint) ?? []);
  }

  async held(): Promise<Change[]> {
    return [...this.heldChanges.values()].flatMap((m) => [...m.values()]);
  }

  async apply(changes: Change[], lateNotifications: StoryMessage[] = [], held: Change[] = []): Promise<ApplyOutcome> {
    const outcome: ApplyOutcome = { applied: 0, skipped: 0, declined: 0, notifications: 0, repeatedNotifications: 0 };
    for (const late of lateNotifications) this.recordNotification(late, outcome);
    this.keepHeld(changes, held);
    for (const change of changes) {
      const endpoint = change.webhook_endpoint_id;
      const at = this.saved.get(endpoint);
      const follows = at
        ? (change.epoch === at.epoch && change.change_seq === at.lastChangeSeq + 1) || (change.epoch > at.epoch && change.change_seq === 1)
        : change.change_seq === 1;
      if (!follows) {
        outcome.skipped += 1;
        continue;
      }
      this.saved.set(endpoint, { epoch: change.epoch, lastChangeSeq: change.change_seq });
      outcome.applied += 1;
      const written = 'kind' in change ? this.applyStory(change, outcome) : this.applyFeed(change);
      // A repeated notification is not a declined write: it is recorded once by design.
      if (!written && !('kind' in change && change.operation === 'notified')) outcome.declined += 1;
      await callHandler(this.handlers, change, { client: this, written });
    }
    return outcome;
  }

  /**
   * The held changes as the batch leaves them: each endpoint's position forgets what it reached
   * (and an older epoch's), a change held of a greater epoch the older epochs' ones. (The
   * positions move as the batch's changes are applied, after this: the forgetting is decided on
   * where they will be, as the Postgres store does in the batch's transaction.)
   */
  private keepHeld(changes: Change[], held: Change[]): void {
    const reach = new Map<string, Position>();
    const at = (e: string) => reach.get(e) ?? this.saved.get(e);
    for (const c of changes) {
      const p = at(c.webhook_endpoint_id);
      const follows = p
        ? (c.epoch === p.epoch && c.change_seq === p.lastChangeSeq + 1) || (c.epoch > p.epoch && c.change_seq === 1)
        : c.change_seq === 1;
      if (follows) reach.set(c.webhook_endpoint_id, { epoch: c.epoch, lastChangeSeq: c.change_seq });
    }
    const forget = (endpoint: string, upTo: Position) => {
      const kept = this.heldChanges.get(endpoint);
      if (!kept) return;
      for (const [key, c] of kept) {
        if (c.epoch < upTo.epoch || (c.epoch === upTo.epoch && c.change_seq <= upTo.lastChangeSeq)) kept.delete(key);
      }
    };
    for (const [endpoint, p] of reach) forget(endpoint, p);
    for (const c of held) forget(c.webhook_endpoint_id, { epoch: c.epoch, lastChangeSeq: 0 });
    for (const c of held) {
      let kept = this.heldChanges.get(c.webhook_endpoint_id);
      if (!kept) this.heldChanges.set(c.webhook_endpoint_id, (kept = new Map()));
      kept.set(`${c.epoch}:${c.change_seq}`, c);
    }
  }

  async handPending(): Promise<number> {
    let handed = 0;
    while (this.pending.length > 0) {
      const record = this.pending[0]!;
      const { handed: _, ...notification } = record;
      await callNotificationHandler(this.handlers, notification, this);
      record.handed = true;
      this.pending.shift();
      handed += 1;
    }
    return handed;
  }

  async close(): Promise<void> {}

  private applyFeed(change: FeedChange): boolean {
    const endpoint = change.webhook_endpoint_id;
    let rows = this.feed.get(endpoint);
    if (!rows) this.feed.set(endpoint, (rows = new Map()));
    switch (change.operation) {
      case 'snapshot_begin':
        rows.clear();
        this.stories.get(endpoint)?.clear();
        return true;
      case 'snapshot_end':
        return true;
      case 'remove':
        if (change.sequence === null) {
          // A reload's removal: it drops what is held from an older generation.
          const held = rows.get(change.subject);
          if (held && held.generation < change.generation) {
            rows.delete(change.subject);
            return true;
          }
          return false;
        }
        return this.writeFeed(rows, change, true);
      case 'upsert':
        return this.writeFeed(rows, change, false);
    }
  }

  /** An upsert, or an event's removal (a tombstone at its position), when it wins. */
  private writeFeed(rows: Map<string, FeedRow>, change: FeedChange, tombstone: boolean): boolean {
    {
        const held = rows.get(change.subject);
        if (held && !feedWriteWins(held, change.generation, change.sequence, tombstone)) return false;
        rows.set(change.subject, {
          subject: change.subject,
          item_kind: change.item_kind ?? held?.item_kind ?? null,
          generation: change.generation,
          sequence: change.sequence,
          tombstone,
          item: tombstone ? null : change.item ?? null,
          epoch: change.epoch,
          change_seq: change.change_seq,
        });
        return true;
    }
  }

  private applyStory(change: StoryMessage, outcome: ApplyOutcome): boolean {
    const endpoint = change.webhook_endpoint_id;
    let rows = this.stories.get(endpoint);
    if (!rows) this.stories.set(endpoint, (rows = new Map()));
    const held = rows.get(change.story_id);
    switch (change.operation) {
      case 'saved':
        // Saved only when newer than the row and the row is not closed.
        if (held && (held.closed || held.version >= change.version)) return false;
        rows.set(change.story_id, {
          story_id: change.story_id, ticker: change.ticker, version: change.version, closed: false,
          merged_into: held?.merged_into ?? null, story: change.story ?? null,
        });
        return true;
      case 'closed':
        // Closed for good: a change unless closed already at this version or later.
        if (held && held.closed && held.version >= change.version) return false;
        rows.set(change.story_id, {
          story_id: change.story_id, ticker: held ? held.ticker : change.ticker,
          version: Math.max(held?.version ?? 0, change.version), closed: true,
          merged_into: change.merged_into ?? null, story: null,
        });
        return true;
      case 'dropped':
        // The open row goes; a closed one stays.
        if (held && !held.closed) {
          rows.delete(change.story_id);
          return true;
        }
        return false;
      case 'notified':
        return this.recordNotification(change, outcome);
    }
  }

  private recordNotification(change: StoryMessage, outcome: ApplyOutcome): boolean {
    const endpoint = change.webhook_endpoint_id;
    {
      {
        let notified = this.notifications.get(endpoint);
        if (!notified) this.notifications.set(endpoint, (notified = new Map()));
        if (notified.has(change.story_id)) {
          outcome.repeatedNotifications += 1;
          return false;
        }
        const record = {
          endpoint, story_id: change.story_id, ticker: change.ticker, version: change.version,
          event_id: change.event_id, story: change.story ?? null, epoch: change.epoch,
          change_seq: change.change_seq, changed_at: change.changed_at, handed: false,
        };
        notified.set(change.story_id, record);
        this.pending.push(record);
        outcome.notifications += 1;
        return true;
      }
    }
  }
}
