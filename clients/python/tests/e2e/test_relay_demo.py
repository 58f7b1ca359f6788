"""End to end: the library against a real relay (`relay demo --external-consumer`: every tier,
real RabbitMQ, Postgres and Redis, the simulated upstream with every fault), a consumer killed
with SIGKILL and started again at seeded random moments, a scrambler taking deliveries and giving
them back out of order (some twice), resyncs of a feed endpoint and of the stories endpoint
mid-run, and a restore of the relay's database from a backup taken earlier in the run (the demo
stops every tier, restores, starts them again and rewinds: new epochs the consumer did not ask
for, and a relay that does not answer for a few seconds). At the end the Postgres store's tables must equal the copies the relay serves through
its API (which the demo's verdict found equal to the simulator's truth), and every notification
must have been handed over exactly once.

Runs only with ``RELAY_BIN`` naming the relay binary (a debug build is fine):

    RELAY_BIN=$PWD/target/debug/relay clients/python/ci.sh
    # or, in a venv with the package: RELAY_BIN=... pytest -s clients/python/tests/e2e

Knobs (environment): ``RELAY_CONSUMER_E2E_SEED`` (default 41), ``RELAY_CONSUMER_E2E_SEEDS``
(how many seeds from there, default 1), ``RELAY_CONSUMER_E2E_DURATION_S`` (the demo's workload,
default 20), ``RELAY_CONSUMER_E2E_KILLS`` (SIGKILLs during the workload, default 6),
``RELAY_CONSUMER_E2E_SCENARIOS`` (``runner,example``; default both),
``RELAY_CONSUMER_E2E_KEEP_LOGS`` (a directory to copy the logs to). The seed plans the kills,
the resyncs, the scrambler and the demo's upstream; it is printed and in every failure message.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    PACKAGE,
    ConsumerProcesses,
    Demo,
    Scrambler,
    log,
    pages,
    queue_depth,
    remove_demo_leftovers,
    resync,
    tail,
)
from relay_consumer import RelayApi, ResyncAnswer  # noqa: E402

RELAY_BIN = os.environ.get("RELAY_BIN", "")
PG_ADMIN = os.environ.get(
    "RELAY_CONSUMER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres"
)
SEED = int(os.environ.get("RELAY_CONSUMER_E2E_SEED", "41"))
SEEDS = int(os.environ.get("RELAY_CONSUMER_E2E_SEEDS", "1"))
DURATION_S = int(os.environ.get("RELAY_CONSUMER_E2E_DURATION_S", "20"))
KILLS = int(os.environ.get("RELAY_CONSUMER_E2E_KILLS", "6"))
SCENARIOS = os.environ.get("RELAY_CONSUMER_E2E_SCENARIOS", "runner,example").split(",")
KEEP_LOGS = os.environ.get("RELAY_CONSUMER_E2E_KEEP_LOGS")
SETTLE_TIMEOUT_S = 120
DRAIN_TIMEOUT_S = 120

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (RELAY_BIN and os.path.isfile(RELAY_BIN) and os.access(RELAY_BIN, os.X_OK)),
        reason="end to end against a real relay: set RELAY_BIN to the relay binary "
        "(e.g. RELAY_BIN=$PWD/target/debug/relay), with Postgres, Redis and RabbitMQ "
        "(management on 15672) on 127.0.0.1",
    ),
]


@dataclass(frozen=True)
class Scenario:
    """`runner`: tests/e2e/runner.py, whose in-transaction log has no unique key (a second
    handing would be a second row). `example`: examples/postgres.py as a user copies it (its
    outbox table, its printed NOTIFY lines), given the API for replays; then
    examples/rebuild.py --from-scratch into a fresh database."""

    name: str
    kills: int


def _params() -> list[Any]:
    out = []
    for seed in range(SEED, SEED + SEEDS):
        for name in SCENARIOS:
            name = name.strip()
            if name:
                out.append(pytest.param(seed, Scenario(name, KILLS), id=f"{name}-seed{seed}"))
    return out


def _dsn(database: str) -> str:
    return PG_ADMIN.rsplit("/", 1)[0] + "/" + database


NOTIFY_LINE = re.compile(r"^NOTIFY .* \(key (\S+)\)$")


@pytest.mark.parametrize(("seed", "scenario"), _params())
async def test_the_store_equals_the_relay_after_kills_scrambles_and_resyncs(
    seed: int, scenario: Scenario
) -> None:
    ctx = f"[seed {seed}, scenario {scenario.name}; RELAY_CONSUMER_E2E_SEED={seed} to repeat]"
    log(f"{ctx} duration {DURATION_S} s, {scenario.kills} kills")
    began = time.monotonic()
    rng = random.Random(seed)
    workdir = Path(tempfile.mkdtemp(prefix="relay-consumer-e2e-"))
    database = f"relay_consumer_e2e_{secrets.token_hex(6)}"
    dsn = _dsn(database)
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{database}"')
    demo = Demo(RELAY_BIN, workdir)
    consumers: ConsumerProcesses | None = None
    scrambler: Scrambler | None = None
    chaos: asyncio.Task[None] | None = None
    resyncs: asyncio.Task[dict[str, ResyncAnswer]] | None = None
    demo_exit: int | None = -1
    passed = False
    try:
        # The backup early, the restore late: the resyncs in between are lost with the database
        # (the restore's epochs come after theirs), and those asked while it runs wait for it.
        backup_at = max(1, round(rng.uniform(0.1, 0.25) * DURATION_S))
        restore_at = min(DURATION_S, max(backup_at + 1, round(rng.uniform(0.6, 0.8) * DURATION_S)))
        log(f"{ctx} backup at {backup_at} s, restore at {restore_at} s")
        await demo.start(seed=seed, duration_s=DURATION_S, settle_timeout_s=SETTLE_TIMEOUT_S,
                         backup_at_s=backup_at, restore_at_s=restore_at)
        started = await demo.event("started", 240)
        credentials = await demo.event("credentials", 30)
        api = RelayApi(str(started["api_base_url"]), str(credentials["tenant_token"]))
        feed_ids = [str(e) for e in started["webhook_endpoint_ids"]]
        stories_id = str(started["stories_endpoint_id"])
        endpoints = feed_ids + [stories_id]
        log(f"{ctx} demo up: api {started['api_base_url']}, queue {credentials['queue']}")

        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if scenario.name == "runner":
            command = [
                sys.executable, str(Path(__file__).resolve().parent / "runner.py"),
                "--amqp-url", str(credentials["tenant_amqp_url"]),
                "--queue", str(credentials["queue"]),
                "--dsn", dsn,
                "--log", str(workdir / "handed.jsonl"),
                "--trace", str(workdir / "deliveries.jsonl"),
                "--instance", "{instance}",
                "--api-url", str(started["api_base_url"]),
                "--token", str(credentials["tenant_token"]),
                # Small batches: more commits, so a kill lands inside one more often.
                "--batch-max", str(rng.choice([8, 32, 256])),
                "--prefetch", str(rng.choice([64, 256])),
                # Each notification handed after the commit takes this long before it is
                # marked: a kill lands in that window now and then.
                "--notification-delay-s", "0.5",
            ]
        else:
            command = [sys.executable, str(PACKAGE / "examples" / "postgres.py")]
            env.update(
                RELAY_AMQP_URL=str(credentials["tenant_amqp_url"]),
                RELAY_QUEUE=str(credentials["queue"]),
                RELAY_STORE_DSN=dsn,
                RELAY_API_URL=str(started["api_base_url"]),
                RELAY_API_TOKEN=str(credentials["tenant_token"]),
            )
        consumers = ConsumerProcesses(command, workdir, env)
        await consumers.start()
        scrambler = Scrambler(
            str(credentials["tenant_amqp_url"]),
            str(credentials["queue"]),
            random.Random(rng.getrandbits(64)),
        )
        await scrambler.start()

        stop_chaos = asyncio.Event()
        # (seconds up, seconds down) for each kill: down long enough for a backlog to gather,
        # and half the time killed again soon after the start, while it works through it.
        kill_plan = [
            (rng.uniform(1.0, 5.0) if rng.random() < 0.5 else rng.uniform(0.1, 0.6),
             rng.uniform(0.05, 3.0))
            for _ in range(scenario.kills)
        ]
        chaos = asyncio.create_task(_kill_and_restart(consumers, kill_plan, stop_chaos))
        resync_plan = {
            rng.choice(feed_ids): rng.uniform(0.25, 0.55) * DURATION_S,
            stories_id: rng.uniform(0.35, 0.65) * DURATION_S,
        }
        resyncs = asyncio.create_task(_resync_at(api, resync_plan))

        verdict = await demo.event("verdict", DURATION_S + SETTLE_TIMEOUT_S + 60)
        log(f"{ctx} verdict ok={verdict['ok']} settled in {verdict.get('settled_in_s')} s")
        assert verdict["ok"] is True, f"{ctx} the demo's verdict is not ok: {json.dumps(verdict)}"
        restored = await demo.event("restored", 5)
        log(f"{ctx} restored into {restored['database_url']}: rewinds "
            f"{ {e: a['outcome'] for e, a in restored['rewinds'].items()} }, epochs "
            f"{ {m['webhook_endpoint_id']: m['change_epoch'] for m in restored['endpoints']} }")
        assert set(restored["rewinds"]) == set(feed_ids), f"{ctx} rewound {restored['rewinds']}"
        resynced = await resyncs
        log(f"{ctx} resynced {({e: (a.epoch, a.snapshot_items) for e, a in resynced.items()})}")
        stop_chaos.set()
        await chaos
        # One kill more while it drains, at a seeded moment.
        await asyncio.sleep(rng.uniform(0.0, 1.0))
        await consumers.kill()
        await consumers.start()
        await scrambler.stop()
        log(f"{ctx} scrambler: {scrambler.stats}; killed instances {consumers.killed}")

        targets = await _drain(api, endpoints, dsn, consumers, ctx)
        log(f"{ctx} drained to {targets}")
        for endpoint, answer in resynced.items():
            assert targets[endpoint][0] >= answer.epoch, (
                f"{ctx} endpoint {endpoint} was resynced to epoch {answer.epoch} and is at "
                f"{targets[endpoint]}"
            )

        store = await _read_store(dsn, scenario)
        await _compare(api, feed_ids, stories_id, store, ctx)
        _check_notifications(store, scenario, consumers, workdir, ctx)

        await consumers.consuming()
        code = await consumers.stop()
        assert code == 0, (
            f"{ctx} the consumer did not stop cleanly on SIGTERM (exit {code}):\n"
            f"{tail(consumers.stderr_path(consumers.instance))}"
        )
        # Nothing refused (the consumer rejects to the dead-letter queue only what it refuses)
        # and nothing delivered 20 times.
        dead = queue_depth(str(credentials["queue"]) + ".dead-letter")
        assert dead is None or not dead.get("messages"), (
            f"{ctx} {dead and dead.get('messages')} messages in the tenant's dead-letter queue"
        )
        if scenario.name == "example":
            await _rebuild_from_scratch(api, feed_ids, stories_id, credentials, workdir, ctx)
        demo_exit = await demo.terminate()
        assert demo_exit == 0, f"{ctx} the demo exited {demo_exit} on SIGTERM:\n{tail(demo.stderr_path)}"
        log(f"{ctx} passed in {time.monotonic() - began:.0f} s")
        passed = True
    finally:
        await _clean_up(demo, consumers, scrambler, chaos, resyncs, database, passed, workdir,
                        ctx, demo_exit)


async def _kill_and_restart(
    consumers: ConsumerProcesses, plan: list[tuple[float, float]], stop: asyncio.Event
) -> None:
    for pause, down in plan:
        try:
            await asyncio.wait_for(stop.wait(), pause)
            return
        except asyncio.TimeoutError:
            pass
        await consumers.kill()
        log(f"killed consumer #{consumers.instance} (down {down:.2f} s)")
        await asyncio.sleep(down)
        await consumers.start()


async def _resync_at(api: RelayApi, plan: dict[str, float]) -> dict[str, ResyncAnswer]:
    started = time.monotonic()
    answers: dict[str, ResyncAnswer] = {}
    for endpoint, at in sorted(plan.items(), key=lambda p: p[1]):
        await asyncio.sleep(max(0.0, at - (time.monotonic() - started)))
        answers[endpoint] = await resync(api, endpoint)
        log(f"resync of {endpoint}: {answers[endpoint]}")
    return answers


async def _drain(
    api: RelayApi, endpoints: list[str], dsn: str, consumers: ConsumerProcesses, ctx: str
) -> dict[str, tuple[int, int]]:
    """Until the store's position of every endpoint is the relay's last change (its epoch and
    change_seq, with nothing left to publish), nothing is held and every notification is marked
    handed: the targets."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while True:
            targets: dict[str, tuple[int, int]] = {}
            backlog = 0
            for endpoint in endpoints:
                state = await api.get(f"/v1/endpoints/{endpoint}/state")
                targets[endpoint] = (int(state["change_epoch"]), int(state["last_change_seq"]))
                backlog += int(state["outbox_backlog"])
            rows = await (
                await conn.execute(
                    "SELECT endpoint_id::text, epoch, last_change_seq FROM relay_positions"
                )
            ).fetchall()
            positions = {e: (epoch, last) for e, epoch, last in rows}
            held_row = await (await conn.execute("SELECT count(*) FROM relay_held")).fetchone()
            held = held_row[0] if held_row else -1
            # And every notification recorded handed (after its commit, slowly) and marked.
            unhanded_row = await (
                await conn.execute(
                    "SELECT count(*) FROM relay_notifications WHERE handed_at IS NULL"
                )
            ).fetchone()
            unhanded = unhanded_row[0] if unhanded_row else -1
            if backlog == 0 and held == 0 and unhanded == 0 and positions == targets:
                return targets
            if not consumers.alive():
                raise AssertionError(
                    f"{ctx} the consumer exited ({consumers.current and consumers.current.returncode}) "
                    f"while draining:\n{tail(consumers.stderr_path(consumers.instance))}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{ctx} not drained in {DRAIN_TIMEOUT_S} s: relay at {targets} (outbox "
                    f"backlog {backlog}), store at {positions}, {held} held, {unhanded} "
                    "notifications not marked handed\n"
                    f"{tail(consumers.stderr_path(consumers.instance))}"
                )
            await asyncio.sleep(0.5)


