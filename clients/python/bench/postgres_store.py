"""Throughput of the Postgres store: messages per second a `Consumer` with a `PostgresStore`
drains from a queue filled beforehand with N change messages.

    python bench/postgres_store.py                    # 20,000 messages, defaults below
    python bench/postgres_store.py --messages 50000 --prefetch 512 --batch-max 512 --runs 3

What it does, each run:
1. builds N change messages as the relay writes them (checked against
   docs/change-message.v1.schema.json and docs/story-message.v1.schema.json): three feed
   endpoints and one stories endpoint of one tenant, interleaved; feed upserts of items shaped as
   the simulator renders them (about --item-bytes of JSON each) over a set of subjects, some
   removes; stories saved (snapshots of about 2 KB), closed (some merged), notified;
2. makes a vhost of its own through the management API (guest), a durable quorum queue
   `relay.tenant.<tenant>` in it as the relay declares it, and publishes the messages there
   (persistent, with publisher confirms, message_id `<endpoint>:<epoch>:<change_seq>`);
3. makes a fresh database, starts the consumer and times it from its start until the store has
   committed the last change of every endpoint (every message applied and acknowledged but the
   last batch's ack);
4. checks the store (positions, items, stories, notifications) against what the messages say,
   then drops the database and deletes the vhost (its queue with it).

Postgres at RELAY_CONSUMER_TEST_PG (default postgresql://postgres@127.0.0.1:5432/postgres),
RabbitMQ at 127.0.0.1:5672 with management at 15672 (guest/guest); see --help.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import pathlib
import random
import secrets
import statistics
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any, Sequence

import aio_pika
import psycopg

from relay_consumer import (
    Consumer,
    Loaded,
    Notification,
    Step,
    StoryChange,
    decode,
    message_id,
)
from relay_consumer.postgres import PostgresStore

DOCS = pathlib.Path(__file__).resolve().parents[3] / "docs"


# -- messages ------------------------------------------------------------------------------------


def _ts(rng: random.Random) -> str:
    return f"2026-11-{rng.randint(1, 28):02}T{rng.randint(0, 23):02}:{rng.randint(0, 59):02}:" \
        f"{rng.randint(0, 59):02}.{rng.randint(0, 999999):06}Z"


def feed_item(rng: random.Random, number: int, version: int, item_bytes: int) -> dict[str, Any]:
    """A feed item shaped as services/simulator/src/render.rs renders one, grown with story
    parts to about ``item_bytes`` of JSON."""
    item: dict[str, Any] = {
        "access": "full",
        "changes": [],
        "company": {
            "company_id": 1000 + number % 300,
            "listed_exchange": "Nasdaq Stockholm",
            "logo_url": None,
            "market_exchange_id": 12,
            "market_exchange_mic": "XSTO",
            "name": f"Company {number % 300} AB",
            "short_name": f"Company {number % 300}",
            "symbol": f"CO{number % 300} B",
        },
        "corrected_at": None,
        "feed_item_id": f"announcement:{number}",
        "first_seq": f"{number:012}",
        "flags": {"corrected": False},
        "head": {
            "announcement_id": number,
            "announcement_kind": "order",
            "edition_ids": [5000 + number % 1000],
            "first_flash_at": _ts(rng),
            "inside_information": True,
            "language": "sv",
            "received_at": _ts(rng),
            "report": None,
            "route": "press_release",
            "title": f"Company {number % 300} receives an order worth SEK {rng.randint(5, 900)}m",
        },
        "item_kind": "announcement",
        "lang": "en",
        "op": "new" if version == 1 else "changed",
        "parts": [],
        "published_at": _ts(rng),
    }
    part = 0
    size = len(json.dumps(item))
    while size < item_bytes:
        part += 1
        piece = {
                "corrected": False,
                "first_published_at": _ts(rng),
                "headline": f"Company {number % 300} wins a contract, part {part}, v{version}",
                "inside_information": True,
                "kicker": None,
                "kind": "story",
                "lang": "en",
                "lede_first_sentence": "Company %d: the details. " % number
                + "x" * rng.randint(80, 200),
                "part_id": f"story:{number * 10 + part}",
                "part_version": version,
                "reason": "new" if version == 1 else "update",
                "relevance": 4,
                "report": None,
                "story_id": number * 10 + part,
                "treatment": "full",
                "url": f"https://app.quanor.com/articles/story/{number * 10 + part}",
                "version": version,
                "version_published_at": _ts(rng),
            }
        item["parts"].append(piece)
        size += len(json.dumps(piece)) + 2
    return item


class Stream:
    """One endpoint's change stream (epoch 1), numbered as the relay numbers it."""

    def __init__(self, tenant: str, endpoint: str) -> None:
        self.tenant = tenant
        self.endpoint = endpoint
        self.seq = 0

    def next(self) -> int:
        self.seq += 1
        return self.seq


