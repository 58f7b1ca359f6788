"""Rebuilds a tenant's copies in Postgres from new epochs: after the relay's operator restored
the relay's database, or from scratch (a resync of every endpoint), printing each endpoint's
rebuild as it goes; then keeps the copies up to date like ``examples/postgres.py``.

    RELAY_AMQP_URL='amqp://<username>:<password>@<host>:<port>/<vhost>' \
    RELAY_QUEUE=relay.tenant.<tenant id> RELAY_STORE_DSN=postgresql://... \
    RELAY_API_URL=http://<relay api> RELAY_API_TOKEN=<tenant token> \
    python examples/rebuild.py [--from-scratch]

RELAY_AMQP_URL is the ``amqp_url`` that ``POST /v1/broker/credentials`` answered, with its
``password`` put after the username. RELAY_API_URL and RELAY_API_TOKEN (a token of the tenant) are
needed with ``--from-scratch``; whenever they are set, a gap that does not fill in time is also
asked for again with ``POST /v1/endpoints/<id>/replay``.

Every resync and every restore begins a new epoch of each endpoint's change stream, whose first
changes are a snapshot of the relay's copy: ``snapshot_begin``, one row per item (or story, open
or closed), ``snapshot_end``; the live changes follow. The library applies it by forgetting the
endpoint's copy at ``snapshot_begin``, so the snapshot rebuilds it. This consumer prints, per
endpoint::

    endpoint <id>: epoch <N> begins, rebuilding from its snapshot
    endpoint <id>: rebuilt, <K> items / <S> stories (epoch <N>, a snapshot of <R> rows)

(printed once the batch that applied the marker is committed; the counts are the store's rows
of the endpoint at that commit).

- **From scratch** (``--from-scratch``, or RELAY_FROM_SCRATCH=1): your copy is lost, damaged or
  new. It lists the tenant's endpoints (``GET /v1/endpoints``), empties the store's copy tables
  (relay_positions, relay_items, relay_stories, relay_held; or name a new database, made with
  ``createdb``) and asks ``POST /v1/endpoints/<id>/resync`` of each (a 409 means the endpoint's
  last snapshot is still being sent: it asks again after a pause). relay_notifications is kept:
  a resync does not send again the notifications already published, and one that comes again
  (the relay carries those not yet recorded as published into the new epoch) is recorded once
  and not handed twice. Stop every other consumer of the queue and of the database first.
- **After a restore** (the relay's operator restored its database and ran ``relay restored``):
  nothing to do. The restored relay begins the new epochs itself, and this consumer (or
  ``examples/postgres.py``, which applies them the same way without printing) rebuilds each copy
  from them, whatever it held before. No resync is needed.

Ctrl-C (or SIGTERM) stops it; started again (without ``--from-scratch``), it carries on from the
positions kept.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import urllib.parse
from typing import Any, Sequence

import psycopg

from relay_consumer import (
    Consumer,
    FeedChange,
    Gap,
    Loaded,
    Notification,
    RelayApi,
    ReplayError,
    ResyncAnswer,
    Step,
    StoryChange,
)
from relay_consumer.postgres import PostgresStore

#: How long to keep asking for a resync while the endpoint's last snapshot is being sent (409).
RESYNC_PATIENCE_S = 120.0


class Reporting:
    """A :class:`~relay_consumer.Store` around a :class:`PostgresStore` that prints each
    endpoint's snapshot as it is applied: the Postgres store does the work, this one only
    looks at what each commit applied."""

    def __init__(self, store: PostgresStore, waiting: dict[str, int] | None = None) -> None:
        self.store = store
        #: Endpoints resynced by this run, with the epoch asked for: to say when all are rebuilt.
        self.waiting = dict(waiting or {})

    async def load(self) -> Loaded:
        return await self.store.load()

    async def commit(
        self, steps: Sequence[Step], late: Sequence[StoryChange] = ()
    ) -> list[Notification]:
        recorded = await self.store.commit(steps, late)
        # Committed: the copy holds what the lines below say.
        for step in steps:
            for change in step.applied:
                if isinstance(change, FeedChange) and change.operation == "snapshot_begin":
                    print(
                        f"endpoint {change.endpoint_id}: epoch {change.epoch} begins, "
                        "rebuilding from its snapshot",
                        flush=True,
                    )
                elif isinstance(change, FeedChange) and change.operation == "snapshot_end":
                    await self._rebuilt(change)
        return recorded

    async def _rebuilt(self, end: FeedChange) -> None:
        # change 1 is snapshot_begin, so snapshot_end's change_seq is the snapshot's rows + 2.
        rows = end.change_seq - 2
        try:
            cur = await self.store.connection.execute(
                "SELECT (SELECT count(*) FROM relay_items WHERE endpoint_id = %(e)s AND NOT tombstone), "
                "(SELECT count(*) FROM relay_stories WHERE endpoint_id = %(e)s)",
                {"e": end.endpoint_id},
            )
            counted = await cur.fetchone()
        except psycopg.Error as error:  # only the count is lost: the copy is committed
            print(f"endpoint {end.endpoint_id}: rebuilt (epoch {end.epoch}, a snapshot of "
                  f"{rows} rows; the store could not be counted: {error})", flush=True)
            counted = None
        if counted is not None:
            items, stories = counted
            print(
                f"endpoint {end.endpoint_id}: rebuilt, {items} items / {stories} stories "
                f"(epoch {end.epoch}, a snapshot of {rows} rows)",
                flush=True,
            )
        asked = self.waiting.get(end.endpoint_id)
        if asked is not None and end.epoch >= asked:
            del self.waiting[end.endpoint_id]
            if not self.waiting:
                print("every endpoint resynced is rebuilt; following the live changes",
                      flush=True)

    async def unhanded(self) -> list[Notification]:
        return await self.store.unhanded()

    async def mark_handed(self, notifications: Sequence[Notification]) -> None:
        await self.store.mark_handed(notifications)

    async def close(self) -> None:
        await self.store.close()


async def endpoints(api: RelayApi) -> list[dict[str, Any]]:
    """Every endpoint of the tenant: ``GET /v1/endpoints``, page by page (``next_cursor``)."""
    found: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        query = {"limit": "500"} if after is None else {"limit": "500", "after": after}
        page = await api.get(f"/v1/endpoints?{urllib.parse.urlencode(query)}")
        found += page["data"]
        after = page.get("next_cursor")
        if not after:
            return found


async def resync(api: RelayApi, endpoint_id: str) -> ResyncAnswer:
    """``POST /v1/endpoints/{id}/resync``, asked again while the endpoint's last snapshot (of a
    resync or a restore) is still being sent (409)."""
    deadline = asyncio.get_running_loop().time() + RESYNC_PATIENCE_S
    while True:
        try:
            return await api.resync(endpoint_id)
        except ReplayError as error:
            if error.status != 409 or asyncio.get_running_loop().time() > deadline:
                raise
            print(f"endpoint {endpoint_id}: its last snapshot is still being sent; "
                  "asking again in 1 s", flush=True)
            await asyncio.sleep(1.0)


async def from_scratch(store: PostgresStore, api: RelayApi) -> dict[str, int]:
    """Empties the copy and asks for a resync of every endpoint: the epochs asked for."""
    listed = await endpoints(api)
    async with store.connection.transaction():
        await store.connection.execute(
            "TRUNCATE relay_positions, relay_items, relay_stories, relay_held"
        )
    print(f"store emptied; resyncing the tenant's {len(listed)} endpoints", flush=True)
    asked: dict[str, int] = {}
    for endpoint in listed:
        answer = await resync(api, str(endpoint["id"]))
        asked[answer.endpoint_id] = answer.epoch
        print(
            f"endpoint {answer.endpoint_id} ({endpoint.get('source')}): resync asked, epoch "
            f"{answer.epoch}, a snapshot of {answer.snapshot_items} rows",
            flush=True,
        )
    return asked


def handed(n: Notification) -> None:
    """After the commit: at least once (again after a crash before it was marked handed)."""
    print(f"NOTIFY {n.ticker} {n.story_id} (key {n.key})", flush=True)


def gap(waiting: Gap) -> None:
    print(f"waiting on {waiting.endpoint_id}: change_seqs {waiting.missing} ({waiting.held} held)",
          flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser(
        description="Rebuilds a tenant's copies in Postgres from new epochs (resync, restore)."
    )
    parser.add_argument(
        "--from-scratch",
        action="store_true",
        default=os.environ.get("RELAY_FROM_SCRATCH", "") not in ("", "0"),
        help="empty the store's copy and resync every endpoint of the tenant first",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    amqp_url = os.environ["RELAY_AMQP_URL"]
    queue = os.environ["RELAY_QUEUE"]
    database = os.environ["RELAY_STORE_DSN"]
    api = None
    if os.environ.get("RELAY_API_URL") and os.environ.get("RELAY_API_TOKEN"):
        api = RelayApi(os.environ["RELAY_API_URL"], os.environ["RELAY_API_TOKEN"])
    elif args.from_scratch:
        parser.error("--from-scratch asks the relay for resyncs: set RELAY_API_URL and RELAY_API_TOKEN")
    async with await PostgresStore.open(database) as store:
        asked: dict[str, int] = {}
        if args.from_scratch:
            assert api is not None
            asked = await from_scratch(store, api)
        consumer = Consumer(
            amqp_url,
            queue,
            Reporting(store, asked),
            on_notification=handed,
            on_gap=gap,
            api=api,
        )
        for stop in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(stop, consumer.stop)
        await consumer.run()


if __name__ == "__main__":
    asyncio.run(main())
