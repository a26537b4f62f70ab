"""The cache-held monotonic counter: the live value is a cache key, the store keeps shards
holding the highest values seen, and a cold cache is repopulated from their maximum.

Fast (an increment is one cache round trip) and fine for statistics, but not for ids:
when the cache loses the key, the values handed out since the last persisted one are
handed out again. ``chance_to_write`` trades store writes for fewer repeats; the ids
allocator (``Kit.ids``) is the safe alternative.
"""

from __future__ import annotations

from collections.abc import Callable

from shardkit import metrics
from shardkit._program import Blocking, Program, call, rule
from shardkit.cache.base import Cache
from shardkit.counters.base import (
    CounterCore,
    Options,
    best_effort,
    incarnation_key,
)
from shardkit.errors import BackendError, CounterOverflow, InvalidDelta
from shardkit.store.base import CounterInfo, Deleted, Store
from shardkit.validation import INT64_MAX, check_chance

# A cache that loses the key again and again between a populate and the increment
# gives up after this many tries.
_ATTEMPTS = 5
_PERSISTING = metrics.action("persisting a maximum")


class MonotonicCore(CounterCore):
    """The monotonic counter's rules, for its sync and async forms (see
    ``MonotonicCounter``); its programs run on ``CounterRoles``."""

    kind = "monotonic"
    """The counter's kind."""

    def __init__(
        self,
        info: CounterInfo,
        options: Options,
        chance_to_write: float,
        random: Callable[[], float],
    ) -> None:
        super().__init__(info, options)
        self.shards = info.shards
        """Rows the value is persisted to (a random one each time)."""
        self.chance_to_write = check_chance(chance_to_write)
        """The probability that an increment persists its value to the store."""
        self._random = random
        self._value_key = value_key(options, info)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name!r} shards={self.shards} "
            f"chance_to_write={self.chance_to_write}>"
        )

    @rule
    def incr(self, delta: int = 1) -> Program[int]:
        """Add ``delta`` (an int ≥ 1) and return the new value. An increment that would
        take the value past 2**63 - 1 raises ``CounterOverflow`` and counts nothing.

        A call that raises ``BackendError`` may or may not have counted.
        """
        if isinstance(delta, bool) or not isinstance(delta, int) or not 1 <= delta <= INT64_MAX:
            raise InvalidDelta(f"a monotonic counter takes deltas ≥ 1, not {delta!r}")
        return metrics.timed(self.kind, self._add(delta))

    def _add(self, delta: int) -> Program[int]:
        if self._look_due(self._options.cache_ttl):
            yield from self._follow()
        for _ in range(_ATTEMPTS):
            value = yield from call(Cache.incr, self._value_key, delta)
            if value is not None:
                break
            yield from self._populate(create=True)  # evicted, or never populated
        else:
            raise BackendError(f"the cache kept losing counter {self.name!r}")
        if value > INT64_MAX:  # past what the store holds (Redis refuses it by itself)
            yield from call(Cache.incr, self._value_key, -delta)
            raise CounterOverflow(f"counter {self.name!r} would pass signed 64-bit; not counted")
        if self._random() < self.chance_to_write:
            # The value is handed out whatever happens to this write: failing the call
            # would only hide a value that the cache has already moved past.
            persisting = call(Store.raise_max, self.info, self._random_shard(), value)
            yield from best_effort(self._options, _PERSISTING, persisting)
        return value

    def _populate(self, *, create: bool) -> Program[None]:
        """Put the persisted maximum in the cache unless a value is there already (of the
        incarnation the store holds, created for a write: ``CounterCore._follow``)."""
        yield from self._follow(create=create)
        persisted = yield from MonotonicCore.persisted.program(self)
        yield from call(Cache.add, self._value_key, persisted, None)

    def _moved(self) -> None:
        self.shards = self.info.shards
        self._value_key = value_key(self._options, self.info)

    @rule
    def checkpoint(self) -> Program[None]:
        """Persist the current cached value now (e.g. before a planned cache restart, or
        as closing the kit does for a private, per-process cache)."""
        cached = yield from call(Cache.get, self._value_key)
        if cached is not None:
            yield from call(Store.raise_max, self.info, self._random_shard(), cached)

    def _random_shard(self) -> int:
        return min(int(self._random() * self.shards), self.shards - 1)

    @rule
    def value(self) -> Program[int]:
        """The current value: the cache's, populating it from the store if needed."""
        if self._look_due(self._options.cache_ttl):
            yield from self._follow(create=False)
        cached = yield from call(Cache.get, self._value_key)
        if cached is None:
            yield from self._populate(create=False)
            cached = yield from call(Cache.get, self._value_key)
        return (yield from MonotonicCore.persisted.program(self)) if cached is None else cached

    @rule
    def persisted(self) -> Program[int]:
        """The highest value persisted in the store."""
        maxima = yield from call(Store.maxima, [self.name])
        return maxima[self.name]


def value_key(options: Options, info: CounterInfo) -> str:
    """The cache key that holds the value of a monotonic counter's incarnation ``info``."""
    return incarnation_key(options, info, "monotonic:value")


def forget(options: Options, deleted: Deleted) -> Program[None]:
    """Remove the cached value of the deleted monotonic counter ``deleted``."""
    yield from call(Cache.delete, value_key(options, deleted.info))


class MonotonicCounter(MonotonicCore, Blocking):
    """A counter whose value lives in the cache and only grows while the cache keeps it.

    Guarantees:

    * ``incr`` is one atomic cache increment and returns the new value: while the cache
      keeps the key, no two calls return the same value and values only grow.
    * With probability ``chance_to_write`` the new value is also persisted, to a random
      one of ``shards`` rows, as max(stored, new) in one atomic statement.
    * When the cache has lost the key it is repopulated with the maximum persisted over
      the shards, added only if absent (a concurrent populate never overwrites a newer
      value). So after a cache loss the values since the last persisted one are handed
      out again — never use it for ids (see ``Kit.ids``).

    Thread-safe; usable in a forked child.
    """
