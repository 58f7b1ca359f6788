"""The consumer's batch handling, with deliveries made up (no broker): what is committed, what is
acknowledged and when, what is refused, and when notifications are handed."""

from __future__ import annotations

from typing import Any, cast

import aio_pika.abc
import pytest

from builders import FEED, STORIES, TENANT, encode, feed, marker, story
from relay_consumer import (
    CannotPlace,
    Consumer,
    Handlers,
    InvalidMessage,
    MemoryStore,
    Notification,
    Position,
    Refusal,
    Store,
    UnknownVersion,
)
from readback import read


class FakeMessage:
    def __init__(self, body: dict[str, Any] | bytes, message_id: str | None = None) -> None:
        if isinstance(body, dict):
            self.body = encode(body)
            if message_id is None:
                message_id = f"{body['webhook_endpoint_id']}:{body['epoch']}:{body['change_seq']}"
        else:
            self.body = body
        self.message_id = message_id
        self.redelivered = False
        self.acked: list[bool] = []  # the multiple flag of each ack
        self.rejected: list[bool] = []  # the requeue flag of each reject
        self.log: list[str] | None = None

    async def ack(self, multiple: bool = False) -> None:
        self.acked.append(multiple)
        if self.log is not None:
            self.log.append(f"ack {self.message_id}")

    async def reject(self, requeue: bool = False) -> None:
        self.rejected.append(requeue)


def messages(*bodies: dict[str, Any] | FakeMessage) -> list[FakeMessage]:
    return [b if isinstance(b, FakeMessage) else FakeMessage(b) for b in bodies]


async def process(consumer: Consumer, batch: list[FakeMessage]) -> None:
    await consumer._process(cast(list[aio_pika.abc.AbstractIncomingMessage], batch))


def consumer_of(store: Store, **kw: Any) -> Consumer:
    return Consumer("amqp://nobody@127.0.0.1:1/%2f", f"relay.tenant.{TENANT}", store, **kw)


async def test_a_batch_is_committed_once_then_acknowledged_with_one_multiple_ack() -> None:
    store = MemoryStore()
    consumer = consumer_of(store)
    assert consumer.tenant_id == TENANT, "read from the queue's name"
    batch = messages(feed(1), feed(2, subject="announcement:2"), feed(2, subject="announcement:2"), feed(4))
    await process(consumer, batch)
    assert store.position(FEED) == Position(1, 2)
    assert store.held_count() == 1, "4 is held until 3 comes"
    assert [m.acked for m in batch] == [[], [], [], [True]]
    assert consumer.stats().commits == 1 and consumer.stats().deliveries == 4


async def test_a_notification_is_handed_after_its_commit_and_once() -> None:
    store = MemoryStore()
    log: list[str] = []

    def handed(n: Notification) -> None:
        log.append(f"hand {n.story_id} at {store.position(STORIES)}")

    consumer = consumer_of(store, on_notification=handed)
    first = messages(story(1, "saved", "a"), story(2, "notified", "a"))
    for m in first:
        m.log = log
    await process(consumer, first)
    again = messages(story(2, "notified", "a"), story(3, "notified", "a", 2))
    await process(consumer, again)
    assert log == [f"ack {STORIES}:1:2", f"hand a at {Position(1, 2)}"]
    assert store.handed() == {(STORIES, "a")}
    assert store.notification_repeats == {(STORIES, "a"): 1}
    assert consumer.stats().notifications_handed == 1
    assert [m.acked for m in again] == [[], [True]]


async def test_an_unknown_version_is_rejected_to_the_dead_letter_queue_and_stops() -> None:
    store = MemoryStore()
    refusals: list[Refusal] = []
    consumer = consumer_of(store, on_refused=refusals.append)
    future = dict(feed(2, subject="announcement:2"), v=2)
    batch = messages(feed(1), future, feed(3))
    with pytest.raises(UnknownVersion):
        await process(consumer, batch)
    assert [m.acked for m in batch] == [[False], [], []], "what came before is acknowledged alone"
    assert [m.rejected for m in batch] == [[], [False], []], "rejected without requeue"
    assert store.position(FEED) == Position(1, 1), "the position stays before the refused change"
    [refusal] = refusals
    assert refusal.message_id == f"{FEED}:1:2" and refusal.body == encode(future)
    assert consumer.stats().refused == 1


