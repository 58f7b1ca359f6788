// A store in Postgres. A change is applied only when it follows its endpoint's position (the
// same epoch and the next change_seq, or change_seq 1 of a greater epoch or of an endpoint not
// seen yet), and its row is written only when the write wins as the relay's own writes do
// (services/store/src/copy.rs: a newer generation, a higher sequence compared as bytes, a
// removal at the same sequence over an item; stories.rs: a save only when newer than an open
// row, a close for good at the greatest version), decided by the statement that writes it. A
// batch is one transaction with its positions, so a consumer killed at any moment either
// applied a change with its position or neither, and on restart skips what it applied.

import { Pool, PoolClient, PoolConfig } from 'pg';
import { classify, PermanentError } from './errors';
import { Position } from './follower';
import { Change, decodeChange, FeedChange, StoryMessage } from './message';
import { ApplyOutcome, callHandler, callNotificationHandler, Handlers, NotificationRecord, Store } from './store';
import { VERSION } from './version';

export interface PgStoreOptions {
  /** A connection string, or pg's pool settings. */
  connection: string | PoolConfig;
  handlers?: Handlers<PoolClient>;
  /** Bring the store's schema to this library's version when first used (default true). */
  migrate?: boolean;
}

/** The store schema version this library writes (clients/README.md, "The store schema"). */
export const SCHEMA_VERSION = 1;

/** What `relay_consumer_schema.library` records for the migrations this library applies. */
export const LIBRARY = `relay-consumer-typescript ${VERSION}`;

/** Takes one migration at a time across every process and both libraries. */
export const MIGRATION_LOCK = 7_261_207;

export const SCHEMA_TABLE_SQL = `
CREATE TABLE IF NOT EXISTS relay_consumer_schema (
    version    integer PRIMARY KEY,
    library    text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
`;

/**
 * Migration 1: from nothing, or from either library's tables before versioning, which it
 * brings to the same layout (clients/README.md).
 */
export const SCHEMA_SQL = `
-- Tables of the TypeScript library before version 1.
ALTER TABLE IF EXISTS relay_feed_items RENAME TO relay_items;
CREATE TABLE IF NOT EXISTS relay_positions (
    endpoint_id     uuid PRIMARY KEY,
    tenant_id       uuid,
    epoch           bigint NOT NULL,
    last_change_seq bigint NOT NULL,
    snapshot_open   boolean NOT NULL DEFAULT false,
    updated_at      timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE relay_positions ADD COLUMN IF NOT EXISTS tenant_id uuid;
ALTER TABLE relay_positions ALTER COLUMN tenant_id DROP NOT NULL;
ALTER TABLE relay_positions ADD COLUMN IF NOT EXISTS snapshot_open boolean NOT NULL DEFAULT false;
CREATE TABLE IF NOT EXISTS relay_items (
    endpoint_id uuid NOT NULL,
    subject     text NOT NULL,
    item_kind   text,
    generation  bigint NOT NULL,
    sequence    text COLLATE "C",
    tombstone   boolean NOT NULL DEFAULT false,
    item        jsonb,
    epoch       bigint NOT NULL,
    change_seq  bigint NOT NULL,
    changed_at  timestamptz NOT NULL,
    PRIMARY KEY (endpoint_id, subject)
);
ALTER TABLE relay_items ADD COLUMN IF NOT EXISTS tombstone boolean NOT NULL DEFAULT false;
ALTER TABLE relay_items ALTER COLUMN item DROP NOT NULL;
ALTER TABLE relay_items ALTER COLUMN sequence TYPE text COLLATE "C";
CREATE TABLE IF NOT EXISTS relay_stories (
    endpoint_id uuid NOT NULL,
    story_id    text NOT NULL,
    ticker      text,
    version     bigint NOT NULL,
    closed      boolean NOT NULL,
    merged_into text,
    story       jsonb,
    epoch       bigint NOT NULL,
    change_seq  bigint NOT NULL,
    changed_at  timestamptz NOT NULL,
    PRIMARY KEY (endpoint_id, story_id)
);
CREATE TABLE IF NOT EXISTS relay_notifications (
    endpoint_id uuid NOT NULL,
    story_id    text NOT NULL,
    ticker      text,
    version     bigint NOT NULL,
    event_id    text,
    story       jsonb,
    epoch       bigint NOT NULL,
    change_seq  bigint NOT NULL,
    changed_at  timestamptz NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    handed_at   timestamptz,
    repeats     integer NOT NULL DEFAULT 0,
    PRIMARY KEY (endpoint_id, story_id)
);
ALTER TABLE relay_notifications ADD COLUMN IF NOT EXISTS repeats integer NOT NULL DEFAULT 0;
DROP INDEX IF EXISTS relay_notifications_pending;
CREATE INDEX IF NOT EXISTS relay_notifications_unhanded
    ON relay_notifications (recorded_at) WHERE handed_at IS NULL;
CREATE TABLE IF NOT EXISTS relay_held (
    endpoint_id uuid NOT NULL,
    epoch       bigint NOT NULL,
    change_seq  bigint NOT NULL,
    body        jsonb NOT NULL,
    held_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (endpoint_id, epoch, change_seq)
);
`;

