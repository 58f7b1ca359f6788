from __future__ import annotations

from builders import FEED, STORIES, encode, feed, marker, story
from relay_consumer import Follower, Position, Verdict, decode
from relay_consumer.messages import Change


def f(seq: int, **kw: object) -> Change:
    return decode(encode(feed(seq, **kw)))  # type: ignore[arg-type]


def seqs(step: object) -> list[int]:
    return [c.change_seq for c in step.applied]  # type: ignore[attr-defined]


def test_in_order_with_repeats_each_change_is_applied_once() -> None:
    follower = Follower()
    answers = [follower.receive(f(s))[0] for s in [1, 2, 2, 3, 1, 4]]
    assert answers == [
        Verdict.APPLIED,
        Verdict.APPLIED,
        Verdict.DUPLICATE,
        Verdict.APPLIED,
        Verdict.DUPLICATE,
        Verdict.APPLIED,
    ]
    assert follower.position(FEED) == Position(1, 4)


def test_a_change_ahead_is_held_until_its_predecessors_come_then_released_in_order() -> None:
    follower = Follower()
    assert follower.receive(f(1))[0] is Verdict.APPLIED
    verdict, step = follower.receive(f(3))
    assert verdict is Verdict.HELD and step is not None and step.held is not None
    assert (step.before, step.after) == (Position(1, 1), Position(1, 1))
    assert follower.receive(f(4))[0] is Verdict.HELD
    assert follower.receive(f(4))[0] is Verdict.DUPLICATE, "a repeat of a held change"
    [gap] = follower.gaps()
    assert (gap.endpoint_id, gap.epoch, gap.missing, gap.held) == (FEED, 1, ((2, 2),), 2)
    verdict, step = follower.receive(f(2))
    assert verdict is Verdict.APPLIED and step is not None
    assert seqs(step) == [2, 3, 4]
    assert (step.before, step.after) == (Position(1, 1), Position(1, 4))
    assert follower.gaps() == [] and follower.held_total == 0


def test_missing_change_seqs_are_named_as_ranges() -> None:
    follower = Follower()
    for s in [3, 4, 7, 10]:
        follower.receive(f(s))
    [gap] = follower.gaps()
    assert gap.missing == ((1, 2), (5, 6), (8, 9))
    assert gap.missing_change_seqs() == [1, 2, 5, 6, 8, 9]
    assert gap.first_missing == 1


def test_a_greater_epoch_starts_over_and_the_older_is_stale_from_then_on() -> None:
    follower = Follower()
    for s in [1, 2, 3]:
        follower.receive(f(s))
    follower.receive(f(5))  # held in epoch 1, never to come
    verdict, step = follower.receive(f(1, operation="snapshot_begin", epoch=7))
    assert verdict is Verdict.APPLIED and step is not None and step.new_epoch
    assert (step.before, step.after) == (Position(1, 3), Position(7, 1))
    assert follower.held_total == 0, "the older epoch's held change is dropped"
    assert follower.receive(f(4))[0] is Verdict.STALE
    assert follower.receive(f(2))[0] is Verdict.STALE
    assert follower.receive(f(2, snapshot=True, epoch=7))[0] is Verdict.APPLIED


def test_a_greater_epochs_change_ahead_switches_the_epoch_and_is_held() -> None:
    follower = Follower()
    follower.receive(f(1))
    verdict, step = follower.receive(f(3, epoch=9, snapshot=True))
    assert verdict is Verdict.HELD and step is not None
    assert (step.before, step.after) == (Position(1, 1), Position(9, 0))
    assert follower.receive(f(2))[0] is Verdict.STALE
    assert follower.receive(f(1, operation="snapshot_begin", epoch=9))[0] is Verdict.APPLIED
    assert follower.position(FEED) == Position(9, 1)
    verdict, step = follower.receive(f(2, epoch=9, snapshot=True))
    assert step is not None and seqs(step) == [2, 3]