async def test_with_dead_letter_the_consumer_carries_on_past_a_refused_delivery() -> None:
    store = MemoryStore()
    consumer = consumer_of(store, on_unknown="dead_letter")
    other_tenant = dict(feed(2), tenant_id="0b1e3c5d-0000-4000-8000-000000000001")
    batch = messages(feed(1), FakeMessage(b"not json", "x"), other_tenant, feed(3))
    await process(consumer, batch)
    assert [m.acked for m in batch] == [[False], [], [], [False]]
    assert [m.rejected for m in batch] == [[], [False], [False], []]
    assert store.position(FEED) == Position(1, 1) and store.held_count() == 1
    assert consumer.stats().refused == 2


async def test_a_change_of_another_tenant_is_refused() -> None:
    consumer = consumer_of(MemoryStore())
    body = dict(feed(1), tenant_id="0b1e3c5d-0000-4000-8000-000000000001")
    with pytest.raises(InvalidMessage):
        await process(consumer, messages(body))


async def test_past_the_hold_bounds_without_an_api_nothing_more_is_acknowledged() -> None:
    store = MemoryStore()
    gaps: list[object] = []
    consumer = consumer_of(store, max_held_per_endpoint=2, on_gap=gaps.append)
    batch = messages(feed(1), feed(3), feed(4), feed(5))
    with pytest.raises(CannotPlace) as stopped:
        await process(consumer, batch)
    assert stopped.value.gap.missing == ((2, 2),)
    assert [m.acked for m in batch] == [[False], [False], [False], []]
    assert store.held_count() == 2 and len(gaps) == 1


async def test_a_failed_commit_acknowledges_nothing_and_keeps_nothing() -> None:
    def broken(_: object) -> None:
        raise RuntimeError("the user's code failed")

    store = MemoryStore(Handlers(remove=broken))
    consumer = consumer_of(store)
    batch = messages(feed(1), feed(2, "remove"))
    with pytest.raises(RuntimeError):
        await process(consumer, batch)
    assert [m.acked for m in batch] == [[], []]
    assert store.position(FEED) == Position() and store.items(FEED) == {}


async def test_a_late_notification_after_a_new_epochs_snapshot_is_recorded_and_handed_once(
    store: Store,
) -> None:
    log: list[str] = []
    consumer = consumer_of(store, on_notification=lambda n: log.append(f"hand {n.key}"))
    await process(consumer, messages(story(1, "saved", "a"), story(2, "notified", "a")))
    # A resync's new epoch reaches the consumer before epoch 1's change 3 (requeued).
    await process(
        consumer,
        messages(
            marker(1, "snapshot_begin", epoch=9, endpoint=STORIES),
            story(2, "saved", "a", epoch=9, snapshot=True),
            marker(3, "snapshot_end", epoch=9, endpoint=STORIES),
        ),
    )
    late = messages(story(3, "notified", "b", epoch=1), story(4, "saved", "c", epoch=1))
    for m in late:
        m.log = log
    await process(consumer, late)
    assert [m.acked for m in late] == [[], [True]], "both acked, after the commit"
    assert log == [f"hand {STORIES}:1:2", f"ack {STORIES}:1:4", f"hand {STORIES}:1:3"]
    # Its second copy (and the first story's, of epoch 1) are not handed again.
    again = messages(story(3, "notified", "b", epoch=1), story(2, "notified", "a", epoch=1))
    await process(consumer, again)
    assert [m.acked for m in again] == [[], [True]]
    assert len(log) == 3
    copy = await read(store)
    assert copy["positions"] == {STORIES: (9, 3)}, "no position moved by the late ones"
    assert copy["stories"] == {STORIES: {"a": ("ALFA B", 1, False, {"id": "a", "ticker": "ALFA B", "version": 1}, None)}}
    assert copy["notified"] == {(STORIES, "a"): 0, (STORIES, "b"): 0}
    assert copy["handed"] == {(STORIES, "a"), (STORIES, "b")}
    assert consumer.stats().notifications_handed == 2
    assert consumer.stats().late_notifications == 3 and consumer.follower.counts.stale == 4


async def test_a_held_notification_dropped_by_the_switch_to_a_new_epoch_is_handed(store: Store) -> None:
    handed: list[Notification] = []
    consumer = consumer_of(store, on_notification=handed.append)
    await process(consumer, messages(story(1, "saved", "a"), story(3, "notified", "b")))
    assert handed == [] and (await read(store))["held"] == 1
    switch = messages(marker(1, "snapshot_begin", epoch=4, endpoint=STORIES), story(2, "notified", "b"))
    await process(consumer, switch)
    assert [(n.story_id, n.epoch, n.change_seq) for n in handed] == [("b", 1, 3)]
    assert [m.acked for m in switch] == [[], [True]]
    copy = await read(store)
    assert copy["held"] == 0 and copy["positions"] == {STORIES: (4, 1)}
    assert copy["handed"] == {(STORIES, "b")} and copy["notified"] == {(STORIES, "b"): 0}