def build_messages(n: int, seed: int, item_bytes: int) -> tuple[str, list[dict[str, Any]]]:
    """A tenant id and ``n`` messages of three feed endpoints and one stories endpoint,
    interleaved: about 70% feed changes, 30% story changes."""
    rng = random.Random(seed)
    tenant = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    feeds = [Stream(tenant, str(uuid.UUID(int=rng.getrandbits(128), version=4))) for _ in range(3)]
    stories = Stream(tenant, str(uuid.UUID(int=rng.getrandbits(128), version=4)))
    subjects = max(50, n // 8)
    versions: dict[tuple[str, int], int] = {}
    story_versions: dict[str, int] = {}
    closed: set[str] = set()
    notified: set[str] = set()
    out: list[dict[str, Any]] = []
    at = "2026-11-29T21:00:00.123456Z"
    for _ in range(n):
        if rng.random() < 0.7:
            s = rng.choice(feeds)
            seq = s.next()
            number = 88000 + rng.randrange(subjects)
            subject = f"announcement:{number}"
            base: dict[str, Any] = {
                "v": 1, "tenant_id": tenant, "webhook_endpoint_id": s.endpoint, "epoch": 1,
                "change_seq": seq, "subject": subject, "item_kind": "announcement",
                "generation": 1, "sequence": f"{seq:012}", "event_id": f"evt_{seq}",
                "reload_generation": None, "snapshot": False, "changed_at": at,
            }
            key = (s.endpoint, number)
            if key in versions and rng.random() < 0.1:
                del versions[key]
                out.append(dict(base, operation="remove",
                                parts_diff={"added": [], "changed": [], "removed": []}))
            else:
                version = versions.get(key, 0) + 1
                versions[key] = version
                item = feed_item(rng, number, version, item_bytes)
                parts = [p["part_id"] for p in item["parts"]]
                diff = ({"added": parts, "changed": [], "removed": []} if version == 1
                        else {"added": [], "changed": parts, "removed": []})
                out.append(dict(base, operation="upsert", item=item, parts_diff=diff))
        else:
            seq = stories.next()
            open_ids = [i for i in story_versions if i not in closed]
            roll = rng.random()
            base = {
                "v": 1, "kind": "story", "tenant_id": tenant,
                "webhook_endpoint_id": stories.endpoint, "epoch": 1, "change_seq": seq,
                "event_id": f"evt_s{seq}", "reload_round": None, "changed_at": at,
            }
            if open_ids and roll < 0.08:
                story_id = rng.choice(open_ids)
                closed.add(story_id)
                body = dict(base, operation="closed", story_id=story_id, ticker="ALFA B",
                            version=story_versions[story_id] + 1)
                others = [i for i in open_ids if i != story_id]
                if others and rng.random() < 0.5:
                    body["merged_into"] = rng.choice(others)
                out.append(body)
                continue
            if open_ids and roll < 0.16:
                candidates = [i for i in open_ids if i not in notified]
                if candidates:
                    story_id = rng.choice(candidates)
                    notified.add(story_id)
                    out.append(dict(base, kind="notification", operation="notified",
                                    story_id=story_id, ticker="ALFA B",
                                    version=story_versions[story_id],
                                    story=_story(story_id, story_versions[story_id])))
                    continue
            if open_ids and roll < 0.7:
                story_id = rng.choice(open_ids)
            else:
                story_id = f"st_{len(story_versions) + 1:06}"
            version = story_versions.get(story_id, 0) + 1
            story_versions[story_id] = version
            out.append(dict(base, operation="saved", story_id=story_id, ticker="ALFA B",
                            version=version, story=_story(story_id, version)))
    return tenant, out


def _story(story_id: str, version: int) -> dict[str, Any]:
    return {
        "id": story_id,
        "ticker": "ALFA B",
        "version": version,
        "headline": f"Story {story_id}, version {version}",
        "strength": "strong" if version > 2 else "weak",
        "events": [{"event_id": f"evt_{story_id}_{v}", "summary": "y" * 180}
                   for v in range(1, min(version, 8) + 1)],
        "body": "z" * 600,
    }


def check_schemas(messages: Sequence[dict[str, Any]], sample: int) -> None:
    try:
        import jsonschema
    except ImportError:
        print("(jsonschema not installed: the messages are checked by the library's decoder only)")
        return
    feed = json.loads((DOCS / "change-message.v1.schema.json").read_text())
    story = json.loads((DOCS / "story-message.v1.schema.json").read_text())
    step = max(1, len(messages) // sample)
    for body in messages[::step]:
        jsonschema.validate(body, story if "kind" in body else feed)


# -- broker --------------------------------------------------------------------------------------


class Management:
    def __init__(self, url: str, user: str, password: str) -> None:
        self.url = url.rstrip("/")
        self.auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def call(self, method: str, path: str, body: object = None) -> None:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("authorization", self.auth)
        request.add_header("content-type", "application/json")
        with urllib.request.urlopen(request, timeout=30):
            pass


async def fill(amqp_url: str, queue: str, messages: Sequence[dict[str, Any]]) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
        window: list[asyncio.Future[Any]] = []
        for body in messages:
            kind = body.get("kind")
            window.append(asyncio.ensure_future(channel.default_exchange.publish(
                aio_pika.Message(
                    json.dumps(body, separators=(",", ":")).encode(),
                    message_id=message_id(body["webhook_endpoint_id"], body["epoch"],
                                          body["change_seq"]),
                    type=str(body["operation"]),
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    headers={"kind": kind} if kind else None,
                ),
                routing_key=queue,
            )))
            if len(window) >= 500:
                await asyncio.gather(*window)
                window = []
        await asyncio.gather(*window)


# -- the timed store -----------------------------------------------------------------------------


class Timed:
    """The Postgres store, noting when the last change of every endpoint is committed."""

    def __init__(self, store: PostgresStore, last: dict[str, int]) -> None:
        self.store = store
        self.last = last
        self.at: dict[str, int] = {}
        self.done = asyncio.Event()
        self.commits = 0

    async def load(self) -> Loaded:
        return await self.store.load()

    async def commit(
        self, steps: Sequence[Step], late: Sequence[StoryChange] = ()
    ) -> list[Notification]:
        recorded = await self.store.commit(steps, late)
        self.commits += 1
        for step in steps:
            self.at[step.endpoint_id] = step.after.last_change_seq
        if all(self.at.get(e) == seq for e, seq in self.last.items()):
            self.done.set()
        return recorded

    async def unhanded(self) -> list[Notification]:
        return await self.store.unhanded()

    async def mark_handed(self, notifications: Sequence[Notification]) -> None:
        await self.store.mark_handed(notifications)

    async def close(self) -> None:
        """Kept open: the benchmark checks the store after the consumer stopped."""


async def verify(store: PostgresStore, messages: Sequence[dict[str, Any]]) -> str:
    """The store against the messages applied in order in memory: positions, items, stories,
    notifications."""
    items: dict[tuple[str, str], Any] = {}
    stories: dict[tuple[str, str], tuple[bool, int, str | None]] = {}
    notified: set[tuple[str, str]] = set()
    last: dict[str, int] = {}
    for body in messages:
        e = body["webhook_endpoint_id"]
        last[e] = body["change_seq"]
        op = body["operation"]
        if op == "upsert":
            items[(e, body["subject"])] = body["item"]
        elif op == "remove":
            items.pop((e, body["subject"]), None)
        elif op == "saved":
            row = stories.get((e, body["story_id"]))
            if row is None or (not row[0] and row[1] < body["version"]):
                stories[(e, body["story_id"])] = (False, body["version"], None)
        elif op == "closed":
            stories[(e, body["story_id"])] = (True, body["version"], body.get("merged_into"))
        elif op == "notified":
            notified.add((e, body["story_id"]))
    conn = store.connection
    positions = {
        e: (epoch, seq) for e, epoch, seq in await (await conn.execute(
            "SELECT endpoint_id::text, epoch, last_change_seq FROM relay_positions")).fetchall()
    }
    assert positions == {e: (1, s) for e, s in last.items()}, positions
    mine_items = {
        (e, s): i for e, s, i in await (await conn.execute(
            "SELECT endpoint_id::text, subject, item FROM relay_items")).fetchall()
    }
    assert mine_items == items, "the items differ"
    mine_stories = {
        (e, s): (c, v, m) for e, s, c, v, m in await (await conn.execute(
            "SELECT endpoint_id::text, story_id, closed, version, merged_into FROM relay_stories"
        )).fetchall()
    }
    assert mine_stories == stories, "the stories differ"
    mine_notified = {
        (e, s) for e, s in await (await conn.execute(
            "SELECT endpoint_id::text, story_id FROM relay_notifications "
            "WHERE handed_at IS NOT NULL")).fetchall()
    }
    assert mine_notified == notified, "the notifications differ"
    return (f"{len(items)} items, {len(stories)} stories, {len(notified)} notifications: "
            "as the messages say")


# -- a run ---------------------------------------------------------------------------------------


async def run_once(args: argparse.Namespace, run: int, tenant: str,
                   messages: Sequence[dict[str, Any]]) -> float:
    management = Management(args.management_url, args.user, args.password)
    vhost = f"relay-consumer-bench-{secrets.token_hex(4)}"
    queue = f"relay.tenant.{tenant}"
    database = f"relay_consumer_bench_{secrets.token_hex(4)}"
    quoted = urllib.parse.quote(vhost, safe="")
    amqp_url = f"amqp://{args.user}:{args.password}@{args.amqp_host}/{quoted}"
    pg_admin = args.pg
    dsn = pg_admin.rsplit("/", 1)[0] + "/" + database
    management.call("PUT", f"/api/vhosts/{quoted}", {})
    try:
        management.call("PUT", f"/api/permissions/{quoted}/{args.user}",
                        {"configure": ".*", "write": ".*", "read": ".*"})
        began = time.monotonic()
        await fill(amqp_url, queue, messages)
        print(f"run {run}: {len(messages)} messages published to {vhost}/{queue} in "
              f"{time.monotonic() - began:.1f} s", flush=True)
        with psycopg.connect(pg_admin, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{database}"')
        try:
            pg = await PostgresStore.open(dsn)
            try:
                last: dict[str, int] = {}
                for body in messages:
                    last[body["webhook_endpoint_id"]] = body["change_seq"]
                timed = Timed(pg, last)
                handed = 0

                def count(_: Notification) -> None:
                    nonlocal handed
                    handed += 1

                consumer = Consumer(amqp_url, queue, timed, prefetch=args.prefetch,
                                    batch_max=args.batch_max, on_notification=count)
                started = time.monotonic()
                running = asyncio.create_task(consumer.run())
                waiting = asyncio.create_task(timed.done.wait())
                await asyncio.wait({running, waiting}, return_when=asyncio.FIRST_COMPLETED,
                                   timeout=args.timeout_s)
                elapsed = time.monotonic() - started
                consumer.stop()
                await running
                if not waiting.done():
                    waiting.cancel()
                    raise SystemExit(f"run {run}: not drained in {args.timeout_s} s "
                                     f"({consumer.stats()})")
                rate = len(messages) / elapsed
                print(f"run {run}: drained {len(messages)} messages in {elapsed:.2f} s: "
                      f"{rate:,.0f} messages/s ({timed.commits} commits, "
                      f"{consumer.stats().batches} batches, {handed} notifications handed)",
                      flush=True)
                print(f"run {run}: store checked: {await verify(pg, messages)}", flush=True)
                return rate
            finally:
                await pg.close()
        finally:
            with psycopg.connect(pg_admin, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    finally:
        management.call("DELETE", f"/api/vhosts/{quoted}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--item-bytes", type=int, default=3_000,
                        help="JSON size a feed item grows to (default 3000)")
    parser.add_argument("--prefetch", type=int, default=256)
    parser.add_argument("--batch-max", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--pg", default=os.environ.get(
        "RELAY_CONSUMER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--amqp-host", default="127.0.0.1:5672")
    parser.add_argument("--management-url", default="http://127.0.0.1:15672")
    parser.add_argument("--user", default="guest")
    parser.add_argument("--password", default="guest")
    args = parser.parse_args()

    began = time.monotonic()
    tenant, messages = build_messages(args.messages, args.seed, args.item_bytes)
    for body in messages:  # every one as the library reads it
        decode(json.dumps(body).encode())
    check_schemas(messages, sample=500)
    sizes = [len(json.dumps(m)) for m in messages]
    feed = sum(1 for m in messages if "kind" not in m)
    print(f"built {len(messages)} messages in {time.monotonic() - began:.1f} s: {feed} feed, "
          f"{len(messages) - feed} stories; mean {statistics.mean(sizes):,.0f} bytes, "
          f"{sum(sizes) / 1e6:.1f} MB; prefetch {args.prefetch}, batch_max {args.batch_max}",
          flush=True)
    rates = [await run_once(args, run, tenant, messages) for run in range(1, args.runs + 1)]
    print(f"messages/s over {len(rates)} runs: " + ", ".join(f"{r:,.0f}" for r in rates)
          + (f" (median {statistics.median(rates):,.0f})" if rates else ""))


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except urllib.error.URLError as error:
        sys.exit(f"the broker's management API: {error}")
