"""The Postgres store: the copy, the positions, the held changes and the notifications in the
user's database, changed together in one transaction per batch of deliveries.

The store schema is version 1 of clients/README.md, the same for the TypeScript library (a copy
written by one is read by the other): ``relay_consumer_schema`` records each version applied,
and a store is opened under ``pg_advisory_xact_lock(7261207)``, migrating what is missing in
that transaction (migration 1 brings either library's tables from before versioning to the
layout). Tables:

``relay_positions``
    per endpoint: the epoch followed, the last change_seq applied, whether a snapshot is open.
``relay_items``
    a feed endpoint's copy: one row per subject with the item, its generation and sequence, and
    the stream position (epoch, change_seq) of the change that wrote it; a removed item stays as
    a tombstone (``tombstone`` true, ``item`` null).
``relay_stories``
    a stories endpoint's copy: one row per story, open (with its snapshot) or closed (for good,
    with ``merged_into``), and the position that wrote it.
``relay_notifications``
    one row per (endpoint, story) notified, recorded in the transaction of the change, with
    ``handed_at`` set once handed to the user's code; ``repeats`` counts notified changes of the
    same story (none from a correct relay).
``relay_held``
    changes that came ahead of their predecessors, kept until those come (so they may be
    acknowledged).

Every write is one statement that decides in itself:

* the position moves only from the position the step started at (``UPDATE ... WHERE epoch = ..
  AND last_change_seq = ..``, once per endpoint and batch, from its first step's start to its
  last step's end; no row updated rolls the transaction back): a repeat, a stale change or a
  second consumer can never apply a change twice;
* an item is written only by a change later in the stream than the one that wrote the row;
* a story is saved only when newer than the row and the row is not closed (the relay's own
  ``where not closed and version < excluded.version``), closed for good at the greatest version
  known, and dropped only while open;
* a notification is recorded with ``insert ... on conflict do update set repeats = repeats + 1``
  returning whether it was new;
* a notification of an older epoch than the endpoint's (``late``: delivered after the new
  epoch's first change, or held and dropped by the switch) is recorded with ``insert ... on
  conflict do nothing``, returning whether it was new, and moves no position.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Final, Sequence

import psycopg
from psycopg.types.json import Jsonb

from ._version import __version__
from .errors import PermanentError, pg_cause
from .follower import Position, Step
from .messages import Change, FeedChange, MessageRefused, StoryChange, decode
from .store import Loaded, Notification, PositionConflict, StoreError

#: The store schema's version this library writes (clients/README.md, "The store schema").
SCHEMA_VERSION: Final = 1
#: What ``relay_consumer_schema.library`` records for a migration this library applied.
LIBRARY: Final = f"relay-consumer-python {__version__}"
#: The advisory lock both libraries take while they open a store.
ADVISORY_LOCK: Final = 7_261_207

SCHEMA_TABLE = """
CREATE TABLE IF NOT EXISTS relay_consumer_schema (
    version    integer PRIMARY KEY,
    library    text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""

#: Migration 1: from nothing, or from either library's tables before versioning, to the
#: layout of version 1 (clients/README.md gives it; both libraries run the same statements).
MIGRATION_1 = """
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
"""

#: Every migration, in order: version N is ``MIGRATIONS[N - 1]``.
MIGRATIONS: Final[tuple[str, ...]] = (MIGRATION_1,)

_MOVE = """
UPDATE relay_positions
SET epoch = %(epoch)s, last_change_seq = %(last)s, updated_at = now()
WHERE endpoint_id = %(endpoint)s AND epoch = %(before_epoch)s
  AND last_change_seq = %(before_last)s
"""
_FIRST = """
INSERT INTO relay_positions (endpoint_id, tenant_id, epoch, last_change_seq)
VALUES (%(endpoint)s, %(tenant)s, %(epoch)s, %(last)s)
ON CONFLICT (endpoint_id) DO NOTHING
"""
_FORGET_OLDER_HELD = "DELETE FROM relay_held WHERE endpoint_id = %s AND epoch < %s"
_RELEASE_HELD = (
    "DELETE FROM relay_held WHERE endpoint_id = %s AND epoch = %s AND change_seq <= %s"
)
_HOLD = """
INSERT INTO relay_held (endpoint_id, epoch, change_seq, body) VALUES (%s, %s, %s, %s)
ON CONFLICT DO NOTHING
"""
_UPSERT = """
INSERT INTO relay_items AS held (endpoint_id, subject, item_kind, generation, sequence,
                                 tombstone, item, epoch, change_seq, changed_at)
VALUES (%s, %s, %s, %s, %s, false, %s, %s, %s, %s)
ON CONFLICT (endpoint_id, subject) DO UPDATE
SET item_kind = excluded.item_kind, generation = excluded.generation,
    sequence = excluded.sequence, tombstone = false, item = excluded.item,
    epoch = excluded.epoch, change_seq = excluded.change_seq, changed_at = excluded.changed_at
WHERE (held.epoch, held.change_seq) < (excluded.epoch, excluded.change_seq)
"""
#: A removal leaves a tombstone (``tombstone`` true, ``item`` null), as the relay's copy does.
_REMOVE = """
INSERT INTO relay_items AS held (endpoint_id, subject, item_kind, generation, sequence,
                                 tombstone, item, epoch, change_seq, changed_at)
VALUES (%s, %s, %s, %s, %s, true, NULL, %s, %s, %s)
ON CONFLICT (endpoint_id, subject) DO UPDATE
SET item_kind = coalesce(excluded.item_kind, held.item_kind), generation = excluded.generation,
    sequence = excluded.sequence, tombstone = true, item = NULL, epoch = excluded.epoch,
    change_seq = excluded.change_seq, changed_at = excluded.changed_at
WHERE (held.epoch, held.change_seq) < (excluded.epoch, excluded.change_seq)
"""
_FORGET_ITEMS = "DELETE FROM relay_items WHERE endpoint_id = %s AND (epoch, change_seq) < (%s, %s)"
_FORGET_STORIES = (
    "DELETE FROM relay_stories WHERE endpoint_id = %s AND (epoch, change_seq) < (%s, %s)"
)
_SNAPSHOT_OPEN = "UPDATE relay_positions SET snapshot_open = %s WHERE endpoint_id = %s"
_SAVE = """
INSERT INTO relay_stories AS s (endpoint_id, story_id, ticker, version, closed, story,
                                merged_into, epoch, change_seq, changed_at)
VALUES (%s, %s, %s, %s, false, %s, NULL, %s, %s, %s)
ON CONFLICT (endpoint_id, story_id) DO UPDATE
SET ticker = excluded.ticker, version = excluded.version, story = excluded.story,
    epoch = excluded.epoch, change_seq = excluded.change_seq, changed_at = excluded.changed_at
WHERE NOT s.closed AND s.version < excluded.version
"""
_CLOSE = """
INSERT INTO relay_stories AS s (endpoint_id, story_id, ticker, version, closed, story,
                                merged_into, epoch, change_seq, changed_at)
VALUES (%s, %s, %s, %s, true, NULL, %s, %s, %s, %s)
ON CONFLICT (endpoint_id, story_id) DO UPDATE
SET ticker = excluded.ticker, version = greatest(s.version, excluded.version), closed = true,
    story = NULL, merged_into = excluded.merged_into, epoch = excluded.epoch,
    change_seq = excluded.change_seq, changed_at = excluded.changed_at
WHERE NOT (s.closed AND s.version >= excluded.version)
"""
_DROP = "DELETE FROM relay_stories WHERE endpoint_id = %s AND story_id = %s AND NOT closed"
_NOTIFY = """
INSERT INTO relay_notifications AS n (endpoint_id, story_id, ticker, version, event_id, story,
                                      epoch, change_seq, changed_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (endpoint_id, story_id) DO UPDATE SET repeats = n.repeats + 1
RETURNING (xmax = 0) AS recorded
"""
#: A notification of an older epoch than the endpoint's: recorded once per story, no position
#: moved, nothing counted when the story is recorded already.
_LATE_NOTIFY = """
INSERT INTO relay_notifications (endpoint_id, story_id, ticker, version, event_id, story, epoch,
                                 change_seq, changed_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (endpoint_id, story_id) DO NOTHING
RETURNING true
"""
_UNHANDED = """
SELECT endpoint_id::text, story_id, ticker, version, event_id, story, epoch, change_seq,
       changed_at
FROM relay_notifications WHERE handed_at IS NULL ORDER BY recorded_at, endpoint_id, change_seq
"""
_MARK = """
UPDATE relay_notifications SET handed_at = now()
WHERE endpoint_id = %s AND story_id = %s AND handed_at IS NULL
"""

#: A callback run inside the commit's transaction for each notification newly recorded: what it
#: writes through the connection commits with the copy and the position, exactly once.
InTransaction = Callable[[psycopg.AsyncConnection[Any], Notification], Awaitable[None]]


class PostgresStore:
    """The copy and the consumer's state in Postgres.

    ``PostgresStore(dsn)`` connects when the consumer first needs it (inside ``run()``, so a
    database that does not exist or refuses the credentials ends ``run()`` with
    :class:`~relay_consumer.PermanentError`, and one that is down is waited for);
    ``await PostgresStore.open(dsn)`` connects at once (raising the same errors there). Either
    way it connects again after the connection is lost, and every connection opens the schema
    first: under ``pg_advisory_xact_lock(7261207)``, ``relay_consumer_schema`` created when
    missing, the missing migrations applied (``migrate=False``: none applied, a store not at
    this library's version refused), a newer schema refused (``schema_newer``).

    ``connection`` is the connection in use (for your own statements); ``close()`` closes it
    (idempotent: the consumer closes its store when it stops).
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        connection: psycopg.AsyncConnection[Any] | None = None,
        migrate: bool = True,
        on_notification_in_transaction: InTransaction | None = None,
        connect_timeout_s: int = 10,
    ) -> None:
        if dsn is None and connection is None:
            raise ValueError("PostgresStore needs a dsn or a connection")
        self.dsn = dsn
        self.migrate = migrate
        self.on_notification_in_transaction = on_notification_in_transaction
        self.connect_timeout_s = connect_timeout_s
        self._connection = connection
        self._schema_open = False
        #: The schema version found when the store was last opened (before any migration).
        self.found_version: int | None = None

    @classmethod
    async def open(
        cls,
        dsn: str,
        *,
        migrate: bool = True,
        on_notification_in_transaction: InTransaction | None = None,
    ) -> PostgresStore:
        """Connects now and opens the schema (migrating it unless ``migrate=False``)."""
        store = cls(
            dsn, migrate=migrate, on_notification_in_transaction=on_notification_in_transaction
        )
        await store.connect()
        return store

    @property
    def connection(self) -> psycopg.AsyncConnection[Any]:
        if self._connection is None:
            raise StoreError("the store is not connected yet")
        return self._connection

    @property
    def connected(self) -> bool:
        c = self._connection
        return c is not None and not c.closed and not c.broken

    async def connect(self) -> None:
        """Connects, unless connected already; again when the connection was lost. Raises
        :class:`~relay_consumer.PermanentError` for a database that does not exist, refused
        credentials or a newer schema, :class:`StoreError` for the rest (a database down)."""
        if self.connected:
            if not self._schema_open:
                await self._open_schema()
            return
        if self.dsn is None:
            raise StoreError("the store's connection is lost, and it has no dsn to connect again")
        if self._connection is not None:
            try:
                await self._connection.close()
            except psycopg.Error:
                pass
        self._connection = None
        self._schema_open = False
        try:
            self._connection = await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, connect_timeout=self.connect_timeout_s
            )
        except psycopg.Error as error:
            kind = pg_cause(error)
            if kind is not None:
                raise PermanentError(kind, f"the store's database: {error}") from error
            raise StoreError(f"connecting to the store failed: {error}") from error
        await self._open_schema()

    async def _open_schema(self) -> None:
        connection = self.connection
        try:
            if self.migrate:
                async with connection.transaction():
                    await connection.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK,))
                    await connection.execute(SCHEMA_TABLE)
                    found = await self._version(connection)
                    self._check_not_newer(found)
                    for version in range(found + 1, SCHEMA_VERSION + 1):
                        await connection.execute(MIGRATIONS[version - 1])
                        await connection.execute(
                            "INSERT INTO relay_consumer_schema (version, library) VALUES (%s, %s)",
                            (version, LIBRARY),
                        )
            else:
                cur = await connection.execute(
                    "SELECT to_regclass('relay_consumer_schema') IS NOT NULL"
                )
                row = await cur.fetchone()
                found = await self._version(connection) if row and row[0] else 0
                self._check_not_newer(found)
                if found < SCHEMA_VERSION:
                    raise StoreError(
                        f"the store is at schema version {found}, this library reads "
                        f"{SCHEMA_VERSION}: open it once with migrate=True (a consumer does)"
                    )
        except psycopg.Error as error:
            kind = pg_cause(error)
            if kind is not None:
                raise PermanentError(kind, f"the store's database: {error}") from error
            raise StoreError(f"opening the store's schema failed: {error}") from error
        self.found_version = found
        self._schema_open = True

    @staticmethod
    async def _version(connection: psycopg.AsyncConnection[Any]) -> int:
        cur = await connection.execute("SELECT coalesce(max(version), 0) FROM relay_consumer_schema")
        row = await cur.fetchone()
        return int(row[0]) if row else 0

    @staticmethod
    def _check_not_newer(found: int) -> None:
        if found > SCHEMA_VERSION:
            raise PermanentError(
                "schema_newer",
                f"the store's schema is at version {found}, newer than this library's "
                f"{SCHEMA_VERSION} (relay-consumer-python {__version__}): upgrade the library",
            )

    async def close(self) -> None:
        """Closes the connection (a no-op when closed already)."""
        connection, self._connection = self._connection, None
        self._schema_open = False
        if connection is not None and not connection.closed:
            try:
                await connection.close()
            except psycopg.Error:
                pass

    async def __aenter__(self) -> PostgresStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def load(self) -> Loaded:
        await self.connect()
        try:
            async with self.connection.cursor() as cur:
                await cur.execute(
                    "SELECT endpoint_id::text, epoch, last_change_seq FROM relay_positions"
                )
                positions = {
                    e: Position(epoch, last) for e, epoch, last in await cur.fetchall()
                }
                await cur.execute(
                    "SELECT body FROM relay_held ORDER BY endpoint_id, epoch, change_seq"
                )
                rows = await cur.fetchall()
        except psycopg.Error as error:
            raise StoreError(f"reading the positions failed: {error}") from error
        held: list[Change] = []
        for (body,) in rows:
            try:
                held.append(decode(body))
            except MessageRefused as error:  # written by a library of version 1: cannot happen
                raise StoreError(f"a held change no longer decodes: {error}") from error
        return Loaded(positions, held)

    async def commit(
        self, steps: Sequence[Step], late: Sequence[StoryChange] = ()
    ) -> list[Notification]:
        recorded: list[Notification] = []
        try:
            async with self.connection.transaction():
                async with self.connection.cursor() as cur:
                    await self._move(cur, steps)
                    # The writes need no answer (but a notification's, fetched at once): sent
                    # in pipeline mode, without a round trip each.
                    async with self.connection.pipeline():
                        for change in late:
                            await self._late(cur, change, recorded)
                        for step in steps:
                            await self._step(cur, step, recorded)
                    if self.on_notification_in_transaction is not None:
                        for notification in recorded:
                            await self.on_notification_in_transaction(
                                self.connection, notification
                            )
        except psycopg.Error as error:
            raise StoreError(f"the commit failed: {error}") from error
        return recorded

    async def _move(self, cur: psycopg.AsyncCursor[Any], steps: Sequence[Step]) -> None:
        """Each endpoint's position, once per batch: from where its first step starts to where
        its last ends, only from that start (its steps follow on from each other)."""
        spans: dict[str, tuple[Position, Position]] = {}
        tenants: dict[str, str] = {}
        for step in steps:
            for change in (*step.applied, *((step.held,) if step.held is not None else ())):
                tenants.setdefault(step.endpoint_id, change.tenant_id)
            span = spans.get(step.endpoint_id)
            if span is not None and span[1] != step.before:
                raise PositionConflict(
                    f"endpoint {step.endpoint_id}: a step from {step.before} after one to "
                    f"{span[1]}"
                )
            spans[step.endpoint_id] = (step.before if span is None else span[0], step.after)
        for endpoint, (before, after) in spans.items():
            args = {
                "endpoint": endpoint,
                "tenant": tenants.get(endpoint),
                "epoch": after.epoch,
                "last": after.last_change_seq,
                "before_epoch": before.epoch,
                "before_last": before.last_change_seq,
            }
            if before == Position():
                await cur.execute(_FIRST, args)
                if cur.rowcount != 1:
                    raise PositionConflict(f"endpoint {endpoint} has a position already")
            else:
                await cur.execute(_MOVE, args)
                if cur.rowcount != 1:
                    raise PositionConflict(f"endpoint {endpoint} is no longer at {before}")

    async def _step(
        self, cur: psycopg.AsyncCursor[Any], step: Step, recorded: list[Notification]
    ) -> None:
        if step.new_epoch:
            await cur.execute(_FORGET_OLDER_HELD, (step.endpoint_id, step.after.epoch))
        for change in step.applied:
            if isinstance(change, FeedChange):
                await self._feed(cur, change)
            else:
                await self._story(cur, change, recorded)
        # Held changes are of the endpoint's epoch, past its last change_seq: only those the
        # step released (applied after the one received) can be at or before its new position.
        if len(step.applied) > 1:
            await cur.execute(
                _RELEASE_HELD,
                (step.endpoint_id, step.after.epoch, step.after.last_change_seq),
            )
        if step.held is not None:
            await cur.execute(
                _HOLD,
                (
                    step.endpoint_id,
                    step.held.epoch,
                    step.held.change_seq,
                    Jsonb(dict(step.held.body)),
                ),
            )

    async def _feed(self, cur: psycopg.AsyncCursor[Any], c: FeedChange) -> None:
        e, at = c.endpoint_id, (c.epoch, c.change_seq)
        if c.operation == "upsert":
            await cur.execute(
                _UPSERT,
                (
                    e,
                    c.subject,
                    c.item_kind,
                    c.generation,
                    c.sequence,
                    Jsonb(c.item),
                    c.epoch,
                    c.change_seq,
                    c.changed_at,
                ),
            )
        elif c.operation == "remove":
            await cur.execute(
                _REMOVE,
                (
                    e,
                    c.subject,
                    c.item_kind,
                    c.generation,
                    c.sequence,
                    c.epoch,
                    c.change_seq,
                    c.changed_at,
                ),
            )
        elif c.operation == "snapshot_begin":
            await cur.execute(_FORGET_ITEMS, (e, *at))
            await cur.execute(_FORGET_STORIES, (e, *at))
            await cur.execute(_SNAPSHOT_OPEN, (True, e))
        else:
            await cur.execute(_SNAPSHOT_OPEN, (False, e))

    async def _story(
        self, cur: psycopg.AsyncCursor[Any], c: StoryChange, recorded: list[Notification]
    ) -> None:
        e = c.endpoint_id
        if c.operation == "saved":
            await cur.execute(
                _SAVE,
                (
                    e,
                    c.story_id,
                    c.ticker,
                    c.version,
                    Jsonb(c.story),
                    c.epoch,
                    c.change_seq,
                    c.changed_at,
                ),
            )
        elif c.operation == "closed":
            await cur.execute(
                _CLOSE,
                (
                    e,
                    c.story_id,
                    c.ticker,
                    c.version,
                    c.merged_into,
                    c.epoch,
                    c.change_seq,
                    c.changed_at,
                ),
            )
        elif c.operation == "dropped":
            await cur.execute(_DROP, (e, c.story_id))
        else:
            await cur.execute(_NOTIFY, _notification_row(c))
            row = await cur.fetchone()
            if row is not None and row[0]:
                recorded.append(Notification.of(c))

    async def _late(
        self, cur: psycopg.AsyncCursor[Any], c: StoryChange, recorded: list[Notification]
    ) -> None:
        if c.operation != "notified":
            return
        await cur.execute(_LATE_NOTIFY, _notification_row(c))
        if await cur.fetchone() is not None:
            recorded.append(Notification.of(c))

    async def unhanded(self) -> list[Notification]:
        try:
            async with self.connection.cursor() as cur:
                await cur.execute(_UNHANDED)
                rows = await cur.fetchall()
        except psycopg.Error as error:
            raise StoreError(f"reading the notifications not handed failed: {error}") from error
        return [
            Notification(
                endpoint_id=e,
                story_id=s,
                ticker=t,
                version=v,
                event_id=ev,
                story=st,
                epoch=ep,
                change_seq=cs,
                changed_at=at.isoformat().replace("+00:00", "Z"),
            )
            for e, s, t, v, ev, st, ep, cs, at in rows
        ]

    async def mark_handed(self, notifications: Sequence[Notification]) -> None:
        if not notifications:
            return
        try:
            async with self.connection.transaction():
                async with self.connection.cursor() as cur:
                    await cur.executemany(
                        _MARK, [(n.endpoint_id, n.story_id) for n in notifications]
                    )
        except psycopg.Error as error:
            raise StoreError(f"marking notifications handed failed: {error}") from error


def _notification_row(c: StoryChange) -> tuple[Any, ...]:
    """A `notified` change's parameters, as `_NOTIFY` and `_LATE_NOTIFY` take them."""
    return (
        c.endpoint_id,
        c.story_id,
        c.ticker,
        c.version,
        c.event_id,
        Jsonb(c.story),
        c.epoch,
        c.change_seq,
        c.changed_at,
    )
