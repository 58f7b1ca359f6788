"""The stream rules, pure: which change to apply, hold, or drop. No IO.

Mirrors the relay's reference consumer (``services/publisher/src/consumer.rs``). Per endpoint it
keeps the epoch it follows and the last change_seq applied in it:

* a change of an older epoch is stale: dropped (the caller records it anyway when it is a
  ``notified`` change: a notification is a claim of its own, keyed by story id, that the
  relay does not send again in the new epoch when the old one published it);
* a greater epoch starts over at change_seq 0 (the older epoch's held changes are dropped:
  its stream is over; the step that switches names them in ``stale``, for the same reason);
* a change_seq already applied, or already held, is a repeat: dropped;
* the next change_seq is applied, and with it every held change that now follows;
* one further ahead is held until its predecessors come, within the bounds given: past them
  it is an overflow, which the caller decides about (nothing is changed).

``snapshot_begin`` (forgetting what was held of the endpoint) is the store's to apply: to the
stream it is change 1 of its epoch like any other.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from .messages import Change


@dataclass(frozen=True, slots=True)
class Position:
    """An endpoint's place in its stream: (0, 0) before anything."""

    epoch: int = 0
    last_change_seq: int = 0


class Verdict(enum.Enum):
    APPLIED = "applied"
    HELD = "held"
    DUPLICATE = "duplicate"
    STALE = "stale"
    OVERFLOW = "overflow"


@dataclass(frozen=True, slots=True)
class Step:
    """What a store writes, in one transaction with the rest of a batch, for one change received.

    ``before`` is the endpoint's position the step starts from: a store refuses a step whose
    ``before`` is not the position it holds (a racing consumer, or a repeat), rolling back.
    ``applied`` are the changes to apply in order (the one received, then the held ones it
    released); ``held`` the change to keep until its predecessors come. ``stale`` are the older
    epoch's held changes a step to a greater epoch dropped (in change_seq order): a store
    forgets them with the step; the caller picks out the ``notified`` ones, which are recorded
    anyway (:meth:`Store.commit`'s ``late``).
    """

    endpoint_id: str
    before: Position
    after: Position
    applied: tuple[Change, ...] = ()
    held: Change | None = None
    stale: tuple[Change, ...] = ()

    @property
    def new_epoch(self) -> bool:
        return self.after.epoch > self.before.epoch


@dataclass(frozen=True, slots=True)
class Gap:
    """Changes of an endpoint that have not come while later ones are held."""

    endpoint_id: str
    epoch: int
    #: Missing change_seqs as inclusive ranges, in order (each between what is applied or held).
    missing: tuple[tuple[int, int], ...]
    #: How many changes are held past the gap.
    held: int
    #: Seconds since the endpoint first waited for the gap's first change.
    waiting_s: float

    @property
    def first_missing(self) -> int:
        return self.missing[0][0]

    def missing_change_seqs(self, limit: int = 10_000) -> list[int]:
        seqs: list[int] = []
        for first, last in self.missing:
            for seq in range(first, last + 1):
                if len(seqs) >= limit:
                    return seqs
                seqs.append(seq)
        return seqs


@dataclass(slots=True)
class _Endpoint:
    epoch: int = 0
    last: int = 0
    held: dict[int, Change] = field(default_factory=dict)
    #: When the endpoint began waiting for its next change (monotonic), while it holds any.
    waiting_since: float | None = None


@dataclass(slots=True)
class Counts:
    received: int = 0
    applied: int = 0
    held: int = 0
    duplicates: int = 0
    stale: int = 0
    overflows: int = 0