async def _read_store(dsn: str, scenario: Scenario) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        out["items"] = defaultdict(dict)
        for e, subject, kind, generation, sequence, item in await (
            await conn.execute(
                "SELECT endpoint_id::text, subject, item_kind, generation, sequence, item "
                "FROM relay_items WHERE NOT tombstone"
            )
        ).fetchall():
            out["items"][e][subject] = {
                "item_kind": kind, "generation": generation, "sequence": sequence, "item": item
            }
        out["stories"] = defaultdict(dict)
        for e, story_id, ticker, version, closed, story, merged, epoch, seq in await (
            await conn.execute(
                "SELECT endpoint_id::text, story_id, ticker, version, closed, story, merged_into, "
                "epoch, change_seq FROM relay_stories"
            )
        ).fetchall():
            out["stories"][e][story_id] = {
                "ticker": ticker, "version": version, "closed": closed, "story": story,
                "merged_into": merged, "written_by": (epoch, seq),
            }
        out["notifications"] = [
            {"endpoint_id": e, "story_id": s, "epoch": ep, "change_seq": cs, "repeats": r,
             "handed": h}
            for e, s, ep, cs, r, h in await (
                await conn.execute(
                    "SELECT endpoint_id::text, story_id, epoch, change_seq, repeats, "
                    "handed_at IS NOT NULL FROM relay_notifications"
                )
            ).fetchall()
        ]
        if scenario.name == "runner":
            out["in_transaction"] = [
                {"endpoint_id": e, "story_id": s, "key": k, "instance": i}
                for e, s, k, i in await (
                    await conn.execute(
                        "SELECT endpoint_id::text, story_id, message_key, instance FROM e2e_handed"
                    )
                ).fetchall()
            ]
        elif scenario.name == "example":
            out["in_transaction"] = [
                {"endpoint_id": e, "story_id": s, "key": k, "instance": None}
                for e, s, k in await (
                    await conn.execute(
                        "SELECT endpoint_id::text, story_id, message_key FROM my_outbox"
                    )
                ).fetchall()
            ]
    return out


