"""shardkit: counters that take far more writes than one row can.

>>> import shardkit
>>> kit = shardkit.connect()            # sqlite:///shardkit.db + memory://
>>> votes = kit.sharded("votes:poll-7", shards=20)
>>> votes.incr()
"""

from shardkit.counters import ShardedCounter
from shardkit.errors import (
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    CounterKindMismatch,
    CounterNotFound,
    InvalidDelta,
    InvalidName,
    InvalidShardCount,
    MissingDriver,
    ShardkitError,
    ValidationError,
)
from shardkit.kit import Kit, connect
from shardkit.store import CounterInfo

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "ConfigurationError",
    "CounterInfo",
    "CounterKindMismatch",
    "CounterNotFound",
    "InvalidDelta",
    "InvalidName",
    "InvalidShardCount",
    "Kit",
    "MissingDriver",
    "ShardedCounter",
    "ShardkitError",
    "ValidationError",
    "connect",
]
