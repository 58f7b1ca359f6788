"""relay-consumer: keep an exact copy of the relay's endpoints from a tenant's queue.

Read the README for the rules it applies, the stores, and how notifications are handed once.
"""

from .consumer import CannotPlace, Consumer, ConsumerStats, Refusal
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

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_VERSION",
    "CannotPlace",
    "Change",
    "Consumer",
    "ConsumerStats",
    "FeedChange",
    "Follower",
    "Gap",
    "Handlers",
    "InvalidMessage",
    "Loaded",
    "MemoryStore",
    "MessageRefused",
    "Notification",
    "PartsDiff",
    "Position",
    "PositionConflict",
    "Refusal",
    "RelayApi",
    "ReplayAnswer",
    "ReplayError",
    "ResyncAnswer",
    "Step",
    "Store",
    "StoreError",
    "StoredItem",
    "StoredStory",
    "StoryChange",
    "UnknownVersion",
    "Verdict",
    "decode",
    "message_id",
]
