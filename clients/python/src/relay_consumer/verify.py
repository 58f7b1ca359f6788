"""``verify``: a store compared with the relay's copy, read through its API.

Per endpoint (every endpoint of the token's tenant unless named), as clients/README.md says:

* feed items (``GET /v1/endpoints/{id}/copy``): subject, item_kind, sequence, item; tombstones
  excluded on both sides; ``generation`` is not compared. The relay moves a row to a later
  (generation, sequence) without sending a change when an event or a reload finds the item
  unchanged (``Decision::Unchanged``, services/rules/src/event.rs): a copy built from the
  stream keeps the earlier one. So a sequence differs only when the store's (generation,
  sequence) is not at or before the relay's; an item at an earlier read of the same content is
  equal, and counted in the line ("raised by the relay");
* stories (``GET /v1/endpoints/{id}/stories?include_closed=true``): id, ticker, version, closed,
  merged_into, story;
* notifications (``GET /v1/endpoints/{id}/notifications``, those the relay sent, ``notified``):
  story id, event id.

The store is read, never written: it must be at this library's schema version already.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import psycopg

from .postgres import PostgresStore
from .replay import RelayApi

#: How many differing keys a line names per kind.
SHOWN = 3


@dataclass(slots=True)
class Difference:
    """One kind of row (``items``, ``stories``, ``notifications``) of one endpoint."""

    kind: str
    missing: list[str] = field(default_factory=list)  # at the relay, not in the store
    extra: list[str] = field(default_factory=list)  # in the store, not at the relay
    different: list[tuple[str, str]] = field(default_factory=list)  # (key, fields that differ)

    def __bool__(self) -> bool:
        return bool(self.missing or self.extra or self.different)

    def describe(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing ({_keys(self.missing)})")
        if self.extra:
            parts.append(f"{len(self.extra)} extra ({_keys(self.extra)})")
        if self.different:
            shown = ", ".join(f"{k}: {what}" for k, what in self.different[:SHOWN])
            more = ", ..." if len(self.different) > SHOWN else ""
            parts.append(f"{len(self.different)} different ({shown}{more})")
        return f"{self.kind} " + "; ".join(parts)


def _keys(keys: list[str]) -> str:
    more = ", ..." if len(keys) > SHOWN else ""
    return ", ".join(keys[:SHOWN]) + more


@dataclass(slots=True)
class EndpointVerdict:
    endpoint_id: str
    items: int
    stories: int
    notifications: int
    differences: list[Difference]
    #: Items the relay's row holds at a later (generation, sequence) than the store's, with the
    #: same content: raised by the relay without a change (not a difference).
    raised: int = 0

    @property
    def equal(self) -> bool:
        return not self.differences

    def line(self) -> str:
        if self.equal:
            raised = f", {self.raised} raised by the relay" if self.raised else ""
            return (
                f"{self.endpoint_id} equal ({self.items} items{raised}, {self.stories} stories, "
                f"{self.notifications} notifications)"
            )
        return f"{self.endpoint_id} differs: " + " | ".join(d.describe() for d in self.differences)


async def pages(api: RelayApi, path: str, **query: str) -> list[dict[str, Any]]:
    """Every row of one of the API's paged lists (``data``, ``next_cursor`` passed as
    ``after``)."""
    rows: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params = dict(query, limit="500")
        if after is not None:
            params["after"] = after
        page = await api.get(f"{path}?{urllib.parse.urlencode(params)}")
        rows += page["data"]
        after = page.get("next_cursor")
        if not after:
            return rows


def _compare(
    kind: str,
    mine: dict[str, dict[str, Any]],
    relay: dict[str, dict[str, Any]],
) -> Difference:
    difference = Difference(kind)
    difference.missing = sorted(set(relay) - set(mine))
    difference.extra = sorted(set(mine) - set(relay))
    for key in sorted(set(mine) & set(relay)):
        fields = [name for name in relay[key] if mine[key].get(name) != relay[key][name]]
        if fields:
            difference.different.append((key, ", ".join(fields)))
    return difference


def _position(generation: Any, sequence: Any) -> tuple[int, bytes]:
    """A row's (generation, sequence), sequences compared as byte strings (COLLATE "C")."""
    return (
        int(generation) if generation is not None else -1,
        sequence.encode() if isinstance(sequence, str) else b"",
    )


def _raised(mine: dict[str, Any], relay: dict[str, Any]) -> bool:
    """The relay's row at a later (generation, sequence) than the store's, the same item:
    what the relay writes without a change when it finds an item unchanged."""
    return (
        mine["item"] == relay["item"]
        and mine["item_kind"] == relay["item_kind"]
        and _position(mine["generation"], mine["sequence"])
        < _position(relay["generation"], relay["sequence"])
    )