/** Each migration, in order: version n brings the schema from n - 1 to n. */
export const MIGRATIONS: readonly { version: number; sql: string }[] = [{ version: 1, sql: SCHEMA_SQL }];

// A batch is written in a few statements, each for many changes at once (arrays unnested), not
// one per change: pg's client sends one statement per round trip, so the round trips are what
// bounds the store.
//
// The positions. The batch first locks the rows of its endpoints (in endpoint order) and reads
// where each stands; which change follows which is then known without asking again. Each
// endpoint's position moves once per batch, from where it stood to its last change applied, and
// only from there (`moved`: `WHERE epoch = <before> AND last_change_seq = <before>`; `started`:
// a first position, `ON CONFLICT DO NOTHING`). That is in the batch's first write statement, whose
// writes are made only when every position moved (`ok`); when one did not (another consumer
// started the endpoint meanwhile) the transaction rolls back and the batch is tried again from
// the positions as they are then.
//
// The writes. Each row's write is decided by its statement, by the same conditions as the relay's
// own writes (below), against the row as held then. A statement cannot write one row twice, so
// the changes are put in layers: the n-th change of a batch to a row is in the n-th statement
// (a snapshot_begin, which forgets its endpoint's rows, after every earlier write of that
// endpoint and before every later one). Changes of different rows do not bear on each other, so
// the result is that of applying the changes one by one in order; a batch whose rows are all
// distinct is one statement.

/** Tries of a batch whose positions moved under it (another consumer's first change). */
const MAX_ATTEMPTS = 5;

const LOCK_POSITIONS = `
  SELECT e.given AS endpoint, p.epoch, p.last_change_seq
  FROM unnest($1::text[]) AS e(given) JOIN relay_positions AS p ON p.endpoint_id = e.given::uuid
  ORDER BY p.endpoint_id FOR UPDATE OF p`;

/** One change's write in a batch's statements (a late notification is one too). */
type WriteKind = 'feedWrite' | 'feedDrop' | 'snapshotBegin' | 'storySave' | 'storyClose' | 'storyDrop' | 'notify' | 'notifyLate';

interface Write {
  kind: WriteKind;
  change: Change;
  /** Its place in `written`. */
  slot: number;
}

/** A position to move: from where it stood (null: none yet) to the last change applied. */
interface Move {
  endpoint: string;
  tenant: string;
  from: Position | null;
  to: Position;
  /** true after a snapshot_begin, false after a snapshot_end (the batch's last), null: as it was. */
  snapshotOpen: boolean | null;
}

/** Builds one statement's text and values. */
class Statement {
  readonly values: unknown[] = [];
  readonly ctes: string[] = [];
  /** Selects of the written slots, unioned. */
  readonly written: string[] = [];

  param(value: unknown, type: string): string {
    this.values.push(value);
    return `$${this.values.length}::${type}`;
  }

  /** A CTE of the rows given, columns (name, type, values). */
  source(name: string, columns: [string, string, unknown[]][], guarded: boolean): void {
    const arrays = columns.map(([, type, values]) => this.param(values, `${type}[]`)).join(', ');
    const names = columns.map(([column]) => column).join(', ');
    this.ctes.push(`${name} AS (SELECT * FROM unnest(${arrays}) AS t(${names})${guarded ? ' WHERE (SELECT ok FROM ok)' : ''})`);
  }

  text(ok: string): string {
    const written = this.written.length > 0 ? `ARRAY(${this.written.join(' UNION ALL ')})` : 'ARRAY[]::int[]';
    const withs = this.ctes.length > 0 ? `WITH ${this.ctes.join(',\n')}\n` : '';
    return `${withs}SELECT ${ok} AS ok, ${written} AS written`;
  }
}

