"""The consumer: reads a tenant's queue with manual acknowledgement and a prefetch, follows each
endpoint's stream (:class:`~relay_consumer.follower.Follower`), writes through a store, and
acknowledges a delivery only once what it decided is committed: applied, held, or dropped as a
repeat or as stale.

The lifecycle (clients/README.md, "Lifecycle"): :meth:`Consumer.run` consumes until
:meth:`Consumer.stop`. A transient failure (the broker connection or channel lost or closed,
the broker not answering, the store's database restarting or unreachable, a serialization
failure) is reported to ``on_error`` (``transient=True``, the cause, the next wait), logged as
one line, and followed by a reconnect after a full-jitter backoff (a random wait between 0 and
the step; the step starts at ``backoff_initial_s``, doubles up to ``backoff_max_s``, and goes
back to the start after a session that consumed for 30 s), forever. A permanent failure
(``ACCESS_REFUSED``, ``NOT_FOUND``, the store's database missing or refusing the credentials,
the store's schema newer than the library's) is reported (``transient=False``) and ends
:meth:`run` with :class:`~relay_consumer.PermanentError`, after closing what was open.

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
import dataclasses
import datetime
import logging
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Literal, Sequence

import aio_pika
import aio_pika.abc
import aiormq.exceptions

from .errors import CauseKind, ErrorReport, PermanentError, classify, describe
from .follower import Follower, Gap, Step, Verdict
from .messages import Change, InvalidMessage, MessageRefused, StoryChange, decode
from .replay import RelayApi, ReplayAnswer, ReplayError
from .store import MaybeAwaitable, Notification, Store, call

log = logging.getLogger("relay_consumer")

_TENANT_QUEUE = re.compile(
    r"^relay\.tenant\.([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$"
)

#: A session that consumed this long starts the backoff over at ``backoff_initial_s``.
BACKOFF_RESET_AFTER_S = 30.0

Status = Literal["starting", "ok", "reconnecting", "stopped", "failed"]


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


@dataclass(frozen=True, slots=True)
class EndpointStats:
    """One endpoint as the consumer follows it."""

    #: The epoch followed and the last change_seq applied in it.
    epoch: int
    last_change_seq: int
    #: Changes held (ahead of the next one), kept in the store.
    held: int
    #: Now less the ``changed_at`` of the last change applied, as of the last commit (None
    #: until this process committed a change of the endpoint).
    lag_s: float | None


@dataclass(frozen=True, slots=True)
class ConsumerStats:
    """What :meth:`Consumer.stats` answers: counters since the consumer was made, and each
    endpoint's position."""

    #: Deliveries taken from the queue (redeliveries included).
    deliveries: int = 0
    #: Batches processed, and those that committed something to the store.
    batches: int = 0
    commits: int = 0
    #: Deliveries refused (rejected to the dead-letter queue).
    refused: int = 0
    #: Gaps reported to ``on_gap``, and replays asked of the relay for them.
    gaps_reported: int = 0
    replays_asked: int = 0
    #: Changes past the hold bounds dropped because an accepted replay sends them again.
    overflow_dropped: int = 0
    #: Notifications handed to ``on_notification`` (each then marked handed).
    notifications_handed: int = 0
    #: ``notified`` changes of an older epoch than their endpoint's, given to the store to
    #: record by story id (repeats included) rather than dropped.
    late_notifications: int = 0
    #: Reconnects after a transient failure, and failures reported to ``on_error``.
    reconnects: int = 0
    errors: int = 0
    endpoints: dict[str, EndpointStats] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Health:
    """What :meth:`Consumer.health` answers."""

    #: ``starting`` (not consumed yet), ``ok`` (consuming), ``reconnecting`` (after a transient
    #: failure, until consuming again), ``stopped`` (after :meth:`Consumer.stop`) or ``failed``
    #: (``run()`` raised).
    status: Status
    #: Whether a broker connection is open and consuming.
    connected: bool
    #: When the last batch was committed (UTC, ISO 8601), None before the first.
    last_commit_at: str | None
    #: The last failure, as one line (None before the first).
    last_error: str | None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class _Counters:
    deliveries: int = 0
    batches: int = 0
    commits: int = 0
    refused: int = 0
    gaps_reported: int = 0
    replays_asked: int = 0
    overflow_dropped: int = 0
    notifications_handed: int = 0
    late_notifications: int = 0
    reconnects: int = 0
    errors_transient: int = 0
    errors_permanent: int = 0


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


