"""The sharded counter: many rows per counter, so concurrent writers rarely share a lock."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Sequence

from shardkit._combine import Combiner
from shardkit.counters.base import CounterSettings
from shardkit.errors import BackendError, ShardkitError
from shardkit.store.base import CounterInfo
from shardkit.validation import check_delta, check_name, check_shards, sums_fit

# How often a writer re-reads the shard count, to follow a grow() made elsewhere.
_SHARDS_REFRESH = 10.0
# A keyed write purges expired idempotency keys with this probability.
_PURGE_CHANCE = 1 / 1000
# Kinds of cache failures that the counter rides out (logged by the kit's FailureLog).
_TICKET = "taking a shard ticket"
_READ = "reading a cached value"

_Write = tuple[int, str | None]  # (delta, idempotency key)


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
      present, which writes move off their callers' path (see ``Adjuster``): it shows
      every write of the calling process, and another process's within about the
      kit's ``adjust_delay`` (0.02 s); writes racing with the cache's fill (read from the
      store on a miss) may be missing from it or counted twice, for at most
      ``cache_ttl`` seconds.
    * Concurrent increments from threads of one process are combined (except on a
      Django store, where each belongs to its caller's transaction): one statement
      carries them all (one transaction, with idempotency keys), and each call returns
      once that has committed. It applies all of them or none: when it fails, every call
      in it raises.

    Each writing thread has a *home shard*, handed out round-robin through the cache, so
    up to ``shards`` concurrent writers (processes, with a shared cache; threads whose
    writes are not combined) each write their own row and never wait on another's row
    lock.

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
        # Concurrent writes from this process's threads share one statement, unless each
        # belongs to its caller's transaction.
        self._combiner = Combiner(self._write) if settings.store.combinable else None

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
        if self._combiner is None:
            applied = self._write([(delta, key)])[0]
        else:
            applied = self._combiner((delta, key))
        if isinstance(applied, ShardkitError):
            raise applied
        if key is not None and settings.random() < _PURGE_CHANCE:
            settings.store.purge_keys(time.time() - settings.key_retention)
        return applied

    def _write(self, writes: Sequence[_Write]) -> list[bool | ShardkitError]:
        """Write a batch of ``(delta, key)`` to this thread's home shard, in one statement
        (or transaction, with keys); then leave the applied sum to the kit's adjuster.
        Writes that might sum outside signed 64-bit are made one by one, each with its
        own outcome."""
        store, shard = self._settings.store, self._home_shard()
        if len(writes) > 1 and not sums_fit([delta for delta, _ in writes]):
            outcomes: list[bool | ShardkitError] = []
            for write in writes:
                try:
                    outcomes.extend(self._write([write]))
                except ShardkitError as exc:
                    outcomes.append(exc)
            return outcomes
        applied = store.add_many(self.name, shard, writes)
        moved = sum(delta for (delta, _), ok in zip(writes, applied, strict=True) if ok)
        if moved:
            self._settings.adjuster.add(self._value_key, moved)
        return list(applied)

    def _home_shard(self) -> int:
        # Keyed by process: a forked child takes its own ticket, not its parent's shard.
        pid, ticket = getattr(self._local, "ticket", (None, 0))
        if pid != os.getpid():
            ticket = take_ticket(self._settings, self._ticket_key)
            self._local.ticket = (os.getpid(), ticket)
        if time.monotonic() - self._shards_read_at > _SHARDS_REFRESH:
            self._refresh_shards()
        return ticket % self._shards

    def _refresh_shards(self) -> None:
        info = self._settings.store.counter(self.name)
        if info is not None:
            self._shards = max(self._shards, info.shards)
        self._shards_read_at = time.monotonic()

    def applied(self, delta: int) -> None:
        """Note that a statement of the caller's own has added ``delta`` to this counter's
        shard rows (the Django app's counting updates write them in the statement that
        finds the objects): its cached value is moved as an increment's would be."""
        self._settings.adjuster.add(self._value_key, check_delta(delta))

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
            settings.adjuster.sync()  # this process's own writes are in what it reads
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


def take_ticket(settings: CounterSettings, key: str) -> int:
    """A number unique among the takers of ``key``'s tickets while the cache keeps it, to
    pick a home shard by; the first taker seeds it at random, so that private
    (per-process) caches still spread their processes over the shards."""
    cache, failures = settings.cache, settings.failures
    try:
        cache.add(key, random.randrange(1 << 30), 86400)
        ticket = cache.incr(key, 1)
    except BackendError as exc:
        failures.failed(_TICKET, "cache %s failed while %s: %s", cache.url, _TICKET, exc)
        ticket = None
    else:
        failures.worked(_TICKET)
    return random.randrange(1 << 30) if ticket is None else ticket