function positionCtes(s: Statement, moves: Move[]): void {
  const moving = moves.filter((m) => m.from !== null);
  const starting = moves.filter((m) => m.from === null);
  s.ctes.push(`moved AS (
    UPDATE relay_positions AS p
    SET epoch = m.epoch, last_change_seq = m.last_change_seq, snapshot_open = coalesce(m.snapshot_open, p.snapshot_open),
        updated_at = now()
    FROM unnest(${s.param(moving.map((m) => m.endpoint), 'uuid[]')}, ${s.param(moving.map((m) => m.from!.epoch), 'bigint[]')},
                ${s.param(moving.map((m) => m.from!.lastChangeSeq), 'bigint[]')}, ${s.param(moving.map((m) => m.to.epoch), 'bigint[]')},
                ${s.param(moving.map((m) => m.to.lastChangeSeq), 'bigint[]')}, ${s.param(moving.map((m) => m.snapshotOpen), 'boolean[]')})
      AS m(endpoint_id, from_epoch, from_last_change_seq, epoch, last_change_seq, snapshot_open)
    WHERE p.endpoint_id = m.endpoint_id AND p.epoch = m.from_epoch AND p.last_change_seq = m.from_last_change_seq
    RETURNING 1
  )`);
  s.ctes.push(`started AS (
    INSERT INTO relay_positions (endpoint_id, tenant_id, epoch, last_change_seq, snapshot_open)
    SELECT endpoint_id, tenant_id, epoch, last_change_seq, coalesce(snapshot_open, false)
    FROM unnest(${s.param(starting.map((m) => m.endpoint), 'uuid[]')}, ${s.param(starting.map((m) => m.tenant), 'uuid[]')},
                ${s.param(starting.map((m) => m.to.epoch), 'bigint[]')}, ${s.param(starting.map((m) => m.to.lastChangeSeq), 'bigint[]')},
                ${s.param(starting.map((m) => m.snapshotOpen), 'boolean[]')})
      AS m(endpoint_id, tenant_id, epoch, last_change_seq, snapshot_open)
    ORDER BY endpoint_id
    ON CONFLICT (endpoint_id) DO NOTHING
    RETURNING 1
  )`);
  s.ctes.push(`ok AS (SELECT (SELECT count(*) FROM moved) + (SELECT count(*) FROM started) = ${s.param(moves.length, 'bigint')} AS ok)`);
}

/**
 * The held changes as the batch leaves them (relay_held): forgotten up to each position moved
 * (what it reached, and an older epoch's), and, for a change held of a greater epoch than the
 * others held of its endpoint, the older epochs' ones; the batch's new ones kept. The rows
 * forgotten and the rows kept never meet (those kept are past their endpoint's position), so
 * one statement does both.
 */
function heldCtes(s: Statement, moves: Move[], held: Change[], guarded: boolean): void {
  const upTo = [
    ...moves.map((m) => ({ endpoint: m.endpoint, epoch: m.to.epoch, last: m.to.lastChangeSeq })),
    ...held.map((c) => ({ endpoint: c.webhook_endpoint_id, epoch: c.epoch, last: 0 })),
  ];
  const guard = guarded ? ' AND (SELECT ok FROM ok)' : '';
  if (upTo.length > 0) {
    s.ctes.push(`held_forgotten AS (
    DELETE FROM relay_held AS h
    USING unnest(${s.param(upTo.map((u) => u.endpoint), 'uuid[]')}, ${s.param(upTo.map((u) => u.epoch), 'bigint[]')},
                 ${s.param(upTo.map((u) => u.last), 'bigint[]')}) AS m(endpoint_id, epoch, last_change_seq)
    WHERE h.endpoint_id = m.endpoint_id AND (h.epoch, h.change_seq) <= (m.epoch, m.last_change_seq)${guard}
  )`);
  }
  if (held.length > 0) {
    s.ctes.push(`held_kept AS (
    INSERT INTO relay_held (endpoint_id, epoch, change_seq, body)
    SELECT * FROM unnest(${s.param(held.map((c) => c.webhook_endpoint_id), 'uuid[]')}, ${s.param(held.map((c) => c.epoch), 'bigint[]')},
                         ${s.param(held.map((c) => c.change_seq), 'bigint[]')}, ${s.param(held.map((c) => JSON.stringify(c)), 'jsonb[]')})
      AS t(endpoint_id, epoch, change_seq, body)
    WHERE true${guard}
    ORDER BY endpoint_id, epoch, change_seq
    ON CONFLICT DO NOTHING
  )`);
  }
}

const feedOf = (w: Write) => w.change as FeedChange;
const storyOf = (w: Write) => w.change as StoryMessage;
const json = (value: unknown) => JSON.stringify(value ?? null);

