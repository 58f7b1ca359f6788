"""Both stores, through the same cases: the memory store, and Postgres (a database per test)."""

from __future__ import annotations

from typing import Any

import pytest

from builders import FEED, STORIES, encode, feed, marker, story
from readback import read
from relay_consumer import (
    Follower,
    MemoryStore,
    Notification,
    Position,
    PositionConflict,
    Step,
    Store,
    StoryChange,
    decode,
)
from relay_consumer.postgres import PostgresStore


async def feed_all(store: Store, bodies: list[dict[str, Any]], follower: Follower | None = None) -> list[Notification]:
    """Each body through a follower and a commit of its own."""
    if follower is None:
        loaded = await store.load()
        follower = Follower()
        follower.restore(loaded.positions, loaded.held)
    recorded: list[Notification] = []
    for body in bodies:
        _, step = follower.receive(decode(encode(body)))
        if step is not None:
            recorded += await store.commit([step])
    return recorded


async def test_the_feed_copy_upserts_removes_and_a_snapshot_forgets_what_was_held(store: Store) -> None:
    await feed_all(
        store,
        [
            feed(1, subject="announcement:1", item={"a": 1}),
            feed(2, subject="announcement:2", item={"b": 1}),
            feed(3, subject="announcement:1", item={"a": 2}),
            feed(4, "remove", subject="announcement:2"),
        ],
    )
    copy = await read(store)
    assert copy["items"] == {FEED: {"announcement:1": {"a": 2}}}
    assert copy["positions"] == {FEED: (1, 4)}
    await feed_all(
        store,
        [
            marker(1, "snapshot_begin", epoch=9, endpoint=FEED),
            feed(2, subject="announcement:3", item={"c": 1}, epoch=9, snapshot=True),
            marker(3, "snapshot_end", epoch=9, endpoint=FEED),
            feed(5, subject="announcement:9", item={"late": 1}),  # the old epoch, late: stale
            feed(4, subject="announcement:4", item={"d": 1}, epoch=9),
        ],
    )
    copy = await read(store)
    assert copy["items"] == {FEED: {"announcement:3": {"c": 1}, "announcement:4": {"d": 1}}}
    assert copy["positions"] == {FEED: (9, 4)}


async def test_stories_close_for_good_merge_and_drop_only_open_rows(store: Store) -> None:
    await feed_all(
        store,
        [
            story(1, "saved", "a", 1),
            story(2, "saved", "b", 1),
            story(3, "saved", "a", 2),
            story(4, "closed", "a", 3, merged_into="b"),
            story(5, "saved", "b", 2),
            story(6, "saved", "c", 1),
            story(7, "dropped", "c", 1),
            story(8, "dropped", "a", 3),  # a closed row stays
            story(9, "saved", "a", 9),  # closed for good: never opens again
            story(10, "saved", "b", 1),  # older than the row: not written
            story(11, "closed", "d", 0),
            story(12, "closed", "b", 0),  # closes at the greatest version known
        ],
    )
    copy = await read(store)
    assert copy["stories"] == {
        STORIES: {
            "a": ("ALFA B", 3, True, None, "b"),
            "b": ("ALFA B", 2, True, None, None),
            "d": ("ALFA B", 0, True, None, None),
        }
    }


async def test_a_notification_is_recorded_once_and_handed_once(store: Store) -> None:
    recorded = await feed_all(
        store,
        [
            story(1, "saved", "a", 1),
            story(2, "notified", "a", 1),
            story(2, "notified", "a", 1),  # a redelivery: a repeat by change_seq
            story(3, "notified", "a", 2),  # the same story again (a relay's mistake): counted
        ],
    )
    assert [(n.story_id, n.key) for n in recorded] == [("a", f"{STORIES}:1:2")]
    assert [n.story_id for n in await store.unhanded()] == ["a"]
    await store.mark_handed(recorded)
    assert await store.unhanded() == []
    copy = await read(store)
    assert copy["notified"] == {(STORIES, "a"): 1}
    assert copy["handed"] == {(STORIES, "a")}
    # A snapshot keeps the notifications: they were acted on.
    await feed_all(store, [marker(1, "snapshot_begin", epoch=5, endpoint=STORIES)])
    assert (await read(store))["notified"] == {(STORIES, "a"): 1}