async def _compare(
    api: RelayApi,
    feed_ids: list[str],
    stories_id: str,
    store: dict[str, Any],
    ctx: str,
) -> None:
    """The store's copy against the relay's, endpoint by endpoint, read through the API, and
    the notifications recorded against those the relay sent."""
    await _compare_copies(api, feed_ids, stories_id, store, ctx)
    claimed = await pages(api, f"/v1/endpoints/{stories_id}/notifications")
    sent = sorted(n["story_id"] for n in claimed if n["notified"])
    recorded = sorted(n["story_id"] for n in store["notifications"])
    assert recorded == sent, (
        f"{ctx} notifications recorded in the store {recorded} are not those the relay sent "
        f"{sent} (claimed but not sent: "
        f"{sorted(n['story_id'] for n in claimed if not n['notified'])})"
    )
    assert all(n["endpoint_id"] == stories_id for n in store["notifications"]), ctx
    repeated = [n for n in store["notifications"] if n["repeats"]]
    # The relay's contract (docs/stories.md, the story schema): a resync or a restore begins a
    # new epoch, and a notification already sent may come again in it with a new (epoch,
    # change_seq): a resync carries the old epoch's notifications not yet recorded as published
    # (the publish cursor is marked at most once a second), and the restored relay claims again
    # the stories that became strong after the backup. The store records each story once
    # (repeats counts the others) and hands it once: what is checked below and in
    # _check_notifications; that the restore's repeats are of one story each is checked here.
    if repeated:
        log(f"{ctx} notified again in a new epoch (the documented at-least-once of a "
            f"notification): {repeated}")
    assert len({n["story_id"] for n in store["notifications"]}) == len(store["notifications"]), (
        f"{ctx} a story recorded twice: {store['notifications']}"
    )
    assert all(n["handed"] for n in store["notifications"]), (
        f"{ctx} notifications recorded and not marked handed: "
        f"{[n for n in store['notifications'] if not n['handed']]}"
    )
    log(f"{ctx} notifications: {len(sent)} sent by the relay, recorded once each")


