// A store in Postgres. Each change is one statement that decides in itself: it moves the
// endpoint's position only when the change follows it (the same epoch and the next change_seq,
// or change_seq 1 of a greater epoch), and writes the row only then and only when the write
// wins as the relay's own writes do (services/store/src/copy.rs: a newer generation, a higher
// sequence compared as bytes, a removal at the same sequence over an item; stories.rs: a save
// only when newer than an open row, a close for good at the greatest version). A batch is one
// transaction, so a consumer killed at any moment either applied a change with its position or
// neither, and on restart skips what it applied.

import { Pool, PoolClient, PoolConfig } from 'pg';
import { Position } from './follower';
import { Change, FeedChange, StoryMessage } from './message';
import { ApplyOutcome, callHandler, Handlers, NotificationRecord, Store } from './store';

export interface PgStoreOptions {
  /** A connection string, or pg's pool settings. */
  connection: string | PoolConfig;
  handlers?: Handlers<PoolClient>;
  /** Create the tables when missing (default true). */
  migrate?: boolean;
}

export const SCHEMA_SQL = `
CREATE TABLE IF NOT EXISTS relay_positions (
  endpoint_id uuid PRIMARY KEY,
  tenant_id uuid NOT NULL,
  epoch bigint NOT NULL,
  last_change_seq bigint NOT NULL,
  updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS relay_feed_items (
  endpoint_id uuid NOT NULL,
  subject text NOT NULL,
  item_kind text,
  generation bigint NOT NULL,
  sequence text COLLATE "C",
  tombstone boolean NOT NULL,
  item jsonb,
  epoch bigint NOT NULL,
  change_seq bigint NOT NULL,
  changed_at timestamptz NOT NULL,
  PRIMARY KEY (endpoint_id, subject)
);
CREATE TABLE IF NOT EXISTS relay_stories (
  endpoint_id uuid NOT NULL,
  story_id text NOT NULL,
  ticker text,
  version bigint NOT NULL,
  closed boolean NOT NULL,
  merged_into text,
  story jsonb,
  epoch bigint NOT NULL,
  change_seq bigint NOT NULL,
  changed_at timestamptz NOT NULL,
  PRIMARY KEY (endpoint_id, story_id)
);
CREATE TABLE IF NOT EXISTS relay_notifications (
  endpoint_id uuid NOT NULL,
  story_id text NOT NULL,
  ticker text,
  version bigint NOT NULL,
  event_id text,
  story jsonb,
  epoch bigint NOT NULL,
  change_seq bigint NOT NULL,
  changed_at timestamptz NOT NULL,
  recorded_at timestamptz NOT NULL DEFAULT now(),
  handed_at timestamptz,
  PRIMARY KEY (endpoint_id, story_id)
);
CREATE INDEX IF NOT EXISTS relay_notifications_pending ON relay_notifications (recorded_at)
  WHERE handed_at IS NULL;
`;

// $1 endpoint, $2 tenant, $3 epoch, $4 change_seq. `pos` returns a row when the position moved:
// the next change_seq of the epoch held, or change_seq 1 of a greater epoch (or of a first).
const POSITION = `
  moved AS (
    UPDATE relay_positions AS p
    SET epoch = $3, last_change_seq = $4, updated_at = now()
    WHERE p.endpoint_id = $1
      AND ((p.epoch = $3 AND p.last_change_seq = $4 - 1) OR (p.epoch < $3 AND $4 = 1))
    RETURNING 1 AS one
  ),
  first AS (
    INSERT INTO relay_positions (endpoint_id, tenant_id, epoch, last_change_seq)
    SELECT $1, $2, $3, $4
    WHERE $4 = 1 AND NOT EXISTS (SELECT 1 FROM relay_positions WHERE endpoint_id = $1)
    ON CONFLICT (endpoint_id) DO NOTHING
    RETURNING 1 AS one
  ),
  pos AS (SELECT one FROM moved UNION ALL SELECT one FROM first)`;

const RESULT = `SELECT EXISTS (SELECT 1 FROM pos) AS advanced, EXISTS (SELECT 1 FROM w) AS written`;

