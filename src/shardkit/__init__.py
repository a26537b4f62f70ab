"""shardkit: counters that take far more writes than one row can.

>>> import shardkit
>>> kit = shardkit.connect()            # sqlite:///shardkit.db + memory://
>>> votes = kit.sharded("votes:poll-7", shards=20)
>>> votes.incr()
>>> hits = kit.buffered("downloads:file-9", interval=5.0)
>>> hits.incr()
"""

from shardkit.counters import (
    BufferedCounter,
    IdAllocator,
    MonotonicCounter,
    Parts,
    ShardedCounter,
)
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
    "BufferedCounter",
    "ConfigurationError",
    "CounterInfo",
    "CounterKindMismatch",
    "CounterNotFound",
    "IdAllocator",
    "InvalidDelta",
    "InvalidName",
    "InvalidShardCount",
    "Kit",
    "MissingDriver",
    "MonotonicCounter",
    "Parts",
    "ShardedCounter",
    "ShardkitError",
    "ValidationError",
    "connect",
]