async def _compare_copies(
    api: RelayApi, feed_ids: list[str], stories_id: str, store: dict[str, Any], ctx: str
) -> None:
    """The store's items and stories against the relay's copies, read through the API."""
    for endpoint in feed_ids:
        relay = {
            row["subject"]: {
                "item_kind": row["item_kind"], "generation": row["generation"],
                "sequence": row["sequence"], "item": row["item"],
            }
            for row in await pages(api, f"/v1/endpoints/{endpoint}/copy")
        }
        mine = store["items"].get(endpoint, {})
        _same(f"{ctx} feed endpoint {endpoint}'s items", mine, relay,
              lambda row: row["item"])
        _same(f"{ctx} feed endpoint {endpoint}'s items' kind", mine, relay,
              lambda row: row["item_kind"])
        # The relay's row keeps the position that last wrote it, and a reload that finds an
        # item unchanged moves it (a greater generation) without a change to send, so a copy
        # built from the stream may hold an older (generation, sequence) for the same item.
        moved = sum(
            1 for k in mine if (mine[k]["generation"], mine[k]["sequence"])
            != (relay[k]["generation"], relay[k]["sequence"])
        )
        assert not store["stories"].get(endpoint), f"{ctx} feed endpoint {endpoint} has stories"
        log(f"{ctx} feed endpoint {endpoint}: {len(relay)} items, the same ({moved} of them at "
            "another (generation, sequence) in the relay's row)")
    relay_stories = {
        row["id"]: {
            "ticker": row["ticker"], "version": row["version"], "closed": row["closed"],
            "story": row.get("story"), "merged_into": row["merged_into"],
        }
        for row in await pages(api, f"/v1/endpoints/{stories_id}/stories", include_closed="true")
    }
    mine_stories = store["stories"].get(stories_id, {})
    _same(f"{ctx} stories endpoint {stories_id}'s stories (open/closed, merged_into)",
          mine_stories, relay_stories,
          lambda row: (row["closed"], row["merged_into"], row["ticker"]))
    _same(f"{ctx} stories endpoint {stories_id}'s stories (version, snapshot)",
          mine_stories, relay_stories, lambda row: (row["version"], row["story"]))
    assert not store["items"].get(stories_id), f"{ctx} the stories endpoint has feed items"
    closed = sum(1 for r in relay_stories.values() if r["closed"])
    merged = sum(1 for r in relay_stories.values() if r["merged_into"])
    log(f"{ctx} stories endpoint: {len(relay_stories)} stories ({closed} closed, {merged} "
        "merged), the same")