/** The CTEs of one layer's writes (every row in it a different one of its table). */
function writeCtes(s: Statement, writes: Write[], guarded: boolean): void {
  const of = (kind: WriteKind) => writes.filter((w) => w.kind === kind);
  const slots = (rows: Write[]): [string, string, unknown[]] => ['slot', 'int', rows.map((w) => w.slot)];
  const endpoints = (rows: Write[]): [string, string, unknown[]] => ['endpoint_id', 'uuid', rows.map((w) => w.change.webhook_endpoint_id)];
  const at = (rows: Write[]): [string, string, unknown[]][] => [
    ['epoch', 'bigint', rows.map((w) => w.change.epoch)],
    ['change_seq', 'bigint', rows.map((w) => w.change.change_seq)],
    ['changed_at', 'timestamptz', rows.map((w) => w.change.changed_at)],
  ];

  // A feed write (an upsert, or a removal with its sequence: a tombstone): only when it wins
  // over the row held, as the relay's copy.rs: a newer generation, a higher sequence compared as
  // bytes (COLLATE "C"), or a removal at the same sequence over an item.
  const feedWrites = of('feedWrite');
  if (feedWrites.length > 0) {
    s.source('fw_rows', [
      slots(feedWrites), endpoints(feedWrites),
      ['subject', 'text', feedWrites.map((w) => feedOf(w).subject)],
      ['item_kind', 'text', feedWrites.map((w) => feedOf(w).item_kind)],
      ['generation', 'bigint', feedWrites.map((w) => feedOf(w).generation)],
      ['sequence', 'text', feedWrites.map((w) => feedOf(w).sequence)],
      ['tombstone', 'boolean', feedWrites.map((w) => feedOf(w).operation === 'remove')],
      ['item', 'jsonb', feedWrites.map((w) => (feedOf(w).operation === 'remove' ? null : json(feedOf(w).item)))],
      ...at(feedWrites),
    ], guarded);
    s.ctes.push(`fw AS (
    INSERT INTO relay_items AS held (endpoint_id, subject, item_kind, generation, sequence,
                                          tombstone, item, epoch, change_seq, changed_at)
    SELECT endpoint_id, subject, item_kind, generation, sequence, tombstone, item, epoch, change_seq, changed_at FROM fw_rows
    ON CONFLICT (endpoint_id, subject) DO UPDATE
    SET item_kind = coalesce(excluded.item_kind, held.item_kind), generation = excluded.generation,
        sequence = excluded.sequence, tombstone = excluded.tombstone, item = excluded.item,
        epoch = excluded.epoch, change_seq = excluded.change_seq, changed_at = excluded.changed_at
    WHERE excluded.generation > held.generation
       OR (excluded.generation = held.generation
           AND (excluded.sequence > held.sequence
                OR (excluded.sequence = held.sequence AND excluded.tombstone AND NOT held.tombstone)))
    RETURNING endpoint_id, subject
  )`);
    s.written.push('SELECT slot FROM fw_rows JOIN fw USING (endpoint_id, subject)');
  }

  // A reload's removal (no sequence of its own): drops the row when held from an older
  // generation, as the relay's "remove everything held from an older generation".
  const feedDrops = of('feedDrop');
  if (feedDrops.length > 0) {
    s.source('fd_rows', [
      slots(feedDrops), endpoints(feedDrops),
      ['subject', 'text', feedDrops.map((w) => feedOf(w).subject)],
      ['generation', 'bigint', feedDrops.map((w) => feedOf(w).generation)],
    ], guarded);
    s.ctes.push(`fd AS (
    DELETE FROM relay_items AS held USING fd_rows AS t
    WHERE held.endpoint_id = t.endpoint_id AND held.subject = t.subject AND held.generation < t.generation
    RETURNING t.slot
  )`);
    s.written.push('SELECT slot FROM fd');
  }

  // snapshot_begin: forget what is held of the endpoint (items and stories; notifications were
  // acted on and stay).
  const snapshots = of('snapshotBegin');
  if (snapshots.length > 0) {
    s.source('sb_rows', [slots(snapshots), endpoints(snapshots)], guarded);
    s.ctes.push('sb_items AS (DELETE FROM relay_items AS held USING sb_rows AS t WHERE held.endpoint_id = t.endpoint_id)');
    s.ctes.push('sb_stories AS (DELETE FROM relay_stories AS held USING sb_rows AS t WHERE held.endpoint_id = t.endpoint_id)');
    s.written.push('SELECT slot FROM sb_rows');
  }

  // A story saved: only when newer than the row and the row is not closed.
  const saves = of('storySave');
  if (saves.length > 0) {
    s.source('ss_rows', [
      slots(saves), endpoints(saves),
      ['story_id', 'text', saves.map((w) => storyOf(w).story_id)],
      ['ticker', 'text', saves.map((w) => storyOf(w).ticker)],
      ['version', 'bigint', saves.map((w) => storyOf(w).version)],
      ['story', 'jsonb', saves.map((w) => json(storyOf(w).story))],
      ...at(saves),
    ], guarded);
    s.ctes.push(`ss AS (
    INSERT INTO relay_stories AS held (endpoint_id, story_id, ticker, version, closed, merged_into,
                                       story, epoch, change_seq, changed_at)
    SELECT endpoint_id, story_id, ticker, version, false, NULL, story, epoch, change_seq, changed_at FROM ss_rows
    ON CONFLICT (endpoint_id, story_id) DO UPDATE
    SET ticker = excluded.ticker, version = excluded.version, story = excluded.story,
        epoch = excluded.epoch, change_seq = excluded.change_seq, changed_at = excluded.changed_at
    WHERE NOT held.closed AND held.version < excluded.version
    RETURNING endpoint_id, story_id
  )`);
    s.written.push('SELECT slot FROM ss_rows JOIN ss USING (endpoint_id, story_id)');
  }

  // A story closed for good: a change unless the row is closed at this version or later; the
  // greatest version is kept.
  const closes = of('storyClose');
  if (closes.length > 0) {
    s.source('sc_rows', [
      slots(closes), endpoints(closes),
      ['story_id', 'text', closes.map((w) => storyOf(w).story_id)],
      ['ticker', 'text', closes.map((w) => storyOf(w).ticker)],
      ['version', 'bigint', closes.map((w) => storyOf(w).version)],
      ['merged_into', 'text', closes.map((w) => storyOf(w).merged_into ?? null)],
      ...at(closes),
    ], guarded);
    s.ctes.push(`sc AS (
    INSERT INTO relay_stories AS held (endpoint_id, story_id, ticker, version, closed, merged_into,
                                       story, epoch, change_seq, changed_at)
    SELECT endpoint_id, story_id, ticker, version, true, merged_into, NULL, epoch, change_seq, changed_at FROM sc_rows
    ON CONFLICT (endpoint_id, story_id) DO UPDATE
    SET version = greatest(held.version, excluded.version), closed = true,
        merged_into = excluded.merged_into, story = NULL,
        epoch = excluded.epoch, change_seq = excluded.change_seq, changed_at = excluded.changed_at
    WHERE NOT (held.closed AND held.version >= excluded.version)
    RETURNING endpoint_id, story_id
  )`);
    s.written.push('SELECT slot FROM sc_rows JOIN sc USING (endpoint_id, story_id)');
  }

  // A story dropped (its ticker left the endpoint): the open row goes, a closed one stays.
  const drops = of('storyDrop');
  if (drops.length > 0) {
    s.source('sd_rows', [slots(drops), endpoints(drops), ['story_id', 'text', drops.map((w) => storyOf(w).story_id)]], guarded);
    s.ctes.push(`sd AS (
    DELETE FROM relay_stories AS held USING sd_rows AS t
    WHERE held.endpoint_id = t.endpoint_id AND held.story_id = t.story_id AND NOT held.closed
    RETURNING t.slot
  )`);
    s.written.push('SELECT slot FROM sd');
  }

  // A notification: recorded once per story and endpoint, not handed yet. One of the batch
  // counts a later notified change of a story recorded already in `repeats`; a late one (of a
  // stale epoch) does not.
  for (const [name, kind] of [['nt', 'notify'], ['nl', 'notifyLate']] as const) {
    const notifications = of(kind);
    if (notifications.length === 0) continue;
    s.source(`${name}_rows`, [
      slots(notifications), endpoints(notifications),
      ['story_id', 'text', notifications.map((w) => storyOf(w).story_id)],
      ['ticker', 'text', notifications.map((w) => storyOf(w).ticker)],
      ['version', 'bigint', notifications.map((w) => storyOf(w).version)],
      ['event_id', 'text', notifications.map((w) => storyOf(w).event_id)],
      ['story', 'jsonb', notifications.map((w) => json(storyOf(w).story))],
      ...at(notifications),
    ], guarded);
    const onConflict = kind === 'notify' ? 'DO UPDATE SET repeats = n.repeats + 1' : 'DO NOTHING';
    s.ctes.push(`${name} AS (
    INSERT INTO relay_notifications AS n (endpoint_id, story_id, ticker, version, event_id, story,
                                          epoch, change_seq, changed_at)
    SELECT endpoint_id, story_id, ticker, version, event_id, story, epoch, change_seq, changed_at FROM ${name}_rows
    ON CONFLICT (endpoint_id, story_id) ${onConflict}
    RETURNING endpoint_id, story_id, (n.xmax = 0) AS recorded
  )`);
    s.written.push(`SELECT slot FROM ${name}_rows JOIN ${name} USING (endpoint_id, story_id) WHERE ${name}.recorded`);
  }
}

