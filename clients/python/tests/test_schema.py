"""The store schema, version 1 (clients/README.md, "The store schema"): a fresh store, and the
tables of either library from before versioning (Python 0.1.0's, TypeScript's before 1.0.0)
brought to the same layout by migration 1, their rows kept; the version recorded once, a newer
schema refused, opening concurrently safe."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from builders import FEED, STORIES, TENANT
from relay_consumer import PermanentError, StoreError
from relay_consumer.postgres import LIBRARY, PostgresStore

#: relay-consumer (Python) 0.1.0's tables, as it made them.
PYTHON_0_1 = """
CREATE TABLE IF NOT EXISTS relay_positions (
    endpoint_id uuid PRIMARY KEY,
    epoch bigint NOT NULL,
    last_change_seq bigint NOT NULL,
    snapshot_open boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS relay_items (
    endpoint_id uuid NOT NULL,
    subject text NOT NULL,
    item_kind text,
    generation bigint NOT NULL,
    sequence text,
    item jsonb NOT NULL,
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
    story jsonb,
    merged_into text,
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
    repeats integer NOT NULL DEFAULT 0,
    PRIMARY KEY (endpoint_id, story_id)
);
CREATE INDEX IF NOT EXISTS relay_notifications_unhanded
    ON relay_notifications (recorded_at) WHERE handed_at IS NULL;
CREATE TABLE IF NOT EXISTS relay_held (
    endpoint_id uuid NOT NULL,
    epoch bigint NOT NULL,
    change_seq bigint NOT NULL,
    body jsonb NOT NULL,
    held_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (endpoint_id, epoch, change_seq)
);
"""

#: @relay/consumer (TypeScript)'s tables before 1.0.0, as it made them.
TYPESCRIPT_0 = """
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
"""

TABLES = ("relay_positions", "relay_items", "relay_stories", "relay_notifications", "relay_held")


def layout(dsn: str) -> dict[str, Any]:
    """Each table's columns (type, nullability, collation) and indexes, whatever their order."""
    with psycopg.connect(dsn) as conn:
        columns = conn.execute(
            "SELECT table_name, column_name, data_type, is_nullable, collation_name "
            "FROM information_schema.columns WHERE table_schema = 'public' "
            "AND table_name LIKE 'relay\\_%%'"
        ).fetchall()
        # By definition, not name: a table renamed keeps its primary key's index name
        # (TypeScript's relay_feed_items_pkey on relay_items after migration 1, which both
        # libraries run as it is written).
        indexes = conn.execute(
            "SELECT tablename, regexp_replace(indexdef, 'INDEX \\S+ ON public\\.', 'INDEX ON ') "
            "FROM pg_indexes WHERE schemaname = 'public' AND tablename LIKE 'relay\\_%%' "
            "AND indexname NOT LIKE '%%\\_pkey'"
        ).fetchall()
        keys = conn.execute(
            "SELECT conrelid::regclass::text, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE contype = 'p' AND conrelid::regclass::text LIKE 'relay\\_%%'"
        ).fetchall()
    return {"columns": sorted(columns), "indexes": sorted(indexes), "keys": sorted(keys)}


def versions(dsn: str) -> list[tuple[int, str]]:
    with psycopg.connect(dsn) as conn:
        return [(v, lib) for v, lib in conn.execute(
            "SELECT version, library FROM relay_consumer_schema ORDER BY version"
        ).fetchall()]


async def test_a_fresh_store_is_at_version_1_with_the_contracts_layout(pg_database: str) -> None:
    store = await PostgresStore.open(pg_database)
    await store.close()
    assert versions(pg_database) == [(1, LIBRARY)]
    assert LIBRARY == "relay-consumer-python 1.0.0"
    found = layout(pg_database)
    tables = {c[0] for c in found["columns"]}
    assert tables == {*TABLES, "relay_consumer_schema"}
    items = {c[1]: c[2:] for c in found["columns"] if c[0] == "relay_items"}
    assert items["tombstone"] == ("boolean", "NO", None)
    assert items["item"] == ("jsonb", "YES", None)
    assert items["sequence"] == ("text", "YES", "C")
    positions = {c[1]: c[2:] for c in found["columns"] if c[0] == "relay_positions"}
    assert positions["tenant_id"] == ("uuid", "YES", None)
    assert positions["snapshot_open"] == ("boolean", "NO", None)
    with psycopg.connect(pg_database) as conn:
        names = {r[0] for r in conn.execute("SELECT indexname FROM pg_indexes").fetchall()}
    assert "relay_notifications_unhanded" in names and "relay_notifications_pending" not in names
    # Opened again: nothing applied again.
    store = await PostgresStore.open(pg_database)
    assert store.found_version == 1
    await store.close()
    assert versions(pg_database) == [(1, LIBRARY)]


async def _migrated_layout_equals_fresh(pg_database: str, old: str, fresh_dsn: str) -> None:
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute(old)
    store = await PostgresStore.open(pg_database)
    assert store.found_version == 0
    await store.close()
    assert versions(pg_database) == [(1, LIBRARY)]
    fresh = await PostgresStore.open(fresh_dsn)
    await fresh.close()
    assert layout(pg_database) == layout(fresh_dsn)


async def test_python_0_1_tables_are_brought_to_version_1_with_their_rows(
    pg_database: str, second_database: str
) -> None:
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute(PYTHON_0_1)
        conn.execute(
            "INSERT INTO relay_positions (endpoint_id, epoch, last_change_seq) VALUES (%s, 1, 7)",
            (FEED,),
        )
        conn.execute(
            "INSERT INTO relay_items (endpoint_id, subject, item_kind, generation, sequence, item, "
            "epoch, change_seq, changed_at) VALUES (%s, 'announcement:1', 'announcement', 1, "
            "'0000000001.0000000007', '{\"a\": 1}', 1, 7, now())",
            (FEED,),
        )
        conn.execute(
            "INSERT INTO relay_notifications (endpoint_id, story_id, version, epoch, change_seq, "
            "changed_at, repeats) VALUES (%s, 'st_1', 1, 1, 3, now(), 2)",
            (STORIES,),
        )
    await _migrated_layout_equals_fresh(pg_database, "SELECT 1", second_database)
    with psycopg.connect(pg_database) as conn:
        assert conn.execute(
            "SELECT endpoint_id::text, tenant_id, epoch, last_change_seq, snapshot_open "
            "FROM relay_positions"
        ).fetchall() == [(FEED, None, 1, 7, False)]
        assert conn.execute(
            "SELECT subject, tombstone, item FROM relay_items"
        ).fetchall() == [("announcement:1", False, {"a": 1})]
        assert conn.execute(
            "SELECT story_id, repeats, handed_at FROM relay_notifications"
        ).fetchall() == [("st_1", 2, None)]


async def test_typescript_tables_before_1_0_are_brought_to_version_1_with_their_rows(
    pg_database: str, second_database: str
) -> None:
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute(TYPESCRIPT_0)
        conn.execute(
            "INSERT INTO relay_positions (endpoint_id, tenant_id, epoch, last_change_seq) "
            "VALUES (%s, %s, 2, 9)",
            (FEED, TENANT),
        )
        conn.execute(
            "INSERT INTO relay_feed_items (endpoint_id, subject, item_kind, generation, sequence, "
            "tombstone, item, epoch, change_seq, changed_at) VALUES "
            "(%s, 'announcement:1', 'announcement', 1, 's1', false, '{\"a\": 1}', 2, 8, now()), "
            "(%s, 'announcement:2', 'announcement', 1, 's2', true, NULL, 2, 9, now())",
            (FEED, FEED),
        )
        conn.execute(
            "INSERT INTO relay_notifications (endpoint_id, story_id, version, epoch, change_seq, "
            "changed_at, handed_at) VALUES (%s, 'st_1', 1, 1, 3, now(), now())",
            (STORIES,),
        )
    await _migrated_layout_equals_fresh(pg_database, "SELECT 1", second_database)
    with psycopg.connect(pg_database) as conn:
        assert conn.execute("SELECT to_regclass('relay_feed_items')").fetchone() == (None,)
        assert conn.execute(
            "SELECT endpoint_id::text, tenant_id::text, epoch, last_change_seq, snapshot_open "
            "FROM relay_positions"
        ).fetchall() == [(FEED, TENANT, 2, 9, False)]
        assert conn.execute(
            "SELECT subject, tombstone, item FROM relay_items ORDER BY subject"
        ).fetchall() == [("announcement:1", False, {"a": 1}), ("announcement:2", True, None)]
        assert conn.execute(
            "SELECT story_id, repeats, handed_at IS NOT NULL FROM relay_notifications"
        ).fetchall() == [("st_1", 0, True)]


async def test_a_newer_schema_is_refused_and_changed_in_nothing(pg_database: str) -> None:
    store = await PostgresStore.open(pg_database)
    await store.connection.execute(
        "INSERT INTO relay_consumer_schema (version, library) VALUES (2, 'a later library')"
    )
    await store.close()
    for migrate in (True, False):
        with pytest.raises(PermanentError) as raised:
            await PostgresStore.open(pg_database, migrate=migrate)
        assert raised.value.cause_kind == "schema_newer"
        assert "version 2" in str(raised.value)


async def test_without_migrate_an_unversioned_store_is_refused(pg_database: str) -> None:
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute(PYTHON_0_1)
    with pytest.raises(StoreError, match="schema version 0"):
        await PostgresStore.open(pg_database, migrate=False)
    assert versions_or_none(pg_database) is None


def versions_or_none(dsn: str) -> list[tuple[int, str]] | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT to_regclass('relay_consumer_schema')").fetchone()
    return None if row is None or row[0] is None else versions(dsn)


async def test_stores_opened_at_once_migrate_once(pg_database: str) -> None:
    stores = await asyncio.gather(*(PostgresStore.open(pg_database) for _ in range(6)))
    assert sorted(s.found_version or 0 for s in stores) == [0, 1, 1, 1, 1, 1]
    for store in stores:
        await store.close()
    assert versions(pg_database) == [(1, LIBRARY)]