// The feed's write: $5 subject, $6 item_kind, $7 generation, $8 sequence, $9 tombstone,
// $10 item, $11 changed_at.
const FEED_WRITE = `WITH ${POSITION},
  w AS (
    INSERT INTO relay_feed_items AS held (endpoint_id, subject, item_kind, generation, sequence,
                                          tombstone, item, epoch, change_seq, changed_at)
    SELECT $1, $5, $6, $7, $8, $9, $10::jsonb, $3, $4, $11 FROM pos
    ON CONFLICT (endpoint_id, subject) DO UPDATE
    SET item_kind = coalesce(excluded.item_kind, held.item_kind), generation = excluded.generation,
        sequence = excluded.sequence, tombstone = excluded.tombstone, item = excluded.item,
        epoch = excluded.epoch, change_seq = excluded.change_seq, changed_at = excluded.changed_at
    WHERE excluded.generation > held.generation
       OR (excluded.generation = held.generation
           AND (excluded.sequence > held.sequence
                OR (excluded.sequence = held.sequence AND excluded.tombstone AND NOT held.tombstone)))
    RETURNING 1
  )
  ${RESULT}`;

// A reload's removal (no sequence of its own): drops the row when held from an older
// generation, as the relay's "remove everything held from an older generation". $5 subject,
// $6 generation.
const FEED_DROP = `WITH ${POSITION},
  w AS (
    DELETE FROM relay_feed_items
    WHERE endpoint_id = $1 AND subject = $5 AND generation < $6 AND EXISTS (SELECT 1 FROM pos)
    RETURNING 1
  )
  ${RESULT}`;

// snapshot_begin: forget what is held of the endpoint (items and stories; notifications were
// acted on and stay).
const SNAPSHOT_BEGIN = `WITH ${POSITION},
  items AS (DELETE FROM relay_feed_items WHERE endpoint_id = $1 AND EXISTS (SELECT 1 FROM pos)),
  stories AS (DELETE FROM relay_stories WHERE endpoint_id = $1 AND EXISTS (SELECT 1 FROM pos)),
  w AS (SELECT 1 FROM pos)
  ${RESULT}`;

const POSITION_ONLY = `WITH ${POSITION}, w AS (SELECT 1 FROM pos) ${RESULT}`;

// A story saved: $5 story_id, $6 ticker, $7 version, $8 story, $9 changed_at. Only when newer
// than the row and the row is not closed.
const STORY_SAVE = `WITH ${POSITION},
  w AS (
    INSERT INTO relay_stories AS held (endpoint_id, story_id, ticker, version, closed, merged_into,
                                       story, epoch, change_seq, changed_at)
    SELECT $1, $5, $6, $7, false, NULL, $8::jsonb, $3, $4, $9 FROM pos
    ON CONFLICT (endpoint_id, story_id) DO UPDATE
    SET ticker = excluded.ticker, version = excluded.version, story = excluded.story,
        epoch = excluded.epoch, change_seq = excluded.change_seq, changed_at = excluded.changed_at
    WHERE NOT held.closed AND held.version < excluded.version
    RETURNING 1
  )
  ${RESULT}`;

// A story closed for good: $5 story_id, $6 ticker, $7 version, $8 merged_into, $9 changed_at.
// A change unless the row is closed at this version or later; the greatest version is kept.
const STORY_CLOSE = `WITH ${POSITION},
  w AS (
    INSERT INTO relay_stories AS held (endpoint_id, story_id, ticker, version, closed, merged_into,
                                       story, epoch, change_seq, changed_at)
    SELECT $1, $5, $6, $7, true, $8, NULL, $3, $4, $9 FROM pos
    ON CONFLICT (endpoint_id, story_id) DO UPDATE
    SET version = greatest(held.version, excluded.version), closed = true,
        merged_into = excluded.merged_into, story = NULL,
        epoch = excluded.epoch, change_seq = excluded.change_seq, changed_at = excluded.changed_at
    WHERE NOT (held.closed AND held.version >= excluded.version)
    RETURNING 1
  )
  ${RESULT}`;

