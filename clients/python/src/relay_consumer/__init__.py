"""relay-consumer: keep an exact copy of the relay's endpoints from a tenant's queue.

Read the README for the lifecycle, the rules it applies, the stores, and how notifications are
handed once; clients/README.md is the design both libraries (this one and TypeScript's) follow.
"""

from ._version import __version__
from .consumer import (
    CannotPlace,
    Consumer,
    ConsumerStats,
    EndpointStats,
    Health,
    Refusal,
    Stopping,
)
from .errors import CAUSE_KINDS, CauseKind, ErrorReport, PermanentError
from .follower import Follower, Gap, Position, Step, Verdict
from .messages import (
    SUPPORTED_VERSION,
    Change,
    FeedChange,
    InvalidMessage,
    MessageRefused,
    PartsDiff,
    StoryChange,
    UnknownVersion,
    decode,
    message_id,
)
from .replay import RelayApi, ReplayAnswer, ReplayError, ResyncAnswer
from .store import (
    Handlers,
    Loaded,
    MemoryStore,
    Notification,
    PositionConflict,
    Store,
    StoreError,
    StoredItem,
    StoredStory,
)

__all__ = [
    "CAUSE_KINDS",
    "SUPPORTED_VERSION",
    "CannotPlace",
    "CauseKind",
    "Change",
    "Consumer",
    "ConsumerStats",
    "EndpointStats",
    "ErrorReport",
    "FeedChange",
    "Follower",
    "Gap",
    "Handlers",
    "Health",
    "InvalidMessage",
    "Loaded",
    "MemoryStore",
    "MessageRefused",
    "Notification",
    "PartsDiff",
    "PermanentError",
    "Position",
    "PositionConflict",
    "Refusal",
    "RelayApi",
    "ReplayAnswer",
    "ReplayError",
    "ResyncAnswer",
    "Step",
    "Stopping",
    "Store",
    "StoreError",
    "StoredItem",
    "StoredStory",
    "StoryChange",
    "UnknownVersion",
    "Verdict",
    "decode",
    "message_id",
    "__version__",
]
