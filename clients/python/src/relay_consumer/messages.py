"""The relay's change messages, version 1, as a consumer reads them.

Two kinds share a tenant's queue and an endpoint's change_seq stream:

* a feed endpoint's change (``docs/change-message.v1.schema.json``), which has no ``kind``;
* a stories endpoint's change (``docs/story-message.v1.schema.json``), whose ``kind`` is
  ``story`` or ``notification``.

:func:`decode` reads ``v`` first and refuses any version other than 1 (:class:`UnknownVersion`)
rather than guess; a body that is not a valid message of its kind is refused too
(:class:`InvalidMessage`). Both are :class:`MessageRefused`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Mapping, TypeAlias

#: The only message version this library reads.
SUPPORTED_VERSION: Final = 1

FeedOperation: TypeAlias = Literal["upsert", "remove", "snapshot_begin", "snapshot_end"]
StoryOperation: TypeAlias = Literal["saved", "closed", "dropped", "notified"]

FEED_OPERATIONS: Final[frozenset[str]] = frozenset(
    {"upsert", "remove", "snapshot_begin", "snapshot_end"}
)
STORY_OPERATIONS: Final[Mapping[str, frozenset[str]]] = {
    "story": frozenset({"saved", "closed", "dropped"}),
    "notification": frozenset({"notified"}),
}

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")

_FEED_FIELDS: Final = frozenset(
    {
        "v",
        "tenant_id",
        "webhook_endpoint_id",
        "epoch",
        "change_seq",
        "operation",
        "subject",
        "item_kind",
        "generation",
        "sequence",
        "event_id",
        "reload_generation",
        "snapshot",
        "parts_diff",
        "changed_at",
    }
)
_FEED_OPTIONAL: Final = frozenset({"item"})
_STORY_FIELDS: Final = frozenset(
    {
        "v",
        "kind",
        "tenant_id",
        "webhook_endpoint_id",
        "epoch",
        "change_seq",
        "operation",
        "story_id",
        "ticker",
        "version",
        "event_id",
        "reload_round",
        "changed_at",
    }
)
_STORY_OPTIONAL: Final = frozenset({"story", "merged_into", "snapshot"})


class MessageRefused(Exception):
    """A delivery the library will not apply: it is reported, never guessed at."""

    def __init__(self, reason: str, *, message_id: str | None = None) -> None:
        super().__init__(reason if message_id is None else f"{reason} (message_id {message_id})")
        self.reason = reason
        self.message_id = message_id


class UnknownVersion(MessageRefused):
    """A message whose ``v`` this library does not know (only 1 is)."""

    def __init__(self, version: object, *, message_id: str | None = None) -> None:
        super().__init__(
            f"message version {version!r} is not one this library reads (it reads "
            f"v={SUPPORTED_VERSION}); upgrade relay-consumer",
            message_id=message_id,
        )
        self.version = version


class InvalidMessage(MessageRefused):
    """A body that is not a valid version-1 message of its kind."""


@dataclass(frozen=True, slots=True)
class PartsDiff:
    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FeedChange:
    """One change of a feed endpoint's copy (subject to item)."""

    tenant_id: str
    endpoint_id: str
    epoch: int
    change_seq: int
    operation: FeedOperation
    subject: str
    item_kind: str | None
    generation: int
    sequence: str | None
    event_id: str | None
    reload_generation: int | None
    snapshot: bool
    item: dict[str, Any] | None
    parts_diff: PartsDiff
    changed_at: str
    #: The body as received (parsed), kept to hold the change durably.
    body: Mapping[str, Any] = field(repr=False, compare=False)

    @property
    def message_id(self) -> str:
        return message_id(self.endpoint_id, self.epoch, self.change_seq)


@dataclass(frozen=True, slots=True)
class StoryChange:
    """One change of a stories endpoint: a story saved, closed or dropped, or a notification."""

    tenant_id: str
    endpoint_id: str
    epoch: int
    change_seq: int
    kind: Literal["story", "notification"]
    operation: StoryOperation
    story_id: str
    ticker: str | None
    version: int
    story: dict[str, Any] | None
    merged_into: str | None
    event_id: str | None
    reload_round: int | None
    snapshot: bool
    changed_at: str
    body: Mapping[str, Any] = field(repr=False, compare=False)

    @property
    def message_id(self) -> str:
        return message_id(self.endpoint_id, self.epoch, self.change_seq)


