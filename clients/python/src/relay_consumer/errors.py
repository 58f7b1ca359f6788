"""The lifecycle's two kinds of failure (clients/README.md, "Lifecycle").

*Transient*: the broker connection or channel lost or closed (a management-API close,
``CONNECTION_FORCED``, a broker restart, a network blip), the broker not answering, the store's
database restarting or unreachable, a serialization failure. The consumer reconnects, forever,
with full-jitter backoff.

*Permanent*: the broker refusing the credentials (``ACCESS_REFUSED``), the queue not found
(``NOT_FOUND``), the store's database not existing (``3D000``) or refusing the credentials
(``28P01``, ``28000``), the store's schema newer than this library's. ``run()`` ends with
:class:`PermanentError`, whose ``cause_kind`` names which.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

import aio_pika.exceptions
import aiormq.exceptions
import psycopg

CauseKind: TypeAlias = Literal[
    "broker_auth", "queue_not_found", "store_missing", "store_auth", "schema_newer"
]

CAUSE_KINDS: Final[tuple[CauseKind, ...]] = (
    "broker_auth",
    "queue_not_found",
    "store_missing",
    "store_auth",
    "schema_newer",
)


class PermanentError(Exception):
    """A failure a reconnect does not cure: ``run()`` ends with it, after closing what was open.

    ``cause_kind`` is one of ``broker_auth``, ``queue_not_found``, ``store_missing``,
    ``store_auth``, ``schema_newer``; the error that caused it (when there is one) is
    ``__cause__``.
    """

    def __init__(self, cause_kind: CauseKind, message: str) -> None:
        super().__init__(f"{cause_kind}: {message}")
        self.cause_kind: CauseKind = cause_kind
        self.message = message


@dataclass(frozen=True, slots=True)
class ErrorReport:
    """What ``on_error`` is given, once per failure.

    ``transient`` is True for a failure the consumer reconnects after (``next_wait_s`` is the
    wait before it tries again, ``cause_kind`` None), False for a permanent one (``cause_kind``
    names it, ``next_wait_s`` is None; ``run()`` raises :class:`PermanentError` right after).
    """

    transient: bool
    cause: BaseException
    next_wait_s: float | None
    cause_kind: CauseKind | None = None

    def describe(self) -> str:
        return describe(self.cause)


def describe(error: BaseException) -> str:
    text = str(error).strip().replace("\n", " ")
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# The server's messages for the connection failures libpq reports without an SQLSTATE (a
# failure while connecting has no result to read one from): Postgres's own texts, in English.
_PG_MISSING = re.compile(r'database "[^"]*" does not exist')
_PG_AUTH = re.compile(
    r"password authentication failed|role \"[^\"]*\" does not exist|no pg_hba\.conf entry"
    r"|(Ident|Peer|SSPI|GSSAPI|LDAP|RADIUS|certificate) authentication failed"
    r"|is not permitted to log in|fe_sendauth: no password supplied"
    r"|SCRAM authentication requires libpq"
)


def pg_cause(error: psycopg.Error) -> CauseKind | None:
    """The permanent cause of a Postgres error, or None for a transient one."""
    state = error.sqlstate
    if state == "3D000":
        return "store_missing"
    if state in ("28P01", "28000"):
        return "store_auth"
    if state is None and isinstance(error, psycopg.OperationalError):
        text = str(error)
        if _PG_MISSING.search(text):
            return "store_missing"
        if _PG_AUTH.search(text):
            return "store_auth"
    return None


def classify(error: BaseException) -> CauseKind | Literal["transient"] | None:
    """A permanent cause, ``"transient"``, or None for an error the lifecycle does not know
    (a bug, a user's callback raising): that one ends ``run()`` as it is."""
    if isinstance(error, PermanentError):
        return error.cause_kind
    if isinstance(error, aiormq.exceptions.ProbableAuthenticationError):
        # aiormq says "probable": the broker closed the connection during the handshake. Only
        # its ACCESS_REFUSED is the credentials; anything else (a broker going down) is not.
        return "broker_auth" if "ACCESS_REFUSED" in str(error) else "transient"
    if isinstance(error, aiormq.exceptions.ChannelAccessRefused):
        return "broker_auth"
    if isinstance(error, aiormq.exceptions.ChannelNotFoundEntity):
        return "queue_not_found"
    if isinstance(error, psycopg.Error):
        return pg_cause(error) or "transient"
    cause = error.__cause__
    if cause is not None and isinstance(cause, psycopg.Error):
        kind = pg_cause(cause)
        if kind is not None:
            return kind
    if isinstance(
        error,
        (
            aio_pika.exceptions.AMQPException,
            aiormq.exceptions.AMQPError,
            aiormq.exceptions.ChannelInvalidStateError,
            ConnectionError,
            OSError,
            asyncio.TimeoutError,
            TimeoutError,
            EOFError,
        ),
    ):
        return "transient"
    from .store import StoreError  # the store's wrapper of its own failures

    if isinstance(error, StoreError):
        return "transient"
    return None