/** Whether a change follows a position (none: an endpoint not seen yet). */
function follows(position: Position | undefined, change: Change): boolean {
  if (position === undefined) return change.change_seq === 1;
  if (change.epoch === position.epoch) return change.change_seq === position.lastChangeSeq + 1;
  return change.epoch > position.epoch && change.change_seq === 1;
}

function writeKind(change: Change): WriteKind | null {
  if ('kind' in change) {
    switch (change.operation) {
      case 'saved': return 'storySave';
      case 'closed': return 'storyClose';
      case 'dropped': return 'storyDrop';
      case 'notified': return 'notify';
    }
  }
  switch (change.operation) {
    case 'snapshot_begin': return 'snapshotBegin';
    case 'snapshot_end': return null;
    case 'remove': return change.sequence === null ? 'feedDrop' : 'feedWrite';
    case 'upsert': return 'feedWrite';
  }
}

/**
 * Puts the writes in layers: each row written at most once per layer, a row's writes in change
 * order, an endpoint's snapshot_begin after its earlier writes of items and stories and before
 * its later ones (notifications are not forgotten by it, so not ordered by it).
 */
function layered(writes: Write[]): Write[][] {
  const layers: Write[][] = [];
  const nextOfRow = new Map<string, number>();
  const floorOf = new Map<string, number>();
  const topOf = new Map<string, number>();
  for (const w of writes) {
    const endpoint = w.change.webhook_endpoint_id;
    let layer: number;
    if (w.kind === 'snapshotBegin') {
      layer = Math.max(floorOf.get(endpoint) ?? 0, (topOf.get(endpoint) ?? -1) + 1);
      floorOf.set(endpoint, layer + 1);
      topOf.set(endpoint, layer);
    } else {
      const table = w.kind === 'notify' || w.kind === 'notifyLate' ? 'n' : w.kind.startsWith('feed') ? 'i' : 's';
      const key = `${table}\u0000${endpoint}\u0000${'kind' in w.change ? w.change.story_id : w.change.subject}`;
      layer = nextOfRow.get(key) ?? 0;
      if (table !== 'n') {
        layer = Math.max(layer, floorOf.get(endpoint) ?? 0);
        topOf.set(endpoint, Math.max(topOf.get(endpoint) ?? -1, layer));
      }
      nextOfRow.set(key, layer + 1);
    }
    while (layers.length <= layer) layers.push([]);
    layers[layer]!.push(w);
  }
  return layers;
}