Change: TypeAlias = FeedChange | StoryChange


def message_id(endpoint_id: str, epoch: int, change_seq: int) -> str:
    """The AMQP message_id the relay gives a change: ``<endpoint>:<epoch>:<change_seq>``."""
    return f"{endpoint_id}:{epoch}:{change_seq}"


def decode(body: bytes | str | Mapping[str, Any], amqp_message_id: str | None = None) -> Change:
    """Parses a message body of either kind, refusing what is not a version-1 message.

    ``amqp_message_id``, when given, must name the body's change.
    """
    if isinstance(body, Mapping):
        data: Any = dict(body)
    else:
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as error:
            raise InvalidMessage(f"not JSON: {error}", message_id=amqp_message_id) from None
    if not isinstance(data, dict):
        raise InvalidMessage("not a JSON object", message_id=amqp_message_id)
    version = data.get("v")
    if type(version) is not int or version != SUPPORTED_VERSION:
        raise UnknownVersion(version, message_id=amqp_message_id)
    kind = data.get("kind")
    change: Change
    if "kind" not in data:
        change = _decode_feed(data, amqp_message_id)
    elif kind in STORY_OPERATIONS:
        change = _decode_story(data, amqp_message_id)
    else:
        raise InvalidMessage(f"unknown kind {kind!r}", message_id=amqp_message_id)
    if amqp_message_id is not None and amqp_message_id != change.message_id:
        raise InvalidMessage(
            f"the AMQP message_id does not name the body's change {change.message_id}",
            message_id=amqp_message_id,
        )
    return change


class _Reader:
    def __init__(self, data: dict[str, Any], message_id: str | None) -> None:
        self.data = data
        self.message_id = message_id

    def bad(self, what: str) -> InvalidMessage:
        return InvalidMessage(what, message_id=self.message_id)

    def fields(self, required: frozenset[str], optional: frozenset[str]) -> None:
        keys = set(self.data)
        missing = required - keys
        if missing:
            raise self.bad(f"missing {', '.join(sorted(missing))}")
        extra = keys - required - optional
        if extra:
            raise self.bad(f"unknown field {', '.join(sorted(extra))}")

    def string(self, name: str, *, nullable: bool = False, non_empty: bool = False) -> str | None:
        value = self.data.get(name)
        if value is None and nullable:
            return None
        if not isinstance(value, str):
            raise self.bad(f"{name} is not a string")
        if non_empty and not value:
            raise self.bad(f"{name} is empty")
        return value

    def required_string(self, name: str, *, non_empty: bool = False) -> str:
        value = self.string(name, non_empty=non_empty)
        assert value is not None
        return value

    def uuid(self, name: str) -> str:
        value = self.required_string(name)
        if not _UUID.match(value):
            raise self.bad(f"{name} is not a lowercase UUID")
        return value

    def integer(self, name: str, minimum: int, *, nullable: bool = False) -> int | None:
        value = self.data.get(name)
        if value is None and nullable:
            return None
        if type(value) is not int:
            raise self.bad(f"{name} is not an integer")
        if value < minimum:
            raise self.bad(f"{name} is below {minimum}")
        return value

    def required_integer(self, name: str, minimum: int) -> int:
        value = self.integer(name, minimum)
        assert value is not None
        return value

    def boolean(self, name: str, default: bool | None = None) -> bool:
        if name not in self.data and default is not None:
            return default
        value = self.data.get(name)
        if not isinstance(value, bool):
            raise self.bad(f"{name} is not a boolean")
        return value

    def obj(self, name: str) -> dict[str, Any] | None:
        if name not in self.data:
            return None
        value = self.data[name]
        if not isinstance(value, dict):
            raise self.bad(f"{name} is not an object")
        return value


