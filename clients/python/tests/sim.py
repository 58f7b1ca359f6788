"""A relay's stream, made up with a seeded RNG, and a queue that delivers it as a broker may:
out of order after nacks, twice, and to a consumer that crashes between any two steps."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from builders import FEED, STORIES, feed, marker, story
from relay_consumer import Follower, Notification, Store, StoryChange, Verdict, decode


@dataclass
class Truth:
    items: dict[str, Any] = field(default_factory=dict)
    stories: dict[str, tuple[str | None, int, bool, Any, str | None]] = field(default_factory=dict)
    notified: list[str] = field(default_factory=list)


def make_stream(rng: random.Random, *, changes: int = 60, epochs: int = 2) -> tuple[list[dict[str, Any]], Truth]:
    """Both endpoints' changes in publish order, and the copy they hold in the end."""
    truth = Truth()
    out: list[dict[str, Any]] = []
    feed_seq = story_seq = 0
    epoch = 1
    subjects = [f"announcement:{n}" for n in range(8)]
    ids = [f"st_{n}" for n in range(10)]
    for round_ in range(epochs):
        if round_ > 0:
            epoch = 1_796_000_000_000 + round_
            feed_seq = story_seq = 0
            # The feed endpoint's snapshot.
            feed_seq += 1
            out.append(marker(feed_seq, "snapshot_begin", epoch=epoch, endpoint=FEED))
            for subject, item in sorted(truth.items.items()):
                feed_seq += 1
                out.append(feed(feed_seq, "upsert", subject, epoch=epoch, item=item, snapshot=True))
            feed_seq += 1
            out.append(marker(feed_seq, "snapshot_end", epoch=epoch, endpoint=FEED))
            # The stories endpoint's: every row, open or closed.
            story_seq += 1
            out.append(marker(story_seq, "snapshot_begin", epoch=epoch, endpoint=STORIES))
            for sid, (ticker, version, closed, _, merged) in sorted(truth.stories.items()):
                story_seq += 1
                out.append(
                    story(story_seq, "closed" if closed else "saved", sid, version,
                          epoch=epoch, snapshot=True, merged_into=merged, ticker=ticker)
                )
            story_seq += 1
            out.append(marker(story_seq, "snapshot_end", epoch=epoch, endpoint=STORIES))
        for _ in range(changes):
            if rng.random() < 0.5:
                subject = rng.choice(subjects)
                feed_seq += 1
                if subject in truth.items and rng.random() < 0.3:
                    del truth.items[subject]
                    out.append(feed(feed_seq, "remove", subject, epoch=epoch))
                else:
                    item = {"feed_item_id": subject, "at": [epoch, feed_seq], "r": rng.random()}
                    truth.items[subject] = item
                    out.append(feed(feed_seq, "upsert", subject, epoch=epoch, item=item))
                continue
            sid = rng.choice(ids)
            row = truth.stories.get(sid)
            choice = rng.random()
            if row is not None and row[2]:
                continue  # closed for good: the relay writes it no more
            if choice < 0.55:
                version = (row[1] if row else 0) + rng.randint(1, 3)
                body = story(story_seq + 1, "saved", sid, version, epoch=epoch)
                truth.stories[sid] = ("ALFA B", version, False, body["story"], None)
            elif choice < 0.75:
                version = max(row[1] if row else 0, rng.choice([0, 1, 5]))
                merged = rng.choice([None, rng.choice(ids)])
                body = story(story_seq + 1, "closed", sid, version, epoch=epoch, merged_into=merged)
                truth.stories[sid] = ("ALFA B", version, True, None, merged)
            elif choice < 0.85 and row is not None:
                body = story(story_seq + 1, "dropped", sid, row[1], epoch=epoch)
                del truth.stories[sid]
            elif sid not in truth.notified:
                truth.notified.append(sid)
                body = story(story_seq + 1, "notified", sid, row[1] if row else 1, epoch=epoch)
            else:
                continue
            story_seq += 1
            out.append(body)
    return out, truth


def scramble(rng: random.Random, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The order a queue may deliver in: some pushed back (nacked and requeued), some twice."""
    queue = list(bodies)
    for _ in range(len(queue) // 4):
        i = rng.randrange(len(queue))
        j = min(len(queue) - 1, i + rng.randint(1, 12))
        queue.insert(j, queue.pop(i))
    for _ in range(len(queue) // 5):
        i = rng.randrange(len(queue))
        queue.insert(rng.randrange(i, len(queue) + 1), queue[i])
    if rng.random() < 0.2:
        rng.shuffle(queue)
    return queue


@dataclass
class Delivery:
    handed: list[Notification] = field(default_factory=list)
    crashes: int = 0
    verdicts: dict[Verdict, int] = field(default_factory=dict)


async def deliver(rng: random.Random, queue: list[dict[str, Any]], store: Store, *, crash: float = 0.1) -> Delivery:
    """Runs the consumer's loop over the queue: batches, commits, acks; a crash (before the
    commit, or after it and before the ack or the hand) puts the batch back unacknowledged."""
    result = Delivery()
    pending = list(queue)
    follower: Follower | None = None
    while pending:
        if follower is None:
            follower = Follower(max_held_per_endpoint=10_000, max_held_total=10_000)
            loaded = await store.load()
            follower.restore(loaded.positions, loaded.held)
            unhanded = await store.unhanded()
            result.handed.extend(unhanded)
            await store.mark_handed(unhanded)
        size = rng.randint(1, 8)
        batch, rest = pending[:size], pending[size:]
        steps = []
        late: list[StoryChange] = []
        for body in batch:
            change = decode(body)
            verdict, step = follower.receive(change)
            result.verdicts[verdict] = result.verdicts.get(verdict, 0) + 1
            assert verdict is not Verdict.OVERFLOW
            # An older epoch's notification, late or held and dropped by the switch: recorded
            # by story id all the same (as the consumer does).
            stale = [change] if verdict is Verdict.STALE else []
            if step is not None:
                steps.append(step)
                stale += step.stale
            late += [c for c in stale if isinstance(c, StoryChange) and c.operation == "notified"]
        where = rng.random()
        if where < crash:
            follower = None  # died before the commit: nothing kept, all comes again
        else:
            notes = await store.commit(steps, late)
            if where < 2 * crash:
                follower = None  # died after the commit, before the acks and the hand
            else:
                result.handed.extend(notes)
                await store.mark_handed(notes)
                pending = rest
                continue
        result.crashes += 1
        for body in reversed(batch):  # unacknowledged: back in the queue, maybe not in front
            rest.insert(rng.randint(0, min(len(rest), 4)), body)
        pending = rest
    return result
