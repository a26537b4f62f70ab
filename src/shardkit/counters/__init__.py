"""Counter strategies, each built only on the store, cache and executor interfaces."""

from shardkit.counters.base import CounterSettings
from shardkit.counters.buffered import BufferedCounter
from shardkit.counters.generations import Parts
from shardkit.counters.ids import IdAllocator
from shardkit.counters.monotonic import MonotonicCounter
from shardkit.counters.sharded import ShardedCounter

__all__ = [
    "BufferedCounter",
    "CounterSettings",
    "IdAllocator",
    "MonotonicCounter",
    "Parts",
    "ShardedCounter",
]