def _same(what: str, mine: dict[str, Any], relay: dict[str, Any], view: Any) -> None:
    missing = sorted(set(relay) - set(mine))
    extra = sorted(set(mine) - set(relay))
    differ = sorted(k for k in set(mine) & set(relay) if view(mine[k]) != view(relay[k]))
    if missing or extra or differ:
        sample = {k: {"store": view(mine[k]), "relay": view(relay[k])} for k in differ[:3]}
        raise AssertionError(
            f"{what} differ from the relay's: {len(missing)} missing {missing[:5]}, "
            f"{len(extra)} extra {extra[:5]}, {len(differ)} different, e.g. "
            f"{json.dumps(sample, default=str)[:2000]}"
        )


def _check_notifications(
    store: dict[str, Any], scenario: Scenario, consumers: ConsumerProcesses, workdir: Path,
    ctx: str,
) -> None:
    """The library's contract (README, "Notifications, once"): a notified change is recorded in
    relay_notifications in the transaction that applies it, so it is recorded once however often
    it is delivered and whenever the consumer is killed.

    * ``on_notification_in_transaction`` runs inside that commit: what it writes in the same
      database commits with it or not at all. Exactly once, across every kill: checked strictly.
    * ``on_notification`` runs after the commit, and the notification is then marked handed. A
      kill between the two hands it again when the consumer starts again (it hands whatever is
      recorded and unmarked). At least once, with ``Notification.key`` to drop repeats: checked
      as that. Every key handed; a key handed twice only by two different processes, each one
      but the last of which was killed with SIGKILL (never twice by one process).
    """
    expected = {(n["endpoint_id"], n["story_id"]) for n in store["notifications"]}
    keys = {
        f"{n['endpoint_id']}:{n['epoch']}:{n['change_seq']}" for n in store["notifications"]
    }

    in_tx = Counter((row["endpoint_id"], row["story_id"]) for row in store["in_transaction"])
    twice = {k: c for k, c in in_tx.items() if c != 1}
    assert not twice, f"{ctx} handed in the transaction more than once: {twice}"
    assert set(in_tx) == expected, (
        f"{ctx} handed in the transaction: {sorted(in_tx)}; recorded: {sorted(expected)}"
    )
    assert {row["key"] for row in store["in_transaction"]} == keys, ctx

    handed: list[tuple[str, int]] = []  # (key, instance), in the order written
    if scenario.name == "runner":
        path = workdir / "handed.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                handed.append((row["key"], int(row["instance"])))
    else:
        for instance in range(1, consumers.instance + 1):
            for line in consumers.stdout_path(instance).read_text(errors="replace").splitlines():
                match = NOTIFY_LINE.match(line.strip())
                if match:
                    handed.append((match.group(1), instance))
    by_key: dict[str, list[int]] = defaultdict(list)
    for key, instance in handed:
        by_key[key].append(instance)
    assert set(by_key) == keys, (
        f"{ctx} handed after the commit: {sorted(by_key)}; recorded: {sorted(keys)}"
    )
    again = {k: v for k, v in by_key.items() if len(v) > 1}
    for key, instances in again.items():
        assert len(set(instances)) == len(instances), (
            f"{ctx} notification {key} handed twice by one process: instances {instances}"
        )
        assert all(i in consumers.killed for i in instances[:-1]), (
            f"{ctx} notification {key} handed again though the process that handed it first "
            f"was not killed: instances {instances}, killed {consumers.killed}"
        )
    log(
        f"{ctx} {len(keys)} notifications: in the transaction once each; after the commit "
        f"{len(handed)} handings, {len(again)} handed again after a kill"
    )


