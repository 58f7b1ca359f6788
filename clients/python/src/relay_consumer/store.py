"""What a store is, and the in-memory one.

A store keeps, per endpoint, the copy (a feed's items; a stories endpoint's stories, closed
ones included), the position (epoch, last change_seq applied), the changes held until their
predecessors come, and the notifications recorded, all changed together by :meth:`Store.commit`
(one transaction for a durable store). A store refuses a step whose ``before`` is not the
position it holds (:class:`PositionConflict`), changing nothing.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Sequence, TypeVar

from .follower import Position, Step
from .messages import Change, FeedChange, StoryChange, message_id

T = TypeVar("T")


class StoreError(Exception):
    """A store could not do what it was asked: nothing of the commit is kept."""


class PositionConflict(StoreError):
    """A step's ``before`` is not the endpoint's position in the store (another consumer wrote,
    or the caller's view is stale): the commit is rolled back."""


@dataclass(frozen=True, slots=True)
class Notification:
    """A notification the relay claimed for a story (a ``notified`` change), recorded once."""

    endpoint_id: str
    story_id: str
    ticker: str | None
    version: int
    event_id: str | None
    story: dict[str, Any] | None
    epoch: int
    change_seq: int
    changed_at: str

    @property
    def key(self) -> str:
        """An idempotence key: the change's message id, the same however often it is handed."""
        return message_id(self.endpoint_id, self.epoch, self.change_seq)

    @classmethod
    def of(cls, change: StoryChange) -> Notification:
        return cls(
            endpoint_id=change.endpoint_id,
            story_id=change.story_id,
            ticker=change.ticker,
            version=change.version,
            event_id=change.event_id,
            story=change.story,
            epoch=change.epoch,
            change_seq=change.change_seq,
            changed_at=change.changed_at,
        )


@dataclass(frozen=True, slots=True)
class Loaded:
    positions: dict[str, Position]
    held: list[Change]


class Store(Protocol):
    async def load(self) -> Loaded:
        """The positions and held changes kept (empty for a new store)."""
        ...

    async def commit(
        self, steps: Sequence[Step], late: Sequence[StoryChange] = ()
    ) -> list[Notification]:
        """Writes the steps in order, all or nothing; answers the notifications newly recorded
        (to hand to the user's code after the commit).

        ``late`` are ``notified`` changes of an epoch older than the one their endpoint follows
        (delivered after the new epoch's first change, or held and dropped by the switch to
        it). The copy's changes of a stale epoch are dropped, but a notification is a claim of
        its own, keyed by story id, which the relay does not send again in the new epoch when
        the old one published it: each is recorded, in the same transaction and before the
        steps, unless its story is recorded already (then nothing, not even a repeat is
        counted), without moving any position."""
        ...

    async def unhanded(self) -> list[Notification]:
        """Notifications recorded and not yet marked handed (a consumer stopped in between)."""
        ...

    async def mark_handed(self, notifications: Sequence[Notification]) -> None:
        """Marks the notifications handed to the user's code."""
        ...

    async def close(self) -> None:
        """Releases what the store holds open (idempotent): the consumer calls it when it
        stops or fails."""
        ...


MaybeAwaitable = Awaitable[None] | None


async def call(handler: Callable[..., Any] | None, *args: Any) -> None:
    """Calls a user's callback, sync or async."""
    if handler is None:
        return
    result = handler(*args)
    if inspect.isawaitable(result):
        await result


@dataclass(slots=True)
class Handlers:
    """The user's callbacks, each sync or async, called as each change is applied (in
    change_seq order, once per change while the store's state lasts).

    With :class:`MemoryStore` they are called during :meth:`Store.commit`; an exception rolls
    the commit back (the delivery is not acknowledged and comes again).
    """

    upsert: Callable[[FeedChange], MaybeAwaitable] | None = None
    remove: Callable[[FeedChange], MaybeAwaitable] | None = None
    snapshot_begin: Callable[[Change], MaybeAwaitable] | None = None
    snapshot_end: Callable[[Change], MaybeAwaitable] | None = None
    story_saved: Callable[[StoryChange], MaybeAwaitable] | None = None
    story_closed: Callable[[StoryChange], MaybeAwaitable] | None = None
    story_dropped: Callable[[StoryChange], MaybeAwaitable] | None = None


@dataclass(slots=True)
class StoredItem:
    item_kind: str | None
    generation: int
    sequence: str | None
    item: dict[str, Any]
    epoch: int
    change_seq: int


@dataclass(slots=True)
class StoredStory:
    ticker: str | None
    version: int
    closed: bool
    story: dict[str, Any] | None
    merged_into: str | None
    epoch: int
    change_seq: int


@dataclass(slots=True)
class _Copy:
    position: Position = Position()
    snapshot_open: bool = False
    items: dict[str, StoredItem] = field(default_factory=dict)
    stories: dict[str, StoredStory] = field(default_factory=dict)
    held: dict[tuple[int, int], Change] = field(default_factory=dict)


class MemoryStore:
    """Keeps everything in this process's memory: gone when it stops, so a consumer that
    restarts with a new MemoryStore rebuilds from what its queue still holds (or a resync).

    Writes follow the same conditions as :class:`~relay_consumer.postgres.PostgresStore`.
    """

    def __init__(self, handlers: Handlers | None = None) -> None:
        self.handlers = handlers or Handlers()
        self._copies: dict[str, _Copy] = {}
        #: Notifications by (endpoint, story id): recorded once, and how often repeated.
        self.notifications: dict[tuple[str, str], Notification] = {}
        self.notification_repeats: dict[tuple[str, str], int] = {}
        self._handed: set[tuple[str, str]] = set()

    # Reads, for users and tests.
    def position(self, endpoint_id: str) -> Position:
        copy = self._copies.get(endpoint_id)
        return Position() if copy is None else copy.position

    def items(self, endpoint_id: str) -> dict[str, StoredItem]:
        copy = self._copies.get(endpoint_id)
        return {} if copy is None else dict(copy.items)

    def stories(self, endpoint_id: str) -> dict[str, StoredStory]:
        copy = self._copies.get(endpoint_id)
        return {} if copy is None else dict(copy.stories)

    def endpoints(self) -> list[str]:
        return sorted(self._copies)

    def handed(self) -> set[tuple[str, str]]:
        return set(self._handed)

    def held_count(self) -> int:
        return sum(len(c.held) for c in self._copies.values())

    async def load(self) -> Loaded:
        return Loaded(
            positions={e: c.position for e, c in self._copies.items()},
            held=[h for c in self._copies.values() for _, h in sorted(c.held.items())],
        )

    async def commit(
        self, steps: Sequence[Step], late: Sequence[StoryChange] = ()
    ) -> list[Notification]:
        # Work on copies so that a failure (a conflict, a user's callback raising) keeps nothing.
        import copy as copy_module

        copies = {
            e: copy_module.copy(c) for e, c in self._copies.items()
        }
        for c in copies.values():
            c.items = dict(c.items)
            c.stories = dict(c.stories)
            c.held = dict(c.held)
        notifications = dict(self.notifications)
        repeats = dict(self.notification_repeats)
        recorded: list[Notification] = []
        for stale in late:
            # An older epoch's notification: recorded once per story, no position moved.
            key = (stale.endpoint_id, stale.story_id)
            if stale.operation == "notified" and key not in notifications:
                notifications[key] = Notification.of(stale)
                recorded.append(notifications[key])
        for step in steps:
            copy = copies.get(step.endpoint_id)
            if copy is None:
                copy = copies[step.endpoint_id] = _Copy()
            if copy.position != step.before:
                raise PositionConflict(
                    f"endpoint {step.endpoint_id} is at {copy.position}, not {step.before}"
                )
            copy.position = step.after
            if step.new_epoch:
                copy.held = {k: v for k, v in copy.held.items() if k[0] >= step.after.epoch}
            for change in step.applied:
                if isinstance(change, FeedChange):
                    await self._apply_feed(copy, change)
                elif change.operation == "notified":
                    key = (change.endpoint_id, change.story_id)
                    if key in notifications:
                        repeats[key] = repeats.get(key, 0) + 1
                    else:
                        notifications[key] = Notification.of(change)
                        recorded.append(notifications[key])
                else:
                    await self._apply_story(copy, change)
            copy.held = {
                k: v
                for k, v in copy.held.items()
                if not (k[0] == step.after.epoch and k[1] <= step.after.last_change_seq)
            }
            if step.held is not None:
                copy.held[(step.held.epoch, step.held.change_seq)] = step.held
        self._copies = copies
        self.notifications = notifications
        self.notification_repeats = repeats
        return recorded

    async def _apply_feed(self, copy: _Copy, change: FeedChange) -> None:
        at = (change.epoch, change.change_seq)
        if change.operation == "upsert":
            held = copy.items.get(change.subject)
            if held is None or (held.epoch, held.change_seq) < at:
                assert change.item is not None
                copy.items[change.subject] = StoredItem(
                    change.item_kind,
                    change.generation,
                    change.sequence,
                    change.item,
                    change.epoch,
                    change.change_seq,
                )
            await call(self.handlers.upsert, change)
        elif change.operation == "remove":
            held = copy.items.get(change.subject)
            if held is not None and (held.epoch, held.change_seq) < at:
                del copy.items[change.subject]
            await call(self.handlers.remove, change)
        elif change.operation == "snapshot_begin":
            copy.items = {s: i for s, i in copy.items.items() if (i.epoch, i.change_seq) >= at}
            copy.stories = {
                s: r for s, r in copy.stories.items() if (r.epoch, r.change_seq) >= at
            }
            copy.snapshot_open = True
            await call(self.handlers.snapshot_begin, change)
        else:
            copy.snapshot_open = False
            await call(self.handlers.snapshot_end, change)

    async def _apply_story(self, copy: _Copy, change: StoryChange) -> None:
        row = copy.stories.get(change.story_id)
        if change.operation == "saved":
            # The relay's save: only when newer than the row and the row is not closed.
            if row is None or (not row.closed and row.version < change.version):
                copy.stories[change.story_id] = StoredStory(
                    change.ticker,
                    change.version,
                    False,
                    change.story,
                    None,
                    change.epoch,
                    change.change_seq,
                )
            await call(self.handlers.story_saved, change)
        elif change.operation == "closed":
            # The relay's close: for good, at the greatest version known.
            if row is None or not (row.closed and row.version >= change.version):
                copy.stories[change.story_id] = StoredStory(
                    change.ticker,
                    change.version if row is None else max(row.version, change.version),
                    True,
                    None,
                    change.merged_into,
                    change.epoch,
                    change.change_seq,
                )
            await call(self.handlers.story_closed, change)
        else:
            # The relay's drop takes open rows only: a closed row stays closed.
            if row is not None and not row.closed:
                del copy.stories[change.story_id]
            await call(self.handlers.story_dropped, change)

    async def unhanded(self) -> list[Notification]:
        return [n for k, n in sorted(self.notifications.items()) if k not in self._handed]

    async def mark_handed(self, notifications: Sequence[Notification]) -> None:
        for n in notifications:
            self._handed.add((n.endpoint_id, n.story_id))

    async def close(self) -> None:
        """Nothing to release: the copy stays readable."""
