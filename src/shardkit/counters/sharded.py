"""The sharded counter: many rows per counter, so concurrent writers rarely share a lock."""

from __future__ import annotations

import os
import random
import threading
import time

from shardkit.counters.base import CounterSettings
from shardkit.errors import BackendError
from shardkit.store.base import CounterInfo
from shardkit.validation import check_delta, check_name, check_shards

# How often a writer re-reads the shard count, to follow a grow() made elsewhere.
_SHARDS_REFRESH = 10.0
# A keyed write purges expired idempotency keys with this probability.
_PURGE_CHANCE = 1 / 1000
# Kinds of cache failures that the counter rides out (logged by the kit's FailureLog).
_TICKET = "taking a shard ticket"
_READ = "reading a cached value"


class ShardedCounter:
    """An exact counter spread over ``shards`` rows of the store.

    Guarantees:

    * Every increment that returns has been committed, exactly once: one atomic upsert
      adds the delta to one shard row (created on first use). A call that raises
      ``BackendError`` may or may not have been applied; retry it with an idempotency
      ``key`` to make the retry safe.
    * With ``key``, the key is recorded in the same transaction as the write, so a
      repeated call with the same key (racing or later, while the key is retained) is a
      no-op.
    * ``value(fresh=True)`` is exact: the sum of whatever shard rows exist, so growing
      the shard count never changes the value. ``value()`` serves the cached sum when
      present: it may differ from the exact value by writes racing with the cache fill,
      for at most ``cache_ttl`` seconds.

    Each writing thread has a *home shard*, handed out round-robin through the cache, so
    up to ``shards`` concurrent writers (across processes, with a shared cache) each
    write their own row and never wait on another's row lock.

    Thread-safe; usable in a forked child.
    """

    kind = "sharded"

    def __init__(self, info: CounterInfo, settings: CounterSettings) -> None:
        self.name = info.name
        self._settings = settings
        self._shards = info.shards
        self._shards_read_at = time.monotonic()
        self._value_key = settings.cache_key(self.name, "sharded:value")
        self._ticket_key = settings.cache_key(self.name, "sharded:ticket")
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"<ShardedCounter {self.name!r} shards={self._shards}>"

    # -- writes ------------------------------------------------------------------------

    def incr(self, delta: int = 1, *, key: str | None = None) -> bool:
        """Add ``delta`` (an int within signed 64-bit, may be negative).

        Returns True when applied, False when ``key`` had been applied already.
        """
        return self._add(check_delta(delta), key)

    def decr(self, delta: int = 1, *, key: str | None = None) -> bool:
        """Subtract ``delta``; the same contract as ``incr``."""
        return self._add(check_delta(-check_delta(delta)), key)

    def _add(self, delta: int, key: str | None) -> bool:
        settings = self._settings
        if key is not None:
            check_name(key, "idempotency key")
        applied = settings.store.add(self.name, self._home_shard(), delta, key)
        if applied:
            settings.best_effort("adjusting a cached value", lambda: self._adjust(delta))
        if key is not None and settings.random() < _PURGE_CHANCE:
            settings.store.purge_keys(time.time() - settings.key_retention)
        return applied

    def _adjust(self, delta: int) -> None:
        """Move the cached value by ``delta``; if the cache fails to, drop the value, so
        that the next read goes to the store rather than serve it stale for its TTL."""
        cache = self._settings.cache
        try:
            cache.incr(self._value_key, delta)
        except BackendError:
            cache.delete(self._value_key)
            raise

    def _home_shard(self) -> int:
        # Keyed by process: a forked child takes its own ticket, not its parent's shard.
        pid, ticket = getattr(self._local, "ticket", (None, 0))
        if pid != os.getpid():
            ticket = self._take_ticket()
            self._local.ticket = (os.getpid(), ticket)
        if time.monotonic() - self._shards_read_at > _SHARDS_REFRESH:
            self._refresh_shards()
        return ticket % self._shards

    def _take_ticket(self) -> int:
        """A number unique among this counter's writers while the cache keeps it; the
        first writer seeds it at random so that private (per-process) caches still
        spread their processes over the shards."""
        cache, failures = self._settings.cache, self._settings.failures
        try:
            cache.add(self._ticket_key, random.randrange(1 << 30), 86400)
            ticket = cache.incr(self._ticket_key, 1)
        except BackendError as exc:
            failures.failed(_TICKET, "cache %s failed while %s: %s", cache.url, _TICKET, exc)
            ticket = None
        else:
            failures.worked(_TICKET)
        return random.randrange(1 << 30) if ticket is None else ticket

    def _refresh_shards(self) -> None:
        info = self._settings.store.counter(self.name)
        if info is not None:
            self._shards = max(self._shards, info.shards)
        self._shards_read_at = time.monotonic()

    def grow(self, shards: int) -> int:
        """Raise the shard count to ``shards`` (never lowers it); return the new count.

        The value is unchanged: it is the sum of the rows, and new rows start empty.
        """
        check_shards(shards, self._settings.max_shards)
        info = self._settings.store.open_counter(self.name, self.kind, shards)
        self._shards = info.shards
        self._shards_read_at = time.monotonic()
        return info.shards

    # -- reads -------------------------------------------------------------------------

    @property
    def shards(self) -> int:
        """The current shard count, read from the store."""
        self._refresh_shards()
        return self._shards

    def value(self, *, fresh: bool = False) -> int:
        """The counter's value: cached (stale by at most ``cache_ttl``) unless ``fresh``."""
        settings = self._settings
        if not fresh:
            try:
                cached = settings.cache.get(self._value_key)
            except BackendError as exc:
                url = settings.cache.url
                settings.failures.failed(_READ, "cache %s failed while %s: %s", url, _READ, exc)
                cached = None
            else:
                settings.failures.worked(_READ)
            if cached is not None:
                return cached
        total = settings.store.total(self.name)
        if not fresh:
            settings.best_effort(
                "caching a value",
                lambda: settings.cache.add(self._value_key, total, settings.cache_ttl),
            )
        return total