class Follower:
    """Follows every endpoint's stream of one tenant's queue."""

    def __init__(
        self,
        *,
        max_held_per_endpoint: int = 1_000,
        max_held_total: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_held_per_endpoint < 1 or max_held_total < 1:
            raise ValueError("the hold bounds are 1 or more")
        self.max_held_per_endpoint = max_held_per_endpoint
        self.max_held_total = max_held_total
        self._clock = clock
        self._endpoints: dict[str, _Endpoint] = {}
        self._held_total = 0
        self.counts = Counts()

    def restore(self, positions: Mapping[str, Position], held: Iterable[Change] = ()) -> None:
        """Starts from what a store kept: positions and held changes (held ones not ahead of
        their endpoint's position, or of another epoch, are ignored)."""
        self._endpoints = {
            e: _Endpoint(epoch=p.epoch, last=p.last_change_seq) for e, p in positions.items()
        }
        self._held_total = 0
        now = self._clock()
        for change in held:
            state = self._endpoints.get(change.endpoint_id)
            if state is None or change.epoch != state.epoch or change.change_seq <= state.last:
                continue
            if change.change_seq not in state.held:
                state.held[change.change_seq] = change
                self._held_total += 1
                state.waiting_since = now

    def position(self, endpoint_id: str) -> Position:
        state = self._endpoints.get(endpoint_id)
        return Position() if state is None else Position(state.epoch, state.last)

    def positions(self) -> dict[str, Position]:
        return {e: Position(s.epoch, s.last) for e, s in self._endpoints.items()}

    @property
    def held_total(self) -> int:
        return self._held_total

    def held_count(self, endpoint_id: str) -> int:
        state = self._endpoints.get(endpoint_id)
        return 0 if state is None else len(state.held)

    def receive(self, change: Change) -> tuple[Verdict, Step | None]:
        """Decides about one change; a step (for APPLIED and HELD) says what to write."""
        self.counts.received += 1
        state = self._endpoints.get(change.endpoint_id)
        if state is None:
            state = self._endpoints[change.endpoint_id] = _Endpoint()
        epoch, seq = change.epoch, change.change_seq
        if epoch < state.epoch:
            self.counts.stale += 1
            return Verdict.STALE, None
        before = Position(state.epoch, state.last)
        switching = epoch > state.epoch
        last = 0 if switching else state.last
        if not switching and (seq <= last or seq in state.held):
            self.counts.duplicates += 1
            return Verdict.DUPLICATE, None
        if seq > last + 1:
            kept_here = 0 if switching else len(state.held)
            kept_total = self._held_total - (len(state.held) if switching else 0)
            if kept_here >= self.max_held_per_endpoint or kept_total >= self.max_held_total:
                self.counts.overflows += 1
                return Verdict.OVERFLOW, None
            stale = self._switch(state, epoch, switching)
            state.held[seq] = change
            self._held_total += 1
            if state.waiting_since is None:
                state.waiting_since = self._clock()
            self.counts.held += 1
            return Verdict.HELD, Step(
                change.endpoint_id, before, Position(epoch, state.last), held=change, stale=stale
            )
        stale = self._switch(state, epoch, switching)
        applied = [change]
        state.last = seq
        while (following := state.held.pop(state.last + 1, None)) is not None:
            self._held_total -= 1
            applied.append(following)
            state.last += 1
        state.waiting_since = self._clock() if state.held else None
        self.counts.applied += len(applied)
        return Verdict.APPLIED, Step(
            change.endpoint_id,
            before,
            Position(epoch, state.last),
            applied=tuple(applied),
            stale=stale,
        )

    def _switch(self, state: _Endpoint, epoch: int, switching: bool) -> tuple[Change, ...]:
        """Moves to a greater epoch (when ``switching``): answers the older epoch's held
        changes, dropped, in change_seq order."""
        if not switching:
            return ()
        stale = tuple(change for _, change in sorted(state.held.items()))
        self.counts.stale += len(state.held)
        self._held_total -= len(state.held)
        state.held.clear()
        state.epoch = epoch
        state.last = 0
        state.waiting_since = None
        return stale

    def gaps(self) -> list[Gap]:
        """Every endpoint waiting for changes that have not come, with the change_seqs missing."""
        return [
            self._gap(endpoint_id, state, None)
            for endpoint_id, state in sorted(self._endpoints.items())
            if state.held
        ]

    def gap_before(self, change: Change) -> Gap:
        """The gap a change past the bounds (an overflow) waits on: what is missing before it."""
        state = self._endpoints.get(change.endpoint_id)
        if state is None or state.epoch != change.epoch:
            state = _Endpoint(epoch=change.epoch)
        return self._gap(change.endpoint_id, state, change.change_seq)

    def _gap(self, endpoint_id: str, state: _Endpoint, upto: int | None) -> Gap:
        missing: list[tuple[int, int]] = []
        expected = state.last + 1
        seqs = sorted(state.held)
        if upto is not None:
            seqs.append(upto)
        for seq in seqs:
            if seq > expected:
                missing.append((expected, seq - 1))
            expected = max(expected, seq + 1)
        now = self._clock()
        since = state.waiting_since if state.waiting_since is not None else now
        return Gap(endpoint_id, state.epoch, tuple(missing), len(state.held), now - since)
