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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
        KeysUnsupported,
        MissingDriver,
        ShardkitError,
        StoreNotFound,
        UnsupportedKey,
        UntrustedPayload,
        ValidationError,
    )
    from shardkit.kit import Kit, connect
    from shardkit.mapper import Batch, Completion, Job, JobStatus
    from shardkit.options import KitOptions
    from shardkit.store import CounterInfo

_WHERE = {  # each public name, and the module it is imported from when first used
    "BackendError": "shardkit.errors",
    "BackendUnavailable": "shardkit.errors",
    "Batch": "shardkit.mapper",
    "BufferedCounter": "shardkit.counters",
    "Completion": "shardkit.mapper",
    "ConfigurationError": "shardkit.errors",
    "CounterInfo": "shardkit.store",
    "CounterKindMismatch": "shardkit.errors",
    "CounterNotFound": "shardkit.errors",
    "CounterOverflow": "shardkit.errors",
    "FlushFailed": "shardkit.errors",
    "IdAllocator": "shardkit.counters",
    "InvalidDelta": "shardkit.errors",
    "InvalidName": "shardkit.errors",
    "InvalidShardCount": "shardkit.errors",
    "Job": "shardkit.mapper",
    "JobFailed": "shardkit.errors",
    "JobNotFound": "shardkit.errors",
    "JobStatus": "shardkit.mapper",
    "JobTimeout": "shardkit.errors",
    "Kit": "shardkit.kit",
    "KeysUnsupported": "shardkit.errors",
    "KitOptions": "shardkit.options",
    "MissingDriver": "shardkit.errors",
    "MonotonicCounter": "shardkit.counters",
    "Parts": "shardkit.counters",
    "ShardedCounter": "shardkit.counters",
    "ShardkitError": "shardkit.errors",
    "StoreNotFound": "shardkit.errors",
    "UnsupportedKey": "shardkit.errors",
    "UntrustedPayload": "shardkit.errors",
    "ValidationError": "shardkit.errors",
    "connect": "shardkit.kit",
}


def __getattr__(name: str) -> Any:
    """The public names are imported when first used (``shardkit --help`` and a script
    that needs one counter import no more than they use): a name of ``__all__`` from
    its module, or a submodule."""
    module = _WHERE.get(name)
    if module is None:
        try:
            return importlib.import_module(f"shardkit.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"shardkit.{name}":
                raise
            raise AttributeError(f"module 'shardkit' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
    "KeysUnsupported",
    "Kit",
    "KitOptions",
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
