"""The lifecycle (clients/README.md, "Lifecycle") against a real RabbitMQ and Postgres on
127.0.0.1: permanent failures end run() within seconds with the cause, transient ones are
retried with full-jitter backoff for ever, a broker close mid-run is carried through, and stop()
finishes the batch in hand, from a signal handler too."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any, Sequence

import psycopg
import pytest

from broker import AMQP_URL, OwnQueue, close_connection, free_port
from builders import FEED, feed
from readback import read
from relay_consumer import (
    Consumer,
    ErrorReport,
    MemoryStore,
    Notification,
    PermanentError,
    Position,
    Step,
    StoryChange,
)
from relay_consumer.postgres import PostgresStore

WRONG_PASSWORD = AMQP_URL.replace("guest:guest@", "guest:not-the-password@")


class Closing(MemoryStore):
    """A memory store that says whether it was closed, and may commit slowly."""

    def __init__(self, commit_delay_s: float = 0.0) -> None:
        super().__init__()
        self.closed = 0
        self.commit_delay_s = commit_delay_s
        self.committing = asyncio.Event()

    async def commit(
        self, steps: Sequence[Step], late: Sequence[StoryChange] = ()
    ) -> list[Notification]:
        self.committing.set()
        if self.commit_delay_s:
            await asyncio.sleep(self.commit_delay_s)
        return await super().commit(steps, late)

    async def close(self) -> None:
        self.closed += 1


async def ends_permanently(consumer: Consumer, kind: str, within_s: float = 10.0) -> list[ErrorReport]:
    reports: list[ErrorReport] = []
    consumer.on_error = reports.append
    began = time.monotonic()
    with pytest.raises(PermanentError) as raised:
        await asyncio.wait_for(consumer.run(), within_s)
    took = time.monotonic() - began
    assert raised.value.cause_kind == kind, raised.value
    assert took < within_s
    assert [r.transient for r in reports] == [False], reports
    assert reports[0].cause_kind == kind and reports[0].next_wait_s is None
    health = consumer.health()
    assert health.status == "failed" and not health.connected
    assert health.last_error is not None and kind in health.last_error
    assert consumer.stats().errors == 1
    assert 'relay_consumer_errors_total{kind="permanent"} 1' in consumer.metrics_text()
    return reports


async def test_a_wrong_broker_password_ends_run_with_broker_auth_within_seconds() -> None:
    store = Closing()
    async with OwnQueue() as queue:
        await ends_permanently(Consumer(WRONG_PASSWORD, queue.name, store), "broker_auth")
    assert store.closed == 1, "the store is closed before run() raises"


async def test_a_missing_queue_ends_run_with_queue_not_found() -> None:
    store = Closing()
    await ends_permanently(Consumer(AMQP_URL, "relay-consumer-test-no-such-queue", store),
                           "queue_not_found")
    assert store.closed == 1


async def test_a_missing_store_database_ends_run_with_store_missing() -> None:
    dsn = "postgresql://postgres@127.0.0.1:5432/relay_consumer_test_no_such_database"
    store = PostgresStore(dsn)
    async with OwnQueue() as queue:
        await ends_permanently(Consumer(AMQP_URL, queue.name, store), "store_missing")
    with pytest.raises(PermanentError) as raised:
        await PostgresStore.open(dsn)
    assert raised.value.cause_kind == "store_missing"


async def test_a_newer_store_schema_ends_run_with_schema_newer(pg_database: str) -> None:
    store = await PostgresStore.open(pg_database)
    await store.connection.execute(
        "INSERT INTO relay_consumer_schema (version, library) VALUES (2, 'relay-consumer-x 2.0.0')"
    )
    await store.close()
    async with OwnQueue() as queue:
        await ends_permanently(Consumer(AMQP_URL, queue.name, PostgresStore(pg_database)),
                               "schema_newer")
    with pytest.raises(PermanentError) as raised:
        await PostgresStore.open(pg_database)
    assert raised.value.cause_kind == "schema_newer"


async def test_an_unreachable_broker_is_retried_with_full_jitter_backoff_until_stop() -> None:
    store = Closing()
    consumer = Consumer(
        f"amqp://guest:guest@127.0.0.1:{free_port()}/%2f",
        "relay-consumer-test-unreachable",
        store,
        backoff_initial_s=0.04,
        backoff_max_s=0.16,
    )
    reports: list[ErrorReport] = []
    enough = asyncio.Event()

    def on_error(report: ErrorReport) -> None:
        reports.append(report)
        if len(reports) == 8:
            enough.set()

    consumer.on_error = on_error
    assert consumer.health().status == "starting"
    running = asyncio.create_task(consumer.run())
    await asyncio.wait_for(enough.wait(), 20)
    assert consumer.health().status == "reconnecting"
    await asyncio.wait_for(consumer.stop(), 5)
    await asyncio.wait_for(running, 5)
    assert all(r.transient and r.cause_kind is None for r in reports)
    steps = [0.04, 0.08, 0.16, 0.16, 0.16, 0.16, 0.16, 0.16]
    for report, step in zip(reports, steps):
        assert report.next_wait_s is not None and 0.0 <= report.next_wait_s <= step, (
            [r.next_wait_s for r in reports]
        )
    # Full jitter: the waits are not the steps themselves.
    assert len({r.next_wait_s for r in reports}) > 1
    stats = consumer.stats()
    assert stats.reconnects >= 8 and stats.errors == stats.reconnects
    health = consumer.health()
    assert health.status == "stopped" and not health.connected and health.last_error
    assert store.closed == 1


async def test_stop_before_run_makes_run_return_at_once_and_a_second_stop_is_a_no_op() -> None:
    store = Closing()
    consumer = Consumer(AMQP_URL, "relay-consumer-test-unused", store)
    consumer.stop()
    consumer.stop()
    await asyncio.wait_for(consumer.run(), 5)
    await consumer.stop()
    assert consumer.health().status == "stopped" and store.closed == 1


async def until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout_s} s")
        await asyncio.sleep(0.05)


async def test_a_broker_close_through_the_management_api_is_carried_through(
    pg_database: str,
) -> None:
    name = f"relay-consumer test {os.getpid()} {time.monotonic_ns()}"
    reports: list[ErrorReport] = []
    store = PostgresStore(pg_database)
    async with OwnQueue() as queue:
        consumer = Consumer(AMQP_URL, queue.name, store, batch_max=16, connection_name=name,
                            on_error=reports.append, backoff_initial_s=0.2)
        running = asyncio.create_task(consumer.run())
        try:
            await queue.publish([feed(seq, subject=f"announcement:{seq % 40}") for seq in range(1, 201)])
            await until(lambda: consumer.follower.position(FEED) == Position(1, 200), 30,
                        "at change 200")
            assert consumer.health().status == "ok" and consumer.health().connected
            assert await close_connection(name) == 1
            await until(lambda: bool(reports), 10, "reporting the close")
            await queue.publish(
                [feed(seq, "remove" if seq % 7 == 0 else "upsert", subject=f"announcement:{seq % 40}")
                 for seq in range(201, 401)]
            )
            await until(lambda: consumer.follower.position(FEED) == Position(1, 400), 30,
                        "at change 400")
            assert consumer.health().status == "ok"
        finally:
            await asyncio.wait_for(consumer.stop(), 10)
            await asyncio.wait_for(running, 10)
        assert await queue.depth() == 0, "everything acknowledged"
    assert [r.transient for r in reports] == [True]
    assert "CONNECTION_FORCED" in reports[0].describe(), reports[0].describe()
    stats = consumer.stats()
    assert stats.reconnects == 1 and stats.errors == 1
    assert stats.endpoints[FEED].last_change_seq == 400 and stats.endpoints[FEED].held == 0
    # The copy: each subject's last change, removals as tombstones.
    check = await PostgresStore.open(pg_database)
    try:
        copy = await read(check)
        last: dict[str, int] = {}
        for seq in range(1, 401):
            last[f"announcement:{seq % 40}"] = seq
        alive = {s for s, seq in last.items() if not (seq > 200 and seq % 7 == 0)}
        assert set(copy["items"][FEED]) == alive
        cur = await check.connection.execute(
            "SELECT count(*) FROM relay_items WHERE tombstone AND item IS NULL"
        )
        row = await cur.fetchone()
        assert row is not None and row[0] == 40 - len(alive)
    finally:
        await check.close()


async def test_stop_from_a_signal_handler_finishes_the_batch_in_hand() -> None:
    store = Closing(commit_delay_s=0.3)
    async with OwnQueue() as queue:
        await queue.publish([feed(seq, subject=f"announcement:{seq}") for seq in range(1, 101)])
        consumer = Consumer(AMQP_URL, queue.name, store, batch_max=10, prefetch=50)
        previous = signal.signal(signal.SIGUSR1, lambda *_: consumer.stop())
        try:
            running = asyncio.create_task(consumer.run())
            await asyncio.wait_for(store.committing.wait(), 20)
            # In the middle of a batch's commit: the raw handler runs between two bytecodes.
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.wait_for(running, 10)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        applied = store.position(FEED).last_change_seq
        stats = consumer.stats()
        assert stats.batches == 1 and 1 <= applied == stats.deliveries <= 10, (
            "the batch in hand, and nothing after it", applied, stats
        )
        assert consumer.health().status == "stopped" and store.closed == 1
        # What it committed it acknowledged; the rest is in the queue again.
        await until_depth(queue, 100 - applied)


async def until_depth(queue: OwnQueue, depth: int) -> None:
    deadline = time.monotonic() + 10
    while (found := await queue.depth()) != depth:
        if time.monotonic() > deadline:
            raise AssertionError(f"{found} messages in the queue, not {depth}")
        await asyncio.sleep(0.1)


async def test_a_store_database_restart_is_carried_through(pg_database: str) -> None:
    """The store's connection terminated under the consumer (as a restart does): reported as
    transient, reconnected, and the copy goes on from where it was committed."""
    reports: list[ErrorReport] = []
    store = PostgresStore(pg_database)
    async with OwnQueue() as queue:
        consumer = Consumer(AMQP_URL, queue.name, store, batch_max=16, on_error=reports.append,
                            backoff_initial_s=0.1)
        running = asyncio.create_task(consumer.run())
        try:
            await queue.publish([feed(seq) for seq in range(1, 51)])
            await until(lambda: consumer.follower.position(FEED) == Position(1, 50), 30,
                        "at change 50")
            database = pg_database.rsplit("/", 1)[1]
            with psycopg.connect(pg_database.rsplit("/", 1)[0] + "/postgres",
                                 autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    (database,),
                )
            await queue.publish([feed(seq) for seq in range(51, 101)])
            await until(lambda: consumer.follower.position(FEED) == Position(1, 100), 30,
                        "at change 100")
        finally:
            await asyncio.wait_for(consumer.stop(), 10)
            await asyncio.wait_for(running, 10)
    assert reports and all(r.transient for r in reports), reports
    check = await PostgresStore.open(pg_database)
    try:
        assert (await read(check))["positions"] == {FEED: (1, 100)}
    finally:
        await check.close()


async def test_metrics_and_health_name_what_the_contract_names() -> None:
    store = MemoryStore()
    consumer = Consumer(AMQP_URL, "relay-consumer-test-unused", store)
    from test_consumer import messages, process

    await process(consumer, messages(feed(1), feed(3, subject="announcement:3")))
    text = consumer.metrics_text()
    for name in (
        "relay_consumer_deliveries_total 2",
        "relay_consumer_commits_total 1",
        "relay_consumer_refused_total 0",
        "relay_consumer_reconnects_total 0",
        'relay_consumer_errors_total{kind="transient"} 0',
        'relay_consumer_errors_total{kind="permanent"} 0',
        "relay_consumer_up 0",
        f'relay_consumer_last_change_seq{{endpoint="{FEED}"}} 1',
        f'relay_consumer_held{{endpoint="{FEED}"}} 1',
        f'relay_consumer_lag_seconds{{endpoint="{FEED}"}} ',
    ):
        assert name in text, (name, text)
    assert "# TYPE relay_consumer_deliveries_total counter" in text
    stats = consumer.stats()
    assert stats.endpoints[FEED].epoch == 1 and stats.endpoints[FEED].held == 1
    lag = stats.endpoints[FEED].lag_s
    assert lag is not None and lag > 0
    assert set(stats.as_dict()) == {
        "deliveries", "batches", "commits", "refused", "gaps_reported", "replays_asked",
        "overflow_dropped", "notifications_handed", "late_notifications", "reconnects",
        "errors", "endpoints",
    }
    health = consumer.health()
    assert health.as_dict().keys() == {"status", "connected", "last_commit_at", "last_error"}
    assert health.status == "starting" and health.last_commit_at is not None