REBUILT_LINE = re.compile(
    r"^endpoint (\S+): rebuilt, (\d+) items / (\d+) stories "
    r"\(epoch (\d+), a snapshot of (\d+) rows\)$"
)
RESYNC_LINE = re.compile(
    r"^endpoint (\S+) \(\w+\): resync asked, epoch (\d+), a snapshot of (\d+) rows$"
)


async def _rebuild_from_scratch(
    api: RelayApi,
    feed_ids: list[str],
    stories_id: str,
    credentials: dict[str, Any],
    workdir: Path,
    ctx: str,
) -> None:
    """examples/rebuild.py --from-scratch as a user runs it, once the queue is drained and the
    example's consumer stopped: into a fresh database, it resyncs every endpoint and rebuilds
    each copy from its new epoch's snapshot; then the store must equal the relay's copies, and
    it must have said so (an epoch begun and a snapshot ended per endpoint, of the rows the
    resync answered)."""
    endpoints = feed_ids + [stories_id]
    database = f"relay_consumer_e2e_{secrets.token_hex(6)}_rebuild"
    dsn = _dsn(database)
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{database}"')
    rebuild_dir = workdir / "rebuild"
    rebuild_dir.mkdir()
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        RELAY_AMQP_URL=str(credentials["tenant_amqp_url"]),
        RELAY_QUEUE=str(credentials["queue"]),
        RELAY_STORE_DSN=dsn,
        RELAY_API_URL=api.base,
        RELAY_API_TOKEN=api.token,
    )
    rebuild = ConsumerProcesses(
        [sys.executable, str(PACKAGE / "examples" / "rebuild.py"), "--from-scratch"],
        rebuild_dir,
        env,
    )
    began = time.monotonic()
    try:
        await rebuild.start()
        await rebuild.consuming(60)
        out = rebuild.stdout_path(1)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while "every endpoint resynced is rebuilt" not in out.read_text(errors="replace"):
            if not rebuild.alive() or time.monotonic() > deadline:
                raise AssertionError(
                    f"{ctx} rebuild.py did not rebuild every endpoint:\n{tail(out)}\n"
                    f"{tail(rebuild.stderr_path(1))}"
                )
            await asyncio.sleep(0.2)
        targets = await _drain(api, endpoints, dsn, rebuild, ctx)
        lines = [line.strip() for line in out.read_text(errors="replace").splitlines()]
        asked = {
            m.group(1): (int(m.group(2)), int(m.group(3)))
            for m in map(RESYNC_LINE.match, lines) if m
        }
        rebuilt = {
            m.group(1): (int(m.group(4)), int(m.group(5)))
            for m in map(REBUILT_LINE.match, lines) if m
        }
        assert set(asked) == set(endpoints), f"{ctx} rebuild.py resynced {asked}"
        for endpoint, (epoch, rows) in asked.items():
            begun = f"endpoint {endpoint}: epoch {epoch} begins, rebuilding from its snapshot"
            assert begun in lines, (
                f"{ctx} rebuild.py did not say endpoint {endpoint}'s epoch {epoch} began:\n"
                f"{tail(out)}"
            )
            assert rebuilt.get(endpoint) == (epoch, rows), (
                f"{ctx} rebuild.py's rebuilt line of endpoint {endpoint}: "
                f"{rebuilt.get(endpoint)}, the resync answered epoch {epoch}, {rows} rows"
            )
            assert targets[endpoint][0] >= epoch, (endpoint, targets[endpoint], epoch, ctx)
        store = await _read_store(dsn, Scenario("rebuild", 0))
        await _compare_copies(api, feed_ids, stories_id, store, ctx)
        # A fresh store records only the notifications sent after the snapshots (the old
        # epochs' not yet recorded as published): each one the relay sent, once, handed.
        claimed = await pages(api, f"/v1/endpoints/{stories_id}/notifications")
        sent = {n["story_id"] for n in claimed if n["notified"]}
        recorded = [n["story_id"] for n in store["notifications"]]
        assert set(recorded) <= sent and len(set(recorded)) == len(recorded), (
            f"{ctx} rebuild's notifications {recorded}, the relay sent {sorted(sent)}"
        )
        assert all(n["handed"] for n in store["notifications"]), ctx
        code = await rebuild.stop()
        assert code == 0, (
            f"{ctx} rebuild.py did not stop cleanly on SIGTERM (exit {code}):\n"
            f"{tail(rebuild.stderr_path(1))}"
        )
        log(f"{ctx} rebuild.py --from-scratch: {len(asked)} endpoints resynced and rebuilt "
            f"into a fresh database, equal to the relay's copies, in "
            f"{time.monotonic() - began:.1f} s")
    finally:
        if rebuild.alive():
            await rebuild.kill()
        # Again while the server has no connection to spare (a shared Postgres, busy).
        for attempt in range(10):
            try:
                with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
                    admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
                break
            except psycopg.OperationalError:
                if attempt == 9:
                    raise
                await asyncio.sleep(1.0)