async def test_held_changes_are_kept_with_the_position_and_released_in_order(store: Store) -> None:
    await feed_all(store, [feed(1), feed(3, subject="announcement:3"), feed(4, subject="announcement:4")])
    copy = await read(store)
    assert copy["held"] == 2 and copy["positions"] == {FEED: (1, 1)}
    loaded = await store.load()
    assert sorted(c.change_seq for c in loaded.held) == [3, 4]
    # A new follower (a restarted consumer) finds them, and 2 releases them.
    await feed_all(store, [feed(3, subject="announcement:3"), feed(2, subject="announcement:2")])
    copy = await read(store)
    assert copy["held"] == 0 and copy["positions"] == {FEED: (1, 4)}
    assert sorted(copy["items"][FEED]) == ["announcement:1", "announcement:2", "announcement:3", "announcement:4"]
    # A greater epoch's change ahead switches the epoch and drops the older held.
    await feed_all(store, [feed(6), feed(3, epoch=8, snapshot=True)])
    loaded = await store.load()
    assert [(c.epoch, c.change_seq) for c in loaded.held] == [(8, 3)]
    assert loaded.positions == {FEED: Position(8, 0)}


async def test_a_step_from_another_position_is_refused_and_the_commit_keeps_nothing(store: Store) -> None:
    await feed_all(store, [feed(1)])
    good = Step(FEED, Position(1, 1), Position(1, 2), applied=(decode(encode(feed(2, subject="announcement:2"))),))
    stale = Step(FEED, Position(1, 0), Position(1, 1), applied=(decode(encode(feed(1))),))
    with pytest.raises(PositionConflict):
        await store.commit([good, stale])
    copy = await read(store)
    assert copy["positions"] == {FEED: (1, 1)} and list(copy["items"][FEED]) == ["announcement:1"]
    first = Step(STORIES, Position(), Position(1, 1), applied=(decode(encode(story(1, "notified", "x"))),))
    await store.commit([first])
    with pytest.raises(PositionConflict):
        await store.commit([first])
    assert (await read(store))["notified"] == {(STORIES, "x"): 0}


async def test_the_memory_stores_handlers_are_called_in_order() -> None:
    from relay_consumer import Handlers

    calls: list[str] = []

    async def saved(c: Any) -> None:
        calls.append(f"saved {c.story_id}")

    store = MemoryStore(
        Handlers(
            upsert=lambda c: calls.append(f"upsert {c.subject}"),
            remove=lambda c: calls.append(f"remove {c.subject}"),
            snapshot_begin=lambda c: calls.append("begin"),
            snapshot_end=lambda c: calls.append("end"),
            story_saved=saved,
            story_closed=lambda c: calls.append(f"closed {c.story_id}"),
            story_dropped=lambda c: calls.append(f"dropped {c.story_id}"),
        )
    )
    await feed_all(
        store,
        [
            feed(2, "remove", subject="announcement:1"),
            feed(1, subject="announcement:1"),
            marker(1, "snapshot_begin", epoch=3, endpoint=FEED),
            marker(2, "snapshot_end", epoch=3, endpoint=FEED),
            story(1, "saved", "a"),
            story(2, "closed", "a", 2),
            story(3, "dropped", "a", 2),
        ],
    )
    assert calls == [
        "upsert announcement:1",
        "remove announcement:1",
        "begin",
        "end",
        "saved a",
        "closed a",
        "dropped a",
    ]


def notified(seq: int, story_id: str, **kw: Any) -> StoryChange:
    change = decode(encode(story(seq, "notified", story_id, **kw)))
    assert isinstance(change, StoryChange)
    return change