export class PgStore implements Store {
  readonly pool: Pool;
  private readonly handlers: Handlers<PoolClient>;
  private readonly migrateOnUse: boolean;
  private ready: Promise<void> | undefined;
  private closing: Promise<void> | undefined;

  /**
   * A store on the database named (nothing is opened until first used). `PgStore.open()` opens
   * it at once, failing then when the database cannot be used.
   */
  constructor(options: PgStoreOptions) {
    const config: PoolConfig = typeof options.connection === 'string'
      ? { connectionString: options.connection, max: 4, connectionTimeoutMillis: 10_000, keepAlive: true }
      : options.connection;
    this.pool = new Pool(config);
    // A connection lost while idle in the pool (the database restarting): it is dropped from the
    // pool, and the next query opens another. Without a listener the error would end the process.
    this.pool.on('error', () => {});
    // The same while in use: the query under way fails with it (and the batch with the query).
    this.pool.on('connect', (client) => client.on('error', () => {}));
    this.handlers = options.handlers ?? {};
    this.migrateOnUse = options.migrate !== false;
  }

  /**
   * Opens a store and brings its schema to this library's version: rejects with a
   * PermanentError when the database does not exist (`store_missing`), refuses the credentials
   * (`store_auth`), or holds a newer schema (`schema_newer`), with the error as it came otherwise.
   */
  static async open(connection: string | PoolConfig, options: Omit<PgStoreOptions, 'connection'> = {}): Promise<PgStore> {
    const store = new PgStore({ ...options, connection });
    try {
      await store.whenReady();
    } catch (error) {
      await store.close().catch(() => {});
      const classified = classify(error);
      throw classified.kind === 'permanent' ? classified.error : error;
    }
    return store;
  }