async def _clean_up(
    demo: Demo,
    consumers: ConsumerProcesses | None,
    scrambler: Scrambler | None,
    chaos: asyncio.Task[None] | None,
    resyncs: asyncio.Task[dict[str, ResyncAnswer]] | None,
    database: str,
    passed: bool,
    workdir: Path,
    ctx: str,
    demo_exit: int | None,
) -> None:
    for task in (chaos, resyncs):
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except BaseException:
                pass
    if consumers is not None and consumers.alive():
        await consumers.kill()
    if scrambler is not None:
        await scrambler.stop()
    if demo_exit == -1:
        demo_exit = await demo.terminate()
    if demo_exit != 0:
        remove_demo_leftovers(demo.events.get("started"), demo.events.get("credentials"),
                              PG_ADMIN)
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    if not passed:
        print(f"{ctx} demo stderr, last lines:\n{tail(demo.stderr_path, 30)}")
        if consumers is not None:
            print(f"{ctx} consumer #{consumers.instance} stderr, last lines:\n"
                  f"{tail(consumers.stderr_path(consumers.instance), 30)}")
    if KEEP_LOGS:
        target = Path(KEEP_LOGS) / workdir.name
        shutil.copytree(workdir, target)
        print(f"{ctx} logs kept in {target}")
    shutil.rmtree(workdir, ignore_errors=True)
