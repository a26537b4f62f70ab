"""Counter strategies, each built only on the store and cache interfaces."""

from shardkit.counters.base import CounterSettings
from shardkit.counters.sharded import ShardedCounter

__all__ = ["CounterSettings", "ShardedCounter"]
