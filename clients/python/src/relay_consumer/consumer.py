"""The consumer: reads a tenant's queue with manual acknowledgement and a prefetch, follows each
endpoint's stream (:class:`~relay_consumer.follower.Follower`), writes through a store, and
acknowledges a delivery only once what it decided is committed: applied, held, or dropped as a
repeat or as stale.

A ``notified`` change of an epoch older than the one its endpoint follows (delivered after the
new epoch's first change, or held and dropped when the new epoch began) is not dropped with the
rest of its epoch: a notification is a claim of its own, which the relay does not send again in
the new epoch when the old one published it. It is recorded once per (endpoint, story id) in
the transaction of its batch (:meth:`Store.commit`'s ``late``), without moving any position,
and handed like any other notification; a story already recorded is not handed again.

A delivery it cannot read (a ``v`` it does not know, or a body that is not a valid message) is
refused: reported to ``on_refused``, logged at ERROR, and rejected without requeue, which the
relay's broker policy moves to the tenant's dead-letter queue
(``relay.tenant.<tenant id>.dead-letter``), kept there for two weeks. It is never acknowledged
as applied and never guessed at. By default (``on_unknown="stop"``) the consumer then stops with
:class:`~relay_consumer.messages.MessageRefused`; the position stays before the refused change,
so the later changes of its endpoint wait (held, or in the queue). Upgrade, start again and the
gap is replayed from the relay (with ``api``), or ask for it yourself with
:meth:`RelayApi.replay`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import aio_pika
import aio_pika.abc
import aio_pika.exceptions
import aiormq.exceptions

from .follower import Follower, Gap, Step, Verdict
from .messages import Change, InvalidMessage, MessageRefused, StoryChange, decode
from .replay import RelayApi, ReplayAnswer, ReplayError
from .store import MaybeAwaitable, Notification, Store, StoreError, call

log = logging.getLogger("relay_consumer")

_TENANT_QUEUE = re.compile(
    r"^relay\.tenant\.([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$"
)


class CannotPlace(Exception):
    """Changes that cannot be placed: a gap past the hold bounds that no replay covers."""

    def __init__(self, gap: Gap, reason: str) -> None:
        super().__init__(
            f"endpoint {gap.endpoint_id} epoch {gap.epoch}: change_seqs "
            f"{_ranges(gap.missing)} missing, {gap.held} held; {reason}"
        )
        self.gap = gap


def _ranges(missing: Sequence[tuple[int, int]]) -> str:
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in missing)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A delivery refused: why, and what it was."""

    error: MessageRefused
    message_id: str | None
    body: bytes
    redelivered: bool


@dataclass(slots=True)
class ConsumerStats:
    deliveries: int = 0
    batches: int = 0
    commits: int = 0
    refused: int = 0
    gaps_reported: int = 0
    replays_asked: int = 0
    overflow_dropped: int = 0
    notifications_handed: int = 0
    #: ``notified`` changes of an older epoch than their endpoint's, given to the store to
    #: record by story id (repeats included) rather than dropped.
    late_notifications: int = 0
    sessions: int = 0
    session_errors: int = 0
    last_error: str | None = None


@dataclass(slots=True)
class _Replayed:
    answer: ReplayAnswer
    at: float


@dataclass(slots=True)
class _Batch:
    messages: list[aio_pika.abc.AbstractIncomingMessage] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    late: list[StoryChange] = field(default_factory=list)
    settled: list[aio_pika.abc.AbstractIncomingMessage] = field(default_factory=list)