async def test_a_late_notification_of_an_older_epoch_is_recorded_once_by_story_without_moving(store: Store) -> None:
    follower = Follower()
    await feed_all(
        store,
        [
            story(1, "saved", "a", 1),
            story(2, "notified", "a", 1),
            marker(1, "snapshot_begin", epoch=5, endpoint=STORIES),
            story(2, "saved", "a", 1, epoch=5, snapshot=True),
            marker(3, "snapshot_end", epoch=5, endpoint=STORIES),
        ],
        follower,
    )
    await store.mark_handed(await store.unhanded())
    # Story b's notification of epoch 1, delivered after epoch 5 began: recorded, in the
    # commit of its batch (with a step of the new epoch), and answered to hand.
    _, step = follower.receive(decode(encode(story(4, "saved", "c", 1, epoch=5))))
    assert step is not None
    recorded = await store.commit([step], [notified(3, "b")])
    assert [(n.story_id, n.key) for n in recorded] == [("b", f"{STORIES}:1:3")]
    assert [n.story_id for n in await store.unhanded()] == ["b"]
    await store.mark_handed(recorded)
    # Its repeat, alone in a batch: nothing recorded, nothing counted, no position moved.
    assert await store.commit([], [notified(3, "b")]) == []
    # A late notification of a story recorded already (a's, of epoch 1): nothing either.
    assert await store.commit([], [notified(2, "a")]) == []
    copy = await read(store)
    assert copy["notified"] == {(STORIES, "a"): 0, (STORIES, "b"): 0}
    assert copy["handed"] == {(STORIES, "a"), (STORIES, "b")}
    assert copy["positions"] == {STORIES: (5, 4)}
    assert await store.unhanded() == []


async def test_a_held_notification_dropped_by_a_new_epoch_is_recorded_with_the_switch(store: Store) -> None:
    follower = Follower()
    await feed_all(store, [story(1, "saved", "a", 1), story(3, "notified", "b", 1)], follower)
    assert (await read(store))["held"] == 1
    # A restarted consumer: the held notification comes back from the store.
    follower = Follower()
    loaded = await store.load()
    follower.restore(loaded.positions, loaded.held)
    _, step = follower.receive(decode(encode(marker(1, "snapshot_begin", epoch=7, endpoint=STORIES))))
    assert step is not None and [c.change_seq for c in step.stale] == [3]
    late = [c for c in step.stale if isinstance(c, StoryChange) and c.operation == "notified"]
    recorded = await store.commit([step], late)
    assert [(n.story_id, n.epoch, n.change_seq) for n in recorded] == [("b", 1, 3)]
    copy = await read(store)
    assert copy["held"] == 0 and copy["positions"] == {STORIES: (7, 1)}
    assert copy["notified"] == {(STORIES, "b"): 0}


async def test_a_failed_commit_keeps_no_late_notification(store: Store) -> None:
    await feed_all(store, [feed(1)])
    stale = Step(FEED, Position(1, 0), Position(1, 1), applied=(decode(encode(feed(1))),))
    with pytest.raises(PositionConflict):
        await store.commit([stale], [notified(9, "z")])
    assert (await read(store))["notified"] == {} and await store.unhanded() == []


async def test_postgres_hands_a_late_notification_in_the_transaction_once(pg_database: str) -> None:
    seen: list[tuple[str, int]] = []

    async def in_transaction(conn: Any, n: Notification) -> None:
        seen.append((n.story_id, n.epoch))
        await conn.execute("INSERT INTO outbox (story_id) VALUES (%s)", (n.story_id,))

    store = await PostgresStore.open(pg_database, on_notification_in_transaction=in_transaction)
    try:
        await store.connection.execute("CREATE TABLE outbox (story_id text NOT NULL)")
        await feed_all(store, [marker(1, "snapshot_begin", epoch=4, endpoint=STORIES)])
        assert [n.story_id for n in await store.commit([], [notified(6, "q", epoch=3)])] == ["q"]
        assert await store.commit([], [notified(6, "q", epoch=3)]) == []
        assert seen == [("q", 3)]
        cur = await store.connection.execute("SELECT story_id FROM outbox")
        assert await cur.fetchall() == [("q",)]
        cur = await store.connection.execute(
            "SELECT epoch, change_seq, repeats, handed_at IS NULL FROM relay_notifications"
        )
        assert await cur.fetchall() == [(3, 6, 0, True)]
        assert (await read(store))["positions"] == {STORIES: (4, 1)}
    finally:
        await store.close()