// A story dropped (its ticker left the endpoint): the open row goes, a closed one stays.
const STORY_DROP = `WITH ${POSITION},
  w AS (
    DELETE FROM relay_stories
    WHERE endpoint_id = $1 AND story_id = $5 AND NOT closed AND EXISTS (SELECT 1 FROM pos)
    RETURNING 1
  )
  ${RESULT}`;

// A notification: recorded once per story and endpoint, not handed yet. $5 story_id, $6 ticker,
// $7 version, $8 story, $9 changed_at, $10 event_id.
const NOTIFY = `WITH ${POSITION},
  w AS (
    INSERT INTO relay_notifications (endpoint_id, story_id, ticker, version, event_id, story,
                                     epoch, change_seq, changed_at)
    SELECT $1, $5, $6, $7, $10, $8::jsonb, $3, $4, $9 FROM pos
    ON CONFLICT (endpoint_id, story_id) DO NOTHING
    RETURNING 1
  )
  ${RESULT}`;

// A notification of a stale epoch: recorded once per story, no position moved.
const LATE_NOTIFY = `INSERT INTO relay_notifications (endpoint_id, story_id, ticker, version, event_id,
                                                      story, epoch, change_seq, changed_at)
  VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8, $9)
  ON CONFLICT (endpoint_id, story_id) DO NOTHING`;

function statement(change: Change): { text: string; values: unknown[] } {
  const head = [change.webhook_endpoint_id, change.tenant_id, change.epoch, change.change_seq];
  if ('kind' in change) return storyStatement(change, head);
  return feedStatement(change, head);
}

function feedStatement(change: FeedChange, head: unknown[]): { text: string; values: unknown[] } {
  switch (change.operation) {
    case 'snapshot_begin':
      return { text: SNAPSHOT_BEGIN, values: head };
    case 'snapshot_end':
      return { text: POSITION_ONLY, values: head };
    case 'remove':
      if (change.sequence === null) {
        return { text: FEED_DROP, values: [...head, change.subject, change.generation] };
      }
      return {
        text: FEED_WRITE,
        values: [...head, change.subject, change.item_kind, change.generation, change.sequence, true, null, change.changed_at],
      };
    case 'upsert':
      return {
        text: FEED_WRITE,
        values: [...head, change.subject, change.item_kind, change.generation, change.sequence, false,
          JSON.stringify(change.item ?? null), change.changed_at],
      };
  }
}

function storyStatement(change: StoryMessage, head: unknown[]): { text: string; values: unknown[] } {
  const base = [...head, change.story_id, change.ticker, change.version];
  switch (change.operation) {
    case 'saved':
      return { text: STORY_SAVE, values: [...base, JSON.stringify(change.story ?? null), change.changed_at] };
    case 'closed':
      return { text: STORY_CLOSE, values: [...base, change.merged_into ?? null, change.changed_at] };
    case 'dropped':
      return { text: STORY_DROP, values: [...head, change.story_id] };
    case 'notified':
      return { text: NOTIFY, values: [...base, JSON.stringify(change.story ?? null), change.changed_at, change.event_id] };
  }
}

export class PgStore implements Store {
  readonly pool: Pool;
  private readonly handlers: Handlers<PoolClient>;
  private readonly ready: Promise<void>;

  constructor(options: PgStoreOptions) {
    this.pool = new Pool(typeof options.connection === 'string' ? { connectionString: options.connection, max: 4 } : options.connection);
    this.handlers = options.handlers ?? {};
    this.ready = options.migrate === false ? Promise.resolve() : this.migrate();
    this.ready.catch(() => {});
  }

  /** Creates the store's tables when missing. */
  async migrate(): Promise<void> {
    const client = await this.pool.connect();
    try {
      // One migration at a time across processes.
      await client.query('BEGIN');
      await client.query('SELECT pg_advisory_xact_lock(4104201)');
      await client.query(SCHEMA_SQL);
      await client.query('COMMIT');
    } catch (error) {
      await client.query('ROLLBACK').catch(() => {});
      throw error;
    } finally {
      client.release();
    }
  }