  /** Migrates once (again after a failure), before the store's first statement. */
  private whenReady(): Promise<void> {
    if (!this.migrateOnUse) return Promise.resolve();
    const ready = this.ready ?? this.migrate().then(
      () => {},
      (error) => {
        this.ready = undefined;
        throw error;
      },
    );
    this.ready = ready;
    return ready;
  }

  /**
   * Brings the schema to this library's version, in one transaction under the advisory lock
   * both libraries take: the versions applied are read from `relay_consumer_schema`, a newer
   * one than this library's is a PermanentError (`schema_newer`), each missing migration is
   * applied and recorded. Answers the versions applied now.
   */
  async migrate(): Promise<number[]> {
    const client = await this.pool.connect();
    let broken: unknown;
    try {
      await client.query('BEGIN');
      await client.query(`SELECT pg_advisory_xact_lock(${MIGRATION_LOCK})`);
      await client.query(SCHEMA_TABLE_SQL);
      const { rows } = await client.query<{ version: number | null }>('SELECT max(version) AS version FROM relay_consumer_schema');
      const current = rows[0]?.version ?? 0;
      if (current > SCHEMA_VERSION) {
        const held = await client.query<{ library: string }>('SELECT library FROM relay_consumer_schema WHERE version = $1', [current]);
        throw new PermanentError('schema_newer',
          `the store's schema is version ${current} (${held.rows[0]?.library ?? 'unknown library'}); ${LIBRARY} reads version ${SCHEMA_VERSION} at most: upgrade the library`);
      }
      const applied: number[] = [];
      for (const migration of MIGRATIONS) {
        if (migration.version <= current) continue;
        await client.query(migration.sql);
        await client.query('INSERT INTO relay_consumer_schema (version, library) VALUES ($1, $2)', [migration.version, LIBRARY]);
        applied.push(migration.version);
      }
      await client.query('COMMIT');
      return applied;
    } catch (error) {
      broken = error;
      await client.query('ROLLBACK').catch(() => {});
      throw error;
    } finally {
      client.release(broken instanceof PermanentError ? undefined : (broken as Error | undefined));
    }
  }

  async positions(): Promise<Map<string, Position>> {
    await this.whenReady();
    const { rows } = await this.pool.query<{ endpoint_id: string; epoch: string; last_change_seq: string }>(
      'SELECT endpoint_id, epoch, last_change_seq FROM relay_positions',
    );
    return new Map(rows.map((r) => [r.endpoint_id, { epoch: Number(r.epoch), lastChangeSeq: Number(r.last_change_seq) }]));
  }

  async held(): Promise<Change[]> {
    await this.whenReady();
    const { rows } = await this.pool.query<{ body: unknown }>('SELECT body FROM relay_held ORDER BY endpoint_id, epoch, change_seq');
    // Written by one of the libraries from a message they decoded: decoded again the same way.
    return rows.map((r) => decodeChange(JSON.stringify(r.body)));
  }

  async apply(changes: Change[], lateNotifications: StoryMessage[] = [], held: Change[] = []): Promise<ApplyOutcome> {
    await this.whenReady();
    if (changes.length === 0 && lateNotifications.length === 0 && held.length === 0) {
      return { applied: 0, skipped: 0, declined: 0, notifications: 0, repeatedNotifications: 0 };
    }
    const client = await this.pool.connect();
    let broken: Error | undefined;
    try {
      for (let attempt = 1; ; attempt++) {
        await client.query('BEGIN');
        const outcome = await this.applyOnce(client, changes, lateNotifications, held);
        if (outcome !== null) {
          await client.query('COMMIT');
          return outcome;
        }
        // A position was not where the batch found it (another consumer started the endpoint
        // meanwhile): nothing of the batch was written; again from the positions as they are.
        await client.query('ROLLBACK');
        if (attempt >= MAX_ATTEMPTS) throw new Error(`the positions kept moving under the batch (${attempt} attempts)`);
      }
    } catch (error) {
      broken = error as Error;
      await client.query('ROLLBACK').catch(() => {});
      throw error;
    } finally {
      // After a failure the connection is not given back to the pool (it may be broken).
      client.release(broken);
    }
  }

