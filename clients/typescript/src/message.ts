// The relay's change messages, version 1: the feed's (docs/change-message.v1.schema.json) and a
// stories endpoint's (docs/story-message.v1.schema.json). Decoding reads `v` first, so a body of
// another version is refused as such (never guessed at), then `kind` (a feed message has none),
// then checks the fields and the conditions the schemas put between them.

/** The one message version this library reads. */
export const SUPPORTED_VERSION = 1;

export interface PartsDiff {
  added: string[];
  changed: string[];
  removed: string[];
}

export type FeedOperation = 'upsert' | 'remove' | 'snapshot_begin' | 'snapshot_end';

/** One change of a feed endpoint's copy (or a snapshot marker, on either kind of endpoint). */
export interface FeedChange {
  v: 1;
  tenant_id: string;
  webhook_endpoint_id: string;
  epoch: number;
  change_seq: number;
  operation: FeedOperation;
  /** The copy's key; empty on the snapshot markers. */
  subject: string;
  item_kind: string | null;
  generation: number;
  /** Compared as byte strings; null on a reload's removals. */
  sequence: string | null;
  event_id: string | null;
  reload_generation: number | null;
  snapshot: boolean;
  /** On upsert only. */
  item?: Record<string, unknown>;
  parts_diff: PartsDiff;
  changed_at: string;
}

export type StoryOperation = 'saved' | 'closed' | 'dropped' | 'notified';

/** One change of a stories endpoint: a story saved, closed or dropped, or a notification. */
export interface StoryMessage {
  v: 1;
  kind: 'story' | 'notification';
  tenant_id: string;
  webhook_endpoint_id: string;
  epoch: number;
  change_seq: number;
  operation: StoryOperation;
  story_id: string;
  ticker: string | null;
  version: number;
  /** On saved and notified only. */
  story?: Record<string, unknown> & { id: string };
  /** On closed only, when the story merged into another. */
  merged_into?: string;
  event_id: string | null;
  reload_round: number | null;
  snapshot?: boolean;
  changed_at: string;
}

/** A message of either kind, as a queue delivers them. */
export type Change = FeedChange | StoryMessage;

export function isStoryMessage(change: Change): change is StoryMessage {
  return (change as StoryMessage).kind !== undefined;
}

/** `<endpoint>:<epoch>:<change_seq>`: the AMQP message_id the relay gives a change. */
export function messageId(change: Pick<Change, 'webhook_endpoint_id' | 'epoch' | 'change_seq'>): string {
  return `${change.webhook_endpoint_id}:${change.epoch}:${change.change_seq}`;
}

export type RefusalReason = 'version' | 'kind' | 'malformed' | 'inconsistent' | 'other_tenant';

/**
 * A body this library will not apply: another version (`version`), an unknown `kind`, not a
 * message of the documented shape (`malformed`), fields that contradict each other
 * (`inconsistent`), or another tenant's change (`other_tenant`).
 */
export class RefusedMessage extends Error {
  readonly reason: RefusalReason;
  /** The body's `v`, when it had one. */
  readonly version: unknown;
  /** The change's message id, when the body named one. */
  readonly messageId: string | undefined;

  constructor(reason: RefusalReason, detail: string, version?: unknown, id?: string) {
    super(`${reason === 'version' ? 'unknown message version' : `refused message (${reason})`}: ${detail}`);
    this.name = 'RefusedMessage';
    this.reason = reason;
    this.version = version;
    this.messageId = id;
  }
}

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;
const FEED_OPERATIONS: ReadonlySet<string> = new Set(['upsert', 'remove', 'snapshot_begin', 'snapshot_end']);
const STORY_OPERATIONS: ReadonlySet<string> = new Set(['saved', 'closed', 'dropped']);

type Json = Record<string, unknown>;

