"""shardkit: counters that take far more writes than one row can, and parallel visits
of huge tables.

>>> import shardkit
>>> kit = shardkit.connect()            # sqlite:///shardkit.db + memory://
>>> votes = kit.sharded("votes:poll-7", shards=20)
>>> votes.incr()
>>> hits = kit.buffered("downloads:file-9", interval=5.0)
>>> hits.incr()
>>> job = kit.map(accounts, add_credit, key="id", transactional=True)  # a Table
>>> job.wait()
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
    CounterOverflow,
    FlushFailed,
    InvalidDelta,
    InvalidName,
    InvalidShardCount,
    JobFailed,
    JobNotFound,
    JobTimeout,
    MissingDriver,
    ShardkitError,
    StoreNotFound,
    UnsupportedKey,
    UntrustedPayload,
    ValidationError,
)
from shardkit.kit import Kit, connect
from shardkit.mapper import Batch, Completion, Job, JobStatus
from shardkit.store import CounterInfo

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "Batch",
    "BufferedCounter",
    "Completion",
    "ConfigurationError",
    "CounterInfo",
    "CounterKindMismatch",
    "CounterNotFound",
    "CounterOverflow",
    "FlushFailed",
    "IdAllocator",
    "InvalidDelta",
    "InvalidName",
    "InvalidShardCount",
    "Job",
    "JobFailed",
    "JobNotFound",
    "JobStatus",
    "JobTimeout",
    "Kit",
    "MissingDriver",
    "MonotonicCounter",
    "Parts",
    "ShardedCounter",
    "ShardkitError",
    "StoreNotFound",
    "UnsupportedKey",
    "UntrustedPayload",
    "ValidationError",
    "connect",
]