class Consumer:
    """Consumes ``queue`` on ``amqp_url`` (the credentials the relay's API handed out) into
    ``store``.

    ``on_notification(notification)`` is called once per notification, after the commit that
    recorded it, and the notification is then marked handed; ``on_gap(gap)`` when an endpoint
    waited ``gap_timeout_s`` for a change, or when its held changes reached a bound;
    ``on_refused(refusal)`` for a refused delivery. Each may be sync or async.

    With ``api`` (a :class:`RelayApi` with a tenant token) a gap is asked for again with
    ``POST /v1/endpoints/{id}/replay``; without it a gap past the bounds stops the consumer
    (:class:`CannotPlace`), acknowledging nothing it could not place.
    """

    def __init__(
        self,
        amqp_url: str,
        queue: str,
        store: Store,
        *,
        tenant_id: str | None = None,
        prefetch: int = 256,
        batch_max: int = 256,
        on_notification: Callable[[Notification], MaybeAwaitable] | None = None,
        on_gap: Callable[[Gap], MaybeAwaitable] | None = None,
        on_refused: Callable[[Refusal], MaybeAwaitable] | None = None,
        on_unknown: Literal["stop", "dead_letter"] = "stop",
        api: RelayApi | None = None,
        max_held_per_endpoint: int = 1_000,
        max_held_total: int = 10_000,
        gap_timeout_s: float = 30.0,
        reconnect_delay_s: float = 0.5,
        max_reconnect_delay_s: float = 15.0,
        connection_name: str = "relay-consumer (python)",
    ) -> None:
        if prefetch < 1 or batch_max < 1:
            raise ValueError("prefetch and batch_max are 1 or more")
        self.amqp_url = amqp_url
        self.queue = queue
        self.store = store
        match = _TENANT_QUEUE.match(queue)
        self.tenant_id = tenant_id or (match.group(1) if match else None)
        self.prefetch = prefetch
        self.batch_max = batch_max
        self.on_notification = on_notification
        self.on_gap = on_gap
        self.on_refused = on_refused
        self.on_unknown = on_unknown
        self.api = api
        self.gap_timeout_s = gap_timeout_s
        self.reconnect_delay_s = reconnect_delay_s
        self.max_reconnect_delay_s = max_reconnect_delay_s
        self.connection_name = connection_name
        self.follower = Follower(
            max_held_per_endpoint=max_held_per_endpoint, max_held_total=max_held_total
        )
        self.stats = ConsumerStats()
        self._inbox: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._replayed: dict[str, _Replayed] = {}
        self._gap_reported: dict[str, float] = {}

    # -- running -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Asks :meth:`run` to finish its batch and return."""
        self._stop.set()

    async def run(self) -> None:
        """Consumes until :meth:`stop`, reconnecting (and reloading the store's state) after a
        broker or store failure. Raises :class:`MessageRefused` (with ``on_unknown="stop"``) and
        :class:`CannotPlace`, which a restart does not cure."""
        delay = self.reconnect_delay_s
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                await self._session()
            except (MessageRefused, CannotPlace):
                raise
            except (
                aio_pika.exceptions.AMQPException,
                aiormq.exceptions.AMQPError,
                ConnectionError,
                OSError,
                asyncio.TimeoutError,
                StoreError,
            ) as error:
                self.stats.session_errors += 1
                self.stats.last_error = f"{type(error).__name__}: {error}"
                if time.monotonic() - started > 30:
                    delay = self.reconnect_delay_s
                log.warning("consumer session ended (%s); again in %.1fs", error, delay)
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                delay = min(delay * 2, self.max_reconnect_delay_s)

    async def _session(self) -> None:
        self.stats.sessions += 1
        loaded = await self.store.load()
        self.follower.restore(loaded.positions, loaded.held)
        self._inbox = asyncio.Queue()
        await self._hand(await self.store.unhanded())
        connection = await aio_pika.connect(
            self.amqp_url, timeout=10, client_properties={"connection_name": self.connection_name}
        )
        try:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=self.prefetch)
            # No declare: a tenant's broker user may not configure anything (and the relay
            # declared the queue when it made the user).
            queue = await channel.get_queue(self.queue, ensure=False)
            await queue.consume(self._on_delivery, no_ack=False)
            log.info("consuming %s (prefetch %d)", self.queue, self.prefetch)
            while not self._stop.is_set():
                if connection.is_closed or channel.is_closed:
                    raise ConnectionError("the broker connection closed")
                try:
                    first = await asyncio.wait_for(self._inbox.get(), 1.0)
                except asyncio.TimeoutError:
                    await self._check_gaps()
                    continue
                batch = [first]
                while len(batch) < self.batch_max and not self._inbox.empty():
                    batch.append(self._inbox.get_nowait())
                await self._process(batch)
                await self._check_gaps()
        finally:
            try:
                await asyncio.wait_for(connection.close(), 5)
            except Exception as error:  # closing a broken connection: nothing more to do
                log.debug("closing the connection: %s", error)

    async def _on_delivery(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        """Each delivery, as the broker hands it over (called by aio-pika)."""
        await self._inbox.put(message)

    # -- one batch -----------------------------------------------------------------------------

    async def _process(self, messages: list[aio_pika.abc.AbstractIncomingMessage]) -> None:
        batch = _Batch(messages=messages)
        self.stats.batches += 1
        self.stats.deliveries += len(messages)
        stop_with: BaseException | None = None
        for message in messages:
            try:
                change = self._decode(message)
            except MessageRefused as error:
                await self._refuse(message, error)
                if self.on_unknown == "stop":
                    stop_with = error
                    break
                continue
            verdict, step = self.follower.receive(change)
            if verdict is Verdict.OVERFLOW:
                try:
                    await self._overflow(change)
                except CannotPlace as error:
                    stop_with = error
                    break
            elif verdict is Verdict.STALE:
                self._late(batch, (change,))
            if step is not None:
                batch.steps.append(step)
                self._late(batch, step.stale)
            batch.settled.append(message)
        await self._commit(batch)
        if stop_with is not None:
            raise stop_with

    def _late(self, batch: _Batch, stale: Sequence[Change]) -> None:
        """An older epoch's changes, dropped: its notifications are recorded anyway."""
        for change in stale:
            if isinstance(change, StoryChange) and change.operation == "notified":
                batch.late.append(change)

    def _decode(self, message: aio_pika.abc.AbstractIncomingMessage) -> Change:
        change = decode(message.body, message.message_id)
        if self.tenant_id is not None and change.tenant_id != self.tenant_id:
            raise InvalidMessage(
                f"a change of tenant {change.tenant_id} in tenant {self.tenant_id}'s queue",
                message_id=message.message_id,
            )
        return change

    async def _refuse(
        self, message: aio_pika.abc.AbstractIncomingMessage, error: MessageRefused
    ) -> None:
        self.stats.refused += 1
        log.error("refused a delivery, rejected to the dead-letter queue: %s", error)
        await call(
            self.on_refused,
            Refusal(error, message.message_id, message.body, bool(message.redelivered)),
        )
        await message.reject(requeue=False)

    async def _commit(self, batch: _Batch) -> None:
        notifications: list[Notification] = []
        if batch.steps or batch.late:
            notifications = await self.store.commit(batch.steps, batch.late)
            self.stats.late_notifications += len(batch.late)
            for change in batch.late:
                log.info(
                    "endpoint %s: notified change %d of epoch %d, older than the epoch followed: "
                    "kept by story id %s (recorded unless it is already)",
                    change.endpoint_id,
                    change.change_seq,
                    change.epoch,
                    change.story_id,
                )
            self.stats.commits += 1
        if batch.settled:
            if len(batch.settled) == len(batch.messages):
                await batch.settled[-1].ack(multiple=True)
            else:
                for message in batch.settled:
                    await message.ack()
        await self._hand(notifications)

    async def _hand(self, notifications: list[Notification]) -> None:
        if not notifications:
            return
        for notification in notifications:
            await call(self.on_notification, notification)
            self.stats.notifications_handed += 1
        await self.store.mark_handed(notifications)

    # -- gaps ----------------------------------------------------------------------------------

    async def _overflow(self, change: Change) -> None:
        """A change past the hold bounds: dropped (acknowledged) only when a replay asked of the
        relay will send it again; otherwise the consumer stops, acknowledging nothing more."""
        gap = self.follower.gap_before(change)
        await self._report(gap)
        if self.api is None:
            raise CannotPlace(gap, "the hold bounds are reached and no api is given to replay")
        answer = await self._replay(gap)
        if answer is None or not (
            answer.epoch == change.epoch
            and answer.from_change_seq <= change.change_seq <= answer.through_change_seq
        ):
            raise CannotPlace(gap, "the hold bounds are reached and no replay resends it")
        self.stats.overflow_dropped += 1

    async def _check_gaps(self) -> None:
        now = time.monotonic()
        for gap in self.follower.gaps():
            if gap.waiting_s < self.gap_timeout_s:
                continue
            last = self._gap_reported.get(gap.endpoint_id)
            if last is not None and now - last < self.gap_timeout_s:
                continue
            self._gap_reported[gap.endpoint_id] = now
            await self._report(gap)
            if self.api is not None:
                await self._replay(gap)

    async def _report(self, gap: Gap) -> None:
        self.stats.gaps_reported += 1
        log.warning(
            "endpoint %s epoch %d: change_seqs %s have not come (%d held, %.1fs)",
            gap.endpoint_id,
            gap.epoch,
            _ranges(gap.missing),
            gap.held,
            gap.waiting_s,
        )
        await call(self.on_gap, gap)

    async def _replay(self, gap: Gap) -> ReplayAnswer | None:
        """Asks the relay for the gap again, unless a replay asked recently covers it."""
        assert self.api is not None
        now = time.monotonic()
        previous = self._replayed.get(gap.endpoint_id)
        if (
            previous is not None
            and now - previous.at < self.gap_timeout_s
            and previous.answer.epoch == gap.epoch
            and previous.answer.from_change_seq <= gap.first_missing
            and gap.first_missing <= previous.answer.through_change_seq
        ):
            return previous.answer
        try:
            answer = await self.api.replay(gap.endpoint_id, gap.first_missing)
        except ReplayError as error:
            log.error("replay of endpoint %s from %d failed: %s", gap.endpoint_id,
                      gap.first_missing, error)
            return None
        self.stats.replays_asked += 1
        log.info(
            "replay asked: endpoint %s epoch %d changes %d-%d",
            answer.endpoint_id,
            answer.epoch,
            answer.from_change_seq,
            answer.through_change_seq,
        )
        self._replayed[gap.endpoint_id] = _Replayed(answer, now)
        return answer