def _decode_feed(data: dict[str, Any], mid: str | None) -> FeedChange:
    r = _Reader(data, mid)
    r.fields(_FEED_FIELDS, _FEED_OPTIONAL)
    operation = r.required_string("operation")
    if operation not in FEED_OPERATIONS:
        raise r.bad(f"unknown operation {operation!r}")
    subject = r.required_string("subject")
    snapshot = r.boolean("snapshot")
    event_id = r.string("event_id", nullable=True)
    reload_generation = r.integer("reload_generation", 0, nullable=True)
    causes = [event_id is not None, reload_generation is not None, snapshot]
    if sum(causes) != 1:
        raise r.bad("exactly one of event_id, reload_generation and snapshot must be set")
    item = r.obj("item")
    if (operation == "upsert") != ("item" in data):
        raise r.bad("an upsert has an item and nothing else has")
    if operation in ("snapshot_begin", "snapshot_end"):
        if subject != "" or not snapshot:
            raise r.bad("a snapshot marker names no subject and is part of a snapshot")
    elif not subject:
        raise r.bad("an upsert or removal names its subject")
    diff = data["parts_diff"]
    if not isinstance(diff, dict) or set(diff) != {"added", "changed", "removed"}:
        raise r.bad("parts_diff is not {added, changed, removed}")
    lists: list[tuple[str, ...]] = []
    for key in ("added", "changed", "removed"):
        values = diff[key]
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise r.bad(f"parts_diff.{key} is not a list of strings")
        lists.append(tuple(values))
    return FeedChange(
        tenant_id=r.uuid("tenant_id"),
        endpoint_id=r.uuid("webhook_endpoint_id"),
        epoch=r.required_integer("epoch", 1),
        change_seq=r.required_integer("change_seq", 1),
        operation=operation,  # type: ignore[arg-type]
        subject=subject,
        item_kind=r.string("item_kind", nullable=True),
        generation=r.required_integer("generation", 0),
        sequence=r.string("sequence", nullable=True),
        event_id=event_id,
        reload_generation=reload_generation,
        snapshot=snapshot,
        item=item,
        parts_diff=PartsDiff(*lists),
        changed_at=r.required_string("changed_at"),
        body=data,
    )


def _decode_story(data: dict[str, Any], mid: str | None) -> StoryChange:
    r = _Reader(data, mid)
    r.fields(_STORY_FIELDS, _STORY_OPTIONAL)
    kind = r.required_string("kind")
    operation = r.required_string("operation")
    if operation not in STORY_OPERATIONS[kind]:
        raise r.bad(f"operation {operation!r} is not one of kind {kind!r}")
    story_id = r.required_string("story_id", non_empty=True)
    snapshot = r.boolean("snapshot", default=False)
    event_id = r.string("event_id", nullable=True)
    reload_round = r.integer("reload_round", 1, nullable=True)
    if sum([event_id is not None, reload_round is not None, snapshot]) != 1:
        raise r.bad("exactly one of event_id, reload_round and snapshot must be set")
    if snapshot and operation not in ("saved", "closed"):
        raise r.bad("a snapshot holds only saved and closed rows")
    if operation == "notified" and event_id is None:
        raise r.bad("a notification names the event that claimed it")
    if operation == "dropped" and reload_round is None:
        raise r.bad("a drop names its round")
    story = r.obj("story")
    if (operation in ("saved", "notified")) != ("story" in data):
        raise r.bad("saved and notified carry the story and nothing else does")
    if story is not None and story.get("id") != story_id:
        raise r.bad("the story's id is not story_id")
    merged_into: str | None = None
    if "merged_into" in data:
        if operation != "closed":
            raise r.bad("merged_into is only on closed")
        merged_into = r.string("merged_into", non_empty=True)
    return StoryChange(
        tenant_id=r.uuid("tenant_id"),
        endpoint_id=r.uuid("webhook_endpoint_id"),
        epoch=r.required_integer("epoch", 1),
        change_seq=r.required_integer("change_seq", 1),
        kind=kind,  # type: ignore[arg-type]
        operation=operation,  # type: ignore[arg-type]
        story_id=story_id,
        ticker=r.string("ticker", nullable=True),
        version=r.required_integer("version", 0),
        story=story,
        merged_into=merged_into,
        event_id=event_id,
        reload_round=reload_round,
        snapshot=snapshot,
        changed_at=r.required_string("changed_at"),
        body=data,
    )
