// What a store is to the consumer: where each endpoint's position and copy are kept, written
// together, so that what was applied and how far are never apart.

import { Position } from './follower';
import { HandlerError } from './errors';
import { Change, FeedChange, StoryMessage } from './message';

/** One subject of a feed endpoint's copy (a tombstone once removed by an event). */
export interface FeedRow {
  subject: string;
  item_kind: string | null;
  generation: number;
  sequence: string | null;
  tombstone: boolean;
  item: Record<string, unknown> | null;
  /** The change that wrote the row last. */
  epoch: number;
  change_seq: number;
}

/** One story of a stories endpoint's copy, open or closed for good. */
export interface StoryRow {
  story_id: string;
  ticker: string | null;
  version: number;
  closed: boolean;
  merged_into: string | null;
  /** The snapshot while open; null once closed. */
  story: Record<string, unknown> | null;
}

/** A notification as recorded: the `notified` change, and whether it was handed on yet. */
export interface NotificationRecord {
  endpoint: string;
  story_id: string;
  ticker: string | null;
  version: number;
  event_id: string | null;
  story: Record<string, unknown> | null;
  epoch: number;
  change_seq: number;
  changed_at: string;
}

/** What applying a batch did. */
export interface ApplyOutcome {
  /** Changes that followed the stored position: applied, the position moved past them. */
  applied: number;
  /** Changes the stored position was already past (another run applied them): nothing done. */
  skipped: number;
  /**
   * Changes applied whose row write the newer-only or closed-for-good condition declined (the
   * row held was newer already): the position moved, the row stayed. The relay only sends
   * writes that won against its own copy, so on a whole stream this stays 0.
   */
  declined: number;
  /** Notifications recorded (each story's first). */
  notifications: number;
  /** Notifications whose story was recorded notified already: not recorded again. */
  repeatedNotifications: number;
}

/** The context a handler is called with. */
export interface HandlerContext<C> {
  /** The store's own handle: the Postgres store's client inside the transaction. */
  client: C;
  /** Whether the row write took effect (false: declined as older than the row held). */
  written: boolean;
}

type Handler<M, C> = (change: M, context: HandlerContext<C>) => void | Promise<void>;

/**
 * The user's callbacks. Each is called once per change applied, in change_seq order per
 * endpoint: the Postgres store calls them inside the transaction that applies the change (a
 * throw rolls it back and the change is not acknowledged), the memory store after its write.
 * `notification` is called by [[Store.handPending]] (see the README, "Notifications exactly
 * once").
 */
export interface Handlers<C> {
  upsert?: Handler<FeedChange, C>;
  remove?: Handler<FeedChange, C>;
  snapshotBegin?: Handler<FeedChange, C>;
  snapshotEnd?: Handler<FeedChange, C>;
  storySaved?: Handler<StoryMessage, C>;
  storyClosed?: Handler<StoryMessage, C>;
  storyDropped?: Handler<StoryMessage, C>;
  notification?: (notification: NotificationRecord, context: { client: C }) => void | Promise<void>;
}

export interface Store {
  /** Each endpoint's saved position: where the consumer resumes. */
  positions(): Promise<Map<string, Position>>;
  /** The changes held (ahead of their endpoint's next change), as the consumer left them. */
  held(): Promise<Change[]>;
  /**
   * Applies the changes (in order per endpoint; each endpoint's a run that follows on from its
   * position) all at once: in one transaction, with the positions. A change the stored position
   * is already past is skipped. `lateNotifications` are `notified` changes of an epoch older
   * than the one followed (delivered after the new epoch's first change): the copy's changes of
   * a stale epoch are dropped, but a notification is a claim of its own, keyed by story id, so
   * it is recorded (once per story) in the same transaction, without moving any position.
   * `held` are changes that came ahead of their endpoint's next one, kept (in the same
   * transaction) until it comes; a held change is forgotten when its endpoint's position
   * reaches it, or when its epoch ends (a position, or a change held, of a greater epoch).
   */
  apply(changes: Change[], lateNotifications?: StoryMessage[], held?: Change[]): Promise<ApplyOutcome>;
  /** Hands each recorded notification not handed yet to the handler, marking it handed. */
  handPending(): Promise<number>;
  /** Closes what the store holds open (a second call does nothing). */
  close(): Promise<void>;
}

/** Calls the handler of a change's operation, when the user gave one; its throw is a HandlerError. */
export async function callHandler<C>(handlers: Handlers<C>, change: Change, context: HandlerContext<C>): Promise<void> {
  const [name, handler] = handlerOf(handlers, change);
  if (!handler) return;
  try {
    await handler(change as never, context);
  } catch (error) {
    throw new HandlerError(name, error);
  }
}

function handlerOf<C>(handlers: Handlers<C>, change: Change): [string, Handler<any, C> | undefined] {
  if ('kind' in change) {
    switch (change.operation) {
      case 'saved': return ['storySaved', handlers.storySaved];
      case 'closed': return ['storyClosed', handlers.storyClosed];
      case 'dropped': return ['storyDropped', handlers.storyDropped];
      default: return ['notified', undefined];
    }
  }
  switch (change.operation) {
    case 'upsert': return ['upsert', handlers.upsert];
    case 'remove': return ['remove', handlers.remove];
    case 'snapshot_begin': return ['snapshotBegin', handlers.snapshotBegin];
    default: return ['snapshotEnd', handlers.snapshotEnd];
  }
}

/** Calls the notification handler; its throw is a HandlerError. */
export async function callNotificationHandler<C>(handlers: Handlers<C>, record: NotificationRecord, client: C): Promise<void> {
  if (!handlers.notification) return;
  try {
    await handlers.notification(record, { client });
  } catch (error) {
    throw new HandlerError('notification', error);
  }
}

/** Byte-string order of two sequences (as the relay compares them: COLLATE "C"). */
export function compareSequences(a: string, b: string): number {
  return Buffer.compare(Buffer.from(a, 'utf8'), Buffer.from(b, 'utf8'));
}

/**
 * The relay's precedence of a feed write over the row held (services/store/src/copy.rs):
 * a newer generation, or the same generation and a higher sequence, or a removal at the same
 * sequence over an item.
 */
export function feedWriteWins(held: FeedRow, generation: number, sequence: string | null, tombstone: boolean): boolean {
  if (generation !== held.generation) return generation > held.generation;
  if (sequence === null || held.sequence === null) return false;
  const order = compareSequences(sequence, held.sequence);
  return order > 0 || (order === 0 && tombstone && !held.tombstone);
}