  /** One attempt, inside a transaction: null when a position was not where it was read. */
  private async applyOnce(client: PoolClient, changes: Change[], lateNotifications: StoryMessage[], held: Change[]): Promise<ApplyOutcome | null> {
    const outcome: ApplyOutcome = { applied: 0, skipped: 0, declined: 0, notifications: 0, repeatedNotifications: 0 };
    const positions = new Map<string, Position>();
    const endpoints = [...new Set(changes.map((c) => c.webhook_endpoint_id))];
    if (endpoints.length > 0) {
      const { rows } = await client.query<{ endpoint: string; epoch: string; last_change_seq: string }>(LOCK_POSITIONS, [endpoints]);
      for (const r of rows) positions.set(r.endpoint, { epoch: Number(r.epoch), lastChangeSeq: Number(r.last_change_seq) });
    }

    // Which changes follow the positions, each endpoint's move, and the writes of those applied.
    const writes: Write[] = lateNotifications.map((change, slot) => ({ kind: 'notifyLate', change, slot }));
    const moves = new Map<string, Move>();
    const slotOf: (number | null)[] = [];
    for (const change of changes) {
      const endpoint = change.webhook_endpoint_id;
      const at = positions.get(endpoint);
      if (!follows(at, change)) {
        slotOf.push(null);
        continue;
      }
      const to = { epoch: change.epoch, lastChangeSeq: change.change_seq };
      positions.set(endpoint, to);
      let move = moves.get(endpoint);
      if (move) move.to = to;
      else moves.set(endpoint, (move = { endpoint, tenant: change.tenant_id, from: at ?? null, to, snapshotOpen: null }));
      if (!('kind' in change) && change.operation === 'snapshot_begin') move.snapshotOpen = true;
      if (!('kind' in change) && change.operation === 'snapshot_end') move.snapshotOpen = false;
      const kind = writeKind(change);
      if (kind === null) {
        slotOf.push(-1);
        continue;
      }
      slotOf.push(writes.length);
      writes.push({ kind, change, slot: writes.length });
    }

    const written: boolean[] = writes.map(() => false);
    const layers = layered(writes);
    const holding = moves.size > 0 || held.length > 0;
    if (holding && layers.length === 0) layers.push([]);
    for (const [n, layer] of layers.entries()) {
      const guarded = n === 0 && moves.size > 0;
      if (layer.length === 0 && !(n === 0 && holding)) continue;
      const statement = new Statement();
      if (guarded) positionCtes(statement, [...moves.values()]);
      if (n === 0) heldCtes(statement, [...moves.values()], held, guarded);
      writeCtes(statement, layer, guarded);
      const { rows } = await client.query<{ ok: boolean; written: number[] }>(
        statement.text(guarded ? '(SELECT ok FROM ok)' : 'true'), statement.values);
      if (!rows[0]!.ok) return null;
      for (const slot of rows[0]!.written) written[slot] = true;
    }

    for (const [slot] of lateNotifications.entries()) {
      if (written[slot]) outcome.notifications += 1;
      else outcome.repeatedNotifications += 1;
    }
    // The handlers, once every write of the batch is made: in order, in the transaction.
    for (const [n, change] of changes.entries()) {
      const slot = slotOf[n] ?? null;
      if (slot === null) {
        outcome.skipped += 1;
        continue;
      }
      outcome.applied += 1;
      const wrote = slot < 0 ? true : written[slot]!;
      if ('kind' in change && change.operation === 'notified') {
        if (wrote) outcome.notifications += 1;
        else outcome.repeatedNotifications += 1;
        continue;
      }
      if (!wrote && !isMarker(change)) outcome.declined += 1;
      await callHandler(this.handlers, change, { client, written: wrote });
    }
    return outcome;
  }

  /**
   * Hands each notification recorded and not handed yet to the handler, one transaction each:
   * the row is locked, the handler called with the transaction's client, the row marked handed,
   * and the transaction committed. What the handler writes with that client commits with the
   * mark, exactly once; a throw rolls both back and the notification stays pending.
   */
  async handPending(): Promise<number> {
    await this.whenReady();
    let handed = 0;
    for (;;) {
      const client = await this.pool.connect();
      let broken: Error | undefined;
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
        await callNotificationHandler(this.handlers, record, client);
        await client.query('UPDATE relay_notifications SET handed_at = now() WHERE endpoint_id = $1 AND story_id = $2', [row.endpoint_id, row.story_id]);
        await client.query('COMMIT');
        handed += 1;
      } catch (error) {
        broken = error as Error;
        await client.query('ROLLBACK').catch(() => {});
        throw error;
      } finally {
        client.release(broken);
      }
    }
  }

  /** Ends the pool's connections (a second call does nothing). */
  close(): Promise<void> {
    this.closing ??= (async () => {
      await this.ready?.catch(() => {});
      await this.pool.end();
    })();
    return this.closing;
  }
}

function isMarker(change: Change): boolean {
  return !('kind' in change) && (change.operation === 'snapshot_begin' || change.operation === 'snapshot_end');
}