class _Wake:
    """Put in a session's inbox to wake its loop (a stop asked, the broker closed)."""


_WAKE = _Wake()


class BrokerClosed(ConnectionError):
    """The broker closed the connection or the channel under the consumer (transient)."""


@dataclass(slots=True)
class _Session:
    inbox: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage | _Wake] = field(
        default_factory=asyncio.Queue
    )
    closed: BaseException | None = None
    closed_event: asyncio.Event = field(default_factory=asyncio.Event)

    async def deliver(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        """Each delivery, as the broker hands it over (called by aio-pika)."""
        self.inbox.put_nowait(message)

    def on_close(self, sender: object, error: BaseException | None = None) -> None:
        """The connection's or the channel's close callback (aio-pika)."""
        if self.closed is None:
            what = "channel" if isinstance(sender, aio_pika.abc.AbstractChannel) else "connection"
            if isinstance(error, BaseException) and classify(error) not in (None, "transient"):
                self.closed = error
            else:
                reason = describe(error) if isinstance(error, BaseException) else "closed"
                self.closed = BrokerClosed(f"the broker {what} closed: {reason}")
            self.closed_event.set()
        self.inbox.put_nowait(_WAKE)

    async def why_closed(self, error: BaseException) -> BaseException:
        """The broker's reason for a failure met on a closed channel (an ack refused as
        ``ChannelInvalidStateError``, say), when its close callback tells it within a moment;
        else the failure itself."""
        if not isinstance(
            error, (aiormq.exceptions.AMQPError, aiormq.exceptions.ChannelInvalidStateError,
                    ConnectionError)
        ):
            return error
        if self.closed is None:
            try:
                await asyncio.wait_for(self.closed_event.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        return self.closed if self.closed is not None else error


class Stopping:
    """What :meth:`Consumer.stop` answers: awaiting it waits until :meth:`Consumer.run` has
    finished the batch in hand and closed everything (at once when it is not running). Not
    awaiting it is fine (a signal handler does not)."""

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer

    def __await__(self) -> Generator[Any, None, None]:
        return self._consumer._wait_finished().__await__()


class Consumer:
    """Consumes ``queue`` on ``amqp_url`` (the credentials the relay's API handed out) into
    ``store``.

    ``on_notification(notification)`` is called once per notification, after the commit that
    recorded it, and the notification is then marked handed; ``on_gap(gap)`` when an endpoint
    waited ``gap_timeout_s`` for a change, or when its held changes reached a bound;
    ``on_refused(refusal)`` for a refused delivery; ``on_error(report)`` for each failure,
    transient or permanent (:class:`~relay_consumer.ErrorReport`). Each may be sync or async.

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
        on_error: Callable[[ErrorReport], MaybeAwaitable] | None = None,
        on_unknown: Literal["stop", "dead_letter"] = "stop",
        api: RelayApi | None = None,
        max_held_per_endpoint: int = 1_000,
        max_held_total: int = 10_000,
        gap_timeout_s: float = 10.0,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        connection_name: str = "relay-consumer (python)",
    ) -> None:
        if prefetch < 1 or batch_max < 1:
            raise ValueError("prefetch and batch_max are 1 or more")
        if backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("0 < backoff_initial_s <= backoff_max_s")
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
        self.on_error = on_error
        self.on_unknown = on_unknown
        self.api = api
        self.gap_timeout_s = gap_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.connect_timeout_s = connect_timeout_s
        self.connection_name = connection_name
        self.follower = Follower(
            max_held_per_endpoint=max_held_per_endpoint, max_held_total=max_held_total
        )
        self._counters = _Counters()
        self._rng = random.Random()
        self._replayed: dict[str, _Replayed] = {}
        self._gap_reported: dict[str, float] = {}
        # The lifecycle's state.
        self._status: Status = "starting"
        self._connected = False
        self._last_commit_at: datetime.datetime | None = None
        self._last_error: str | None = None
        #: Per endpoint, the changed_at of the last change applied, as of the last commit.
        self._changed_at: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._stop_requested = False
        self._stop_event: asyncio.Event | None = None
        self._finished: asyncio.Future[None] | None = None
        self._session: _Session | None = None
        self._in_batch = 0
        self._consuming_since: float | None = None

    # -- the lifecycle -------------------------------------------------------------------------

    def stop(self) -> Stopping:
        """Stops: no more deliveries are taken, the batch in hand is finished (applied and
        committed, then acknowledged, its notifications handed), the channel, the connection
        and the store are closed, and :meth:`run` returns normally.

        Safe to call from a signal handler (``loop.add_signal_handler(SIGTERM, consumer.stop)``
        or ``signal.signal``) and from another thread; a second call is a no-op. Await what it
        answers to wait until everything is closed."""
        if not self._stop_requested:
            self._stop_requested = True
            loop = self._loop
            if loop is not None and self._running:
                try:
                    loop.call_soon_threadsafe(self._wake_for_stop)
                except RuntimeError:  # the loop is closed: nothing runs to stop
                    pass
        return Stopping(self)

    def _wake_for_stop(self) -> None:
        if self._in_batch:
            log.info("stopping: finishing the batch in hand (%d deliveries)", self._in_batch)
        else:
            log.info("stopping: no batch in hand")
        if self._stop_event is not None:
            self._stop_event.set()
        if self._session is not None:
            self._session.inbox.put_nowait(_WAKE)

    async def _wait_finished(self) -> None:
        finished = self._finished
        if finished is not None and self._running and not finished.done():
            await asyncio.shield(finished)

    async def run(self) -> None:
        """Consumes until :meth:`stop`, reconnecting (and reloading the store's state) after a
        transient failure, forever. Raises :class:`~relay_consumer.PermanentError` for a
        permanent one; :class:`MessageRefused` (with ``on_unknown="stop"``) and
        :class:`CannotPlace`, which a restart does not cure either; and whatever a callback of
        yours raised. Whichever way it ends, the channel, the connection and the store are
        closed first."""
        if self._running:
            raise RuntimeError("this consumer is running already")
        self._running = True
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        self._finished = self._loop.create_future()
        if self._stop_requested:
            self._stop_event.set()
        self._status = "starting"
        step = self.backoff_initial_s
        failed = True
        try:
            while not self._stop_requested:
                self._consuming_since = None
                try:
                    await self._run_session()
                    continue
                except (MessageRefused, CannotPlace):
                    raise
                except Exception as error:
                    kind = classify(error)
                    if kind is None:
                        raise
                    if kind != "transient":
                        await self._permanent(kind, error)
                    if self._stop_requested:
                        break
                    since = self._consuming_since
                    if since is not None and time.monotonic() - since >= BACKOFF_RESET_AFTER_S:
                        step = self.backoff_initial_s
                    wait = self._rng.uniform(0.0, step)
                    step = min(step * 2, self.backoff_max_s)
                    self._counters.errors_transient += 1
                    self._counters.reconnects += 1
                    self._status = "reconnecting"
                    self._last_error = describe(error)
                    log.warning(
                        "transient failure (%s); reconnecting in %.2f s", describe(error), wait
                    )
                    await self._report(ErrorReport(True, error, wait))
                    try:
                        await asyncio.wait_for(self._stop_event.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
            failed = False
        except asyncio.CancelledError:
            failed = False
            raise
        finally:
            self._connected = False
            self._session = None
            try:
                await self.store.close()
            except Exception as error:  # closing a store that failed: nothing more to do
                log.debug("closing the store: %s", error)
            self._status = "failed" if failed else "stopped"
            self._running = False
            if not self._finished.done():
                self._finished.set_result(None)
            log.info("consumer %s", self._status)

    async def _permanent(self, kind: CauseKind, error: Exception) -> None:
        permanent = (
            error if isinstance(error, PermanentError) else PermanentError(kind, describe(error))
        )
        self._counters.errors_permanent += 1
        self._last_error = describe(permanent)
        log.error("permanent failure, not reconnecting: %s", describe(permanent))
        await self._report(ErrorReport(False, error, None, kind))
        if permanent is error:
            raise permanent
        raise permanent from error

    async def _report(self, report: ErrorReport) -> None:
        try:
            await call(self.on_error, report)
        except Exception:  # the hook informs; it does not decide
            log.exception("on_error raised")

    async def _until_stopped(self, awaitable: Any) -> Any:
        """Awaits ``awaitable`` unless a stop comes first (then cancels it: None)."""
        assert self._stop_event is not None
        task = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self._stop_event.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        try:
            result = await task
        except (asyncio.CancelledError, Exception):
            return None
        # It finished as it was cancelled: close what it opened.
        if isinstance(result, aio_pika.abc.AbstractConnection):
            await result.close()
        return None

    async def _run_session(self) -> None:
        session = self._session = _Session()
        loaded = await self._until_stopped(self.store.load())
        if loaded is None:
            return
        self.follower.restore(loaded.positions, loaded.held)
        await self._hand(await self.store.unhanded())
        if self._stop_requested:
            return
        connection: aio_pika.abc.AbstractConnection | None = await self._until_stopped(
            aio_pika.connect(
                self.amqp_url,
                timeout=self.connect_timeout_s,
                client_properties={"connection_name": self.connection_name},
            )
        )
        if connection is None:
            return
        try:
            connection.close_callbacks.add(session.on_close)
            channel = await connection.channel()
            channel.close_callbacks.add(session.on_close)
            await channel.set_qos(prefetch_count=self.prefetch)
            # No declare: a tenant's broker user may not configure anything (and the relay
            # declared the queue when it made the user).
            queue = await channel.get_queue(self.queue, ensure=False)
            tag = await queue.consume(session.deliver, no_ack=False)
            self._connected = True
            self._status = "ok"
            self._consuming_since = time.monotonic()
            log.info(
                "consuming %s (prefetch %d, batch_max %d)", self.queue, self.prefetch,
                self.batch_max,
            )
            await self._consume(session)
            # Stopping: no more deliveries; those taken and not processed go back to the queue
            # when the channel closes.
            if session.closed is None:
                try:
                    await asyncio.wait_for(queue.cancel(tag), 5)
                except Exception as error:
                    log.debug("cancelling the consumer: %s", error)
        except Exception as error:
            cause = await session.why_closed(error)
            if cause is error:
                raise
            raise cause from error
        finally:
            self._connected = False
            try:
                await asyncio.wait_for(connection.close(), 5)
            except Exception as error:  # closing a broken connection: nothing more to do
                log.debug("closing the connection: %s", error)

    async def _consume(self, session: _Session) -> None:
        """Batches from the session's deliveries until a stop (returns) or the broker closes
        (raises)."""
        while not self._stop_requested:
            if session.closed is not None:
                raise session.closed
            try:
                first = await asyncio.wait_for(session.inbox.get(), 1.0)
            except asyncio.TimeoutError:
                await self._check_gaps()
                continue
            batch: list[aio_pika.abc.AbstractIncomingMessage] = []
            if not isinstance(first, _Wake):
                batch.append(first)
            while len(batch) < self.batch_max and not session.inbox.empty():
                taken = session.inbox.get_nowait()
                if not isinstance(taken, _Wake):
                    batch.append(taken)
            if session.closed is not None:
                raise session.closed
            if not batch or self._stop_requested:
                continue
            self._in_batch = len(batch)
            try:
                await self._process(batch)
            finally:
                self._in_batch = 0
            await self._check_gaps()

    # -- what it answers -----------------------------------------------------------------------

    def stats(self) -> ConsumerStats:
        """Counters since the consumer was made and, per endpoint id, its position (epoch,
        last change_seq applied), the changes held and the lag (now less the changed_at of the
        last change applied, as of the last commit)."""
        c = self._counters
        now = time.time()
        endpoints = {}
        for endpoint, position in sorted(self.follower.positions().items()):
            changed = self._changed_at.get(endpoint)
            endpoints[endpoint] = EndpointStats(
                epoch=position.epoch,
                last_change_seq=position.last_change_seq,
                held=self.follower.held_count(endpoint),
                lag_s=None if changed is None else max(0.0, now - changed),
            )
        return ConsumerStats(
            deliveries=c.deliveries,
            batches=c.batches,
            commits=c.commits,
            refused=c.refused,
            gaps_reported=c.gaps_reported,
            replays_asked=c.replays_asked,
            overflow_dropped=c.overflow_dropped,
            notifications_handed=c.notifications_handed,
            late_notifications=c.late_notifications,
            reconnects=c.reconnects,
            errors=c.errors_transient + c.errors_permanent,
            endpoints=endpoints,
        )

    def health(self) -> Health:
        """``status`` (``starting``, ``ok``, ``reconnecting``, ``stopped``, ``failed``), whether
        connected, when the last commit was and the last error."""
        at = self._last_commit_at
        return Health(
            status=self._status,
            connected=self._connected,
            last_commit_at=None if at is None else at.isoformat().replace("+00:00", "Z"),
            last_error=self._last_error,
        )

    def metrics_text(self) -> str:
        """The Prometheus text exposition (version 0.0.4) of :meth:`stats` and :meth:`health`."""
        stats = self.stats()
        c = self._counters
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{labels} {_number(value)}")

        metric("relay_consumer_deliveries_total", "counter",
               "Deliveries taken from the queue.", [("", stats.deliveries)])
        metric("relay_consumer_commits_total", "counter",
               "Batches committed to the store.", [("", stats.commits)])
        metric("relay_consumer_refused_total", "counter",
               "Deliveries refused (rejected to the dead-letter queue).", [("", stats.refused)])
        metric("relay_consumer_reconnects_total", "counter",
               "Reconnects after a transient failure.", [("", stats.reconnects)])
        metric("relay_consumer_errors_total", "counter", "Failures, by kind.",
               [('{kind="transient"}', c.errors_transient),
                ('{kind="permanent"}', c.errors_permanent)])
        metric("relay_consumer_up", "gauge",
               "1 while connected to the broker and consuming.",
               [("", 1 if self._connected else 0)])
        endpoints = stats.endpoints.items()
        metric("relay_consumer_last_change_seq", "gauge",
               "The last change_seq applied, per endpoint.",
               [(_endpoint(e), s.last_change_seq) for e, s in endpoints])
        metric("relay_consumer_lag_seconds", "gauge",
               "Now less the changed_at of the last change applied (as of the last commit).",
               [(_endpoint(e), s.lag_s) for e, s in endpoints if s.lag_s is not None])
        metric("relay_consumer_held", "gauge", "Changes held ahead of the next one.",
               [(_endpoint(e), s.held) for e, s in endpoints])
        return "\n".join(out) + "\n"

    # -- one batch -----------------------------------------------------------------------------

    async def _process(self, messages: list[aio_pika.abc.AbstractIncomingMessage]) -> None:
        batch = _Batch(messages=messages)
        self._counters.batches += 1
        self._counters.deliveries += len(messages)
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
        self._counters.refused += 1
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
            self._last_commit_at = datetime.datetime.now(datetime.timezone.utc)
            for step in batch.steps:
                if step.applied:
                    self._changed_at[step.endpoint_id] = _epoch_s(step.applied[-1].changed_at)
            self._counters.late_notifications += len(batch.late)
            for change in batch.late:
                log.info(
                    "endpoint %s: notified change %d of epoch %d, older than the epoch followed: "
                    "kept by story id %s (recorded unless it is already)",
                    change.endpoint_id,
                    change.change_seq,
                    change.epoch,
                    change.story_id,
                )
            self._counters.commits += 1
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
            self._counters.notifications_handed += 1
        await self.store.mark_handed(notifications)

    # -- gaps ----------------------------------------------------------------------------------

    async def _overflow(self, change: Change) -> None:
        """A change past the hold bounds: dropped (acknowledged) only when a replay asked of the
        relay will send it again; otherwise the consumer stops, acknowledging nothing more."""
        gap = self.follower.gap_before(change)
        await self._report_gap(gap)
        if self.api is None:
            raise CannotPlace(gap, "the hold bounds are reached and no api is given to replay")
        answer = await self._replay(gap)
        if answer is None or not (
            answer.epoch == change.epoch
            and answer.from_change_seq <= change.change_seq <= answer.through_change_seq
        ):
            raise CannotPlace(gap, "the hold bounds are reached and no replay resends it")
        self._counters.overflow_dropped += 1

    async def _check_gaps(self) -> None:
        now = time.monotonic()
        for gap in self.follower.gaps():
            if gap.waiting_s < self.gap_timeout_s:
                continue
            last = self._gap_reported.get(gap.endpoint_id)
            if last is not None and now - last < self.gap_timeout_s:
                continue
            self._gap_reported[gap.endpoint_id] = now
            await self._report_gap(gap)
            if self.api is not None:
                await self._replay(gap)

    async def _report_gap(self, gap: Gap) -> None:
        self._counters.gaps_reported += 1
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
        self._counters.replays_asked += 1
        log.info(
            "replay asked: endpoint %s epoch %d changes %d-%d",
            answer.endpoint_id,
            answer.epoch,
            answer.from_change_seq,
            answer.through_change_seq,
        )
        self._replayed[gap.endpoint_id] = _Replayed(answer, now)
        return answer


def _epoch_s(changed_at: str) -> float:
    """A change's ``changed_at`` (RFC 3339) as seconds since the epoch."""
    try:
        return datetime.datetime.fromisoformat(changed_at).timestamp()
    except ValueError:
        return time.time()


def _endpoint(endpoint_id: str) -> str:
    return '{endpoint="' + endpoint_id.replace("\\", "\\\\").replace('"', '\\"') + '"}'


def _number(value: float | None) -> str:
    if value is None:
        return "NaN"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))