  async positions(): Promise<Map<string, Position>> {
    await this.ready;
    const { rows } = await this.pool.query<{ endpoint_id: string; epoch: string; last_change_seq: string }>(
      'SELECT endpoint_id, epoch, last_change_seq FROM relay_positions',
    );
    return new Map(rows.map((r) => [r.endpoint_id, { epoch: Number(r.epoch), lastChangeSeq: Number(r.last_change_seq) }]));
  }

  async apply(changes: Change[], lateNotifications: StoryMessage[] = []): Promise<ApplyOutcome> {
    await this.ready;
    const outcome: ApplyOutcome = { applied: 0, skipped: 0, declined: 0, notifications: 0, repeatedNotifications: 0 };
    if (changes.length === 0 && lateNotifications.length === 0) return outcome;
    const client = await this.pool.connect();
    try {
      await client.query('BEGIN');
      for (const late of lateNotifications) {
        const { rowCount } = await client.query(LATE_NOTIFY, [
          late.webhook_endpoint_id, late.story_id, late.ticker, late.version, late.event_id,
          JSON.stringify(late.story ?? null), late.epoch, late.change_seq, late.changed_at,
        ]);
        if (rowCount) outcome.notifications += 1;
        else outcome.repeatedNotifications += 1;
      }
      for (const change of changes) {
        const { rows } = await client.query<{ advanced: boolean; written: boolean }>(statement(change));
        const { advanced, written } = rows[0]!;
        if (!advanced) {
          outcome.skipped += 1;
          continue;
        }
        outcome.applied += 1;
        if ('kind' in change && change.operation === 'notified') {
          if (written) outcome.notifications += 1;
          else outcome.repeatedNotifications += 1;
          continue;
        }
        if (!written && !isMarker(change)) outcome.declined += 1;
        await callHandler(this.handlers, change, { client, written });
      }
      await client.query('COMMIT');
      return outcome;
    } catch (error) {
      await client.query('ROLLBACK').catch(() => {});
      throw error;
    } finally {
      client.release();
    }
  }

  /**
   * Hands each notification recorded and not handed yet to the handler, one transaction each:
   * the row is locked, the handler called with the transaction's client, the row marked handed,
   * and the transaction committed. What the handler writes with that client commits with the
   * mark, exactly once; a throw rolls both back and the notification stays pending.
   */
  async handPending(): Promise<number> {
    await this.ready;
    let handed = 0;
    for (;;) {
      const client = await this.pool.connect();
      try {
        await client.query('BEGIN');
        const { rows } = await client.query(
          `SELECT endpoint_id, story_id, ticker, version, event_id, story, epoch, change_seq, changed_at
           FROM relay_notifications WHERE handed_at IS NULL
           ORDER BY recorded_at, endpoint_id, change_seq LIMIT 1 FOR UPDATE SKIP LOCKED`,
        );
        const row = rows[0];
        if (!row) {
          await client.query('COMMIT');
          return handed;
        }
        const record: NotificationRecord = {
          endpoint: row.endpoint_id, story_id: row.story_id, ticker: row.ticker, version: Number(row.version),
          event_id: row.event_id, story: row.story, epoch: Number(row.epoch), change_seq: Number(row.change_seq),
          changed_at: new Date(row.changed_at).toISOString(),
        };
        if (this.handlers.notification) await this.handlers.notification(record, { client });
        await client.query('UPDATE relay_notifications SET handed_at = now() WHERE endpoint_id = $1 AND story_id = $2', [row.endpoint_id, row.story_id]);
        await client.query('COMMIT');
        handed += 1;
      } catch (error) {
        await client.query('ROLLBACK').catch(() => {});
        throw error;
      } finally {
        client.release();
      }
    }
  }

  async close(): Promise<void> {
    await this.ready.catch(() => {});
    await this.pool.end();
  }
}

function isMarker(change: Change): boolean {
  return !('kind' in change) && (change.operation === 'snapshot_begin' || change.operation === 'snapshot_end');
}