async def _store_rows(
    connection: psycopg.AsyncConnection[Any], sql: str, endpoint: str
) -> list[tuple[Any, ...]]:
    cur = await connection.execute(sql, (endpoint,))
    return list(await cur.fetchall())


async def verify_endpoint(
    api: RelayApi, connection: psycopg.AsyncConnection[Any], endpoint: str
) -> EndpointVerdict:
    base = f"/v1/endpoints/{urllib.parse.quote(endpoint, safe='')}"
    relay_rows = {
        row["subject"]: row
        for row in await pages(api, f"{base}/copy")
        if not row.get("tombstone")
    }
    relay_items = {
        subject: {
            "item_kind": row.get("item_kind"),
            "sequence": row.get("sequence"),
            "item": row.get("item"),
        }
        for subject, row in relay_rows.items()
    }
    my_items: dict[str, dict[str, Any]] = {}
    raised = 0
    for subject, kind, generation, sequence, item in await _store_rows(
        connection,
        "SELECT subject, item_kind, generation, sequence, item FROM relay_items "
        "WHERE endpoint_id = %s AND NOT tombstone",
        endpoint,
    ):
        my_items[subject] = {"item_kind": kind, "sequence": sequence, "item": item}
        row = relay_rows.get(subject)
        if row is not None and sequence != row.get("sequence") and _raised(
            {"item_kind": kind, "generation": generation, "sequence": sequence, "item": item},
            {"item_kind": row.get("item_kind"), "generation": row.get("generation"),
             "sequence": row.get("sequence"), "item": row.get("item")},
        ):
            # Equal: the relay raised its row without a change (see the module's docstring).
            my_items[subject]["sequence"] = row.get("sequence")
            raised += 1
    relay_stories = {
        row["id"]: {
            "ticker": row.get("ticker"),
            "version": row.get("version"),
            "closed": row.get("closed"),
            "merged_into": row.get("merged_into"),
            "story": row.get("story"),
        }
        for row in await pages(api, f"{base}/stories", include_closed="true")
    }
    my_stories = {
        story_id: {
            "ticker": ticker,
            "version": version,
            "closed": closed,
            "merged_into": merged_into,
            "story": story,
        }
        for story_id, ticker, version, closed, merged_into, story in await _store_rows(
            connection,
            "SELECT story_id, ticker, version, closed, merged_into, story FROM relay_stories "
            "WHERE endpoint_id = %s",
            endpoint,
        )
    }
    relay_notifications = {
        row["story_id"]: {"event_id": row.get("event_id")}
        for row in await pages(api, f"{base}/notifications")
        if row.get("notified", True)
    }
    my_notifications = {
        story_id: {"event_id": event_id}
        for story_id, event_id in await _store_rows(
            connection,
            "SELECT story_id, event_id FROM relay_notifications WHERE endpoint_id = %s",
            endpoint,
        )
    }
    differences = [
        d
        for d in (
            _compare("items", my_items, relay_items),
            _compare("stories", my_stories, relay_stories),
            _compare("notifications", my_notifications, relay_notifications),
        )
        if d
    ]
    return EndpointVerdict(
        endpoint, len(relay_items), len(relay_stories), len(relay_notifications), differences,
        raised,
    )


async def verify(
    store_dsn: str,
    api: RelayApi,
    endpoints: Sequence[str] = (),
    *,
    each: Callable[[EndpointVerdict], None] | None = None,
) -> list[EndpointVerdict]:
    """Compares the store at ``store_dsn`` with the relay's copies of ``endpoints`` (every
    endpoint of the tenant when empty); ``each`` is called with each endpoint's verdict as it
    is known. Raises :class:`~relay_consumer.PermanentError`, ``StoreError`` or
    ``ReplayError`` when it cannot compare."""
    store = PostgresStore(store_dsn, migrate=False)
    await store.connect()
    try:
        if not endpoints:
            endpoints = [str(row["id"]) for row in await pages(api, "/v1/endpoints")]
        verdicts = []
        for endpoint in endpoints:
            verdict = await verify_endpoint(api, store.connection, endpoint)
            verdicts.append(verdict)
            if each is not None:
                each(verdict)
        return verdicts
    finally:
        await store.close()


def as_json(verdicts: Sequence[EndpointVerdict]) -> str:
    return json.dumps(
        [
            {"endpoint_id": v.endpoint_id, "equal": v.equal, "line": v.line()}
            for v in verdicts
        ]
    )