def test_holds_are_bounded_per_endpoint_and_in_total_and_an_overflow_changes_nothing() -> None:
    follower = Follower(max_held_per_endpoint=2, max_held_total=3)
    assert follower.receive(f(3))[0] is Verdict.HELD
    assert follower.receive(f(4))[0] is Verdict.HELD
    assert follower.receive(f(5))[0] is Verdict.OVERFLOW
    gap = follower.gap_before(f(9))
    assert gap.missing == ((1, 2), (5, 8))
    assert follower.held_count(FEED) == 2
    other = decode(encode(story(5, "saved", "st_1")))
    assert follower.receive(other)[0] is Verdict.HELD
    assert follower.receive(decode(encode(story(6, "saved", "st_1"))))[0] is Verdict.OVERFLOW
    assert follower.held_total == 3
    # Filling the gap releases them, and room comes back.
    verdict, step = follower.receive(f(1))
    assert follower.receive(f(2))[0] is Verdict.APPLIED
    assert follower.position(FEED) == Position(1, 4)
    assert follower.held_total == 1 and follower.held_count(STORIES) == 1


def test_a_follower_restored_from_a_store_carries_on() -> None:
    follower = Follower()
    follower.restore({FEED: Position(2, 5)}, [f(7, epoch=2), f(3, epoch=2), f(9, epoch=1)])
    assert follower.held_total == 1, "only held changes ahead, of the epoch followed"
    assert follower.receive(f(5, epoch=2))[0] is Verdict.DUPLICATE
    assert follower.receive(f(7, epoch=2))[0] is Verdict.DUPLICATE
    verdict, step = follower.receive(f(6, epoch=2))
    assert step is not None and seqs(step) == [6, 7]


def n(seq: int, story_id: str, **kw: object) -> Change:
    return decode(encode(story(seq, "notified", story_id, **kw)))  # type: ignore[arg-type]


def s(seq: int, operation: str, story_id: str, **kw: object) -> Change:
    return decode(encode(story(seq, operation, story_id, **kw)))  # type: ignore[arg-type]


def test_a_switch_to_a_greater_epoch_names_the_older_epochs_held_changes_it_drops() -> None:
    follower = Follower()
    follower.receive(s(1, "saved", "a"))
    follower.receive(n(4, "b"))  # held in epoch 1
    follower.receive(n(3, "a"))  # held in epoch 1
    follower.receive(s(6, "saved", "c"))  # held in epoch 1
    verdict, step = follower.receive(decode(encode(marker(1, "snapshot_begin", epoch=5, endpoint=STORIES))))
    assert verdict is Verdict.APPLIED and step is not None and step.new_epoch
    assert [(c.epoch, c.change_seq) for c in step.stale] == [(1, 3), (1, 4), (1, 6)], "in order"
    assert follower.held_total == 0 and follower.counts.stale == 3
    # The next change of the new epoch drops nothing more.
    verdict, step = follower.receive(decode(encode(marker(2, "snapshot_end", epoch=5, endpoint=STORIES))))
    assert step is not None and step.stale == ()
    # A late one of the old epoch is stale: the caller has it (no step).
    assert follower.receive(n(2, "d")) == (Verdict.STALE, None)


def test_a_held_switch_names_the_dropped_changes_too_and_a_step_within_an_epoch_none() -> None:
    follower = Follower()
    follower.receive(n(1, "a"))
    verdict, step = follower.receive(n(3, "b"))
    assert verdict is Verdict.HELD and step is not None and step.stale == ()
    verdict, step = follower.receive(s(4, "saved", "c", epoch=2, snapshot=True))
    assert verdict is Verdict.HELD and step is not None
    assert (step.before, step.after) == (Position(1, 1), Position(2, 0))
    assert [(c.epoch, c.change_seq) for c in step.stale] == [(1, 3)]
    assert step.held is not None and step.held.epoch == 2
    assert follower.held_total == 1


def test_held_changes_restored_from_a_store_are_named_by_the_switch() -> None:
    follower = Follower()
    follower.restore({STORIES: Position(1, 2)}, [n(5, "x")])
    verdict, step = follower.receive(decode(encode(marker(1, "snapshot_begin", epoch=3, endpoint=STORIES))))
    assert verdict is Verdict.APPLIED and step is not None
    assert [(c.change_seq, getattr(c, "story_id")) for c in step.stale] == [(5, "x")]