function isObject(value: unknown): value is Json {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function isInt(value: unknown, min: number): value is number {
  return typeof value === 'number' && Number.isSafeInteger(value) && value >= min;
}

function isStringOrNull(value: unknown): value is string | null {
  return value === null || typeof value === 'string';
}

function isStringArray(value: unknown): value is string[] {
  return Array.isArray(value) && value.every((v) => typeof v === 'string');
}

/**
 * Parses a delivered body (bytes or text) into a change of either kind, refusing with
 * [[RefusedMessage]] anything that is not a version 1 message of a kind this library knows.
 */
export function decodeChange(body: Buffer | Uint8Array | string): Change {
  const text = typeof body === 'string' ? body : Buffer.from(body).toString('utf8');
  let parsed: unknown;
  try {
    parsed = JSON.parse(text);
  } catch (error) {
    throw new RefusedMessage('malformed', `not JSON: ${(error as Error).message}`);
  }
  if (!isObject(parsed)) throw new RefusedMessage('malformed', 'not a JSON object');
  const v = parsed.v;
  if (v !== SUPPORTED_VERSION) {
    throw new RefusedMessage('version', `v is ${JSON.stringify(v)}; this library reads version ${SUPPORTED_VERSION} only`, v, idOf(parsed));
  }
  const kind = parsed.kind;
  if (kind === undefined) return checkFeed(parsed);
  if (kind === 'story' || kind === 'notification') return checkStory(parsed);
  throw new RefusedMessage('kind', `kind ${JSON.stringify(kind)}; this library reads the feed's, story and notification`, v, idOf(parsed));
}

function idOf(body: Json): string | undefined {
  const { webhook_endpoint_id: e, epoch, change_seq: s } = body;
  return typeof e === 'string' && typeof epoch === 'number' && typeof s === 'number' ? `${e}:${epoch}:${s}` : undefined;
}

function stream(body: Json, bad: (why: string) => never): void {
  if (typeof body.tenant_id !== 'string' || !UUID.test(body.tenant_id)) bad('tenant_id is not a lowercase UUID');
  if (typeof body.webhook_endpoint_id !== 'string' || !UUID.test(body.webhook_endpoint_id)) bad('webhook_endpoint_id is not a lowercase UUID');
  if (!isInt(body.epoch, 1)) bad('epoch is not a whole number of 1 or more');
  if (!isInt(body.change_seq, 1)) bad('change_seq is not a whole number of 1 or more');
  if (typeof body.changed_at !== 'string') bad('changed_at is not a string');
}

function checkFeed(body: Json): FeedChange {
  const id = idOf(body);
  const malformed = (why: string): never => {
    throw new RefusedMessage('malformed', `feed change ${id ?? '?'}: ${why}`, 1, id);
  };
  const inconsistent = (why: string): never => {
    throw new RefusedMessage('inconsistent', `feed change ${id ?? '?'}: ${why}`, 1, id);
  };
  stream(body, malformed);
  if (typeof body.operation !== 'string' || !FEED_OPERATIONS.has(body.operation)) malformed(`operation ${JSON.stringify(body.operation)}`);
  if (typeof body.subject !== 'string') malformed('subject is not a string');
  if (!isStringOrNull(body.item_kind)) malformed('item_kind is not a string or null');
  if (!isInt(body.generation, 0)) malformed('generation is not a whole number');
  if (!isStringOrNull(body.sequence)) malformed('sequence is not a string or null');
  if (!isStringOrNull(body.event_id)) malformed('event_id is not a string or null');
  if (body.reload_generation !== null && !isInt(body.reload_generation, 0)) malformed('reload_generation is not a whole number or null');
  if (typeof body.snapshot !== 'boolean') malformed('snapshot is not a boolean');
  const diff = body.parts_diff;
  if (!isObject(diff) || !isStringArray(diff.added) || !isStringArray(diff.changed) || !isStringArray(diff.removed)) {
    malformed('parts_diff is not {added, changed, removed}');
  }
  if (body.item !== undefined && !isObject(body.item)) malformed('item is not an object');
  const operation = body.operation as FeedOperation;
  if ((operation === 'upsert') !== (body.item !== undefined)) inconsistent('an item on other than upsert, or none on upsert');
  const causes = Number(body.event_id !== null) + Number(body.reload_generation !== null) + Number(body.snapshot === true);
  if (causes !== 1) inconsistent('not exactly one of event_id, reload_generation and snapshot');
  const marker = operation === 'snapshot_begin' || operation === 'snapshot_end';
  if (marker && body.snapshot !== true) inconsistent('a snapshot marker outside a snapshot');
  if (marker !== (body.subject === '')) inconsistent('a marker with a subject, or a change without one');
  return body as unknown as FeedChange;
}

function checkStory(body: Json): StoryMessage {
  const id = idOf(body);
  const malformed = (why: string): never => {
    throw new RefusedMessage('malformed', `story message ${id ?? '?'}: ${why}`, 1, id);
  };
  const inconsistent = (why: string): never => {
    throw new RefusedMessage('inconsistent', `story message ${id ?? '?'}: ${why}`, 1, id);
  };
  stream(body, malformed);
  const operation = body.operation;
  if (typeof operation !== 'string' || !(STORY_OPERATIONS.has(operation) || operation === 'notified')) malformed(`operation ${JSON.stringify(operation)}`);
  if ((body.kind === 'notification') !== (operation === 'notified')) inconsistent(`kind ${String(body.kind)} with operation ${String(operation)}`);
  if (typeof body.story_id !== 'string' || body.story_id === '') malformed('story_id is not a non-empty string');
  if (!isStringOrNull(body.ticker)) malformed('ticker is not a string or null');
  if (!isInt(body.version, 0)) malformed('version is not a whole number');
  if (!isStringOrNull(body.event_id)) malformed('event_id is not a string or null');
  if (body.reload_round !== null && !isInt(body.reload_round, 1)) malformed('reload_round is not a whole number of 1 or more, or null');
  if (body.snapshot !== undefined && typeof body.snapshot !== 'boolean') malformed('snapshot is not a boolean');
  if (body.story !== undefined && !isObject(body.story)) malformed('story is not an object');
  if (body.merged_into !== undefined && (typeof body.merged_into !== 'string' || body.merged_into === '')) malformed('merged_into is not a non-empty string');
  const hasStory = operation === 'saved' || operation === 'notified';
  if (hasStory !== (body.story !== undefined)) inconsistent('a story on closed or dropped, or none on saved or notified');
  if (body.merged_into !== undefined && operation !== 'closed') inconsistent('merged_into on an operation other than closed');
  const snapshot = body.snapshot === true;
  const causes = Number(body.event_id !== null) + Number(body.reload_round !== null) + Number(snapshot);
  if (causes !== 1) inconsistent('not exactly one of event_id, reload_round and snapshot');
  if (snapshot && operation !== 'saved' && operation !== 'closed') inconsistent('a snapshot of something other than a saved or closed row');
  if (operation === 'notified' && body.event_id === null) inconsistent('a notification no event claimed');
  if (operation === 'dropped' && body.reload_round === null) inconsistent('a drop no round made');
  if (isObject(body.story) && body.story.id !== body.story_id) inconsistent('a story whose id is not story_id');
  return body as unknown as StoryMessage;
}
