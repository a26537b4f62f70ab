"""The sharded counter: many rows per counter, so concurrent writers rarely share a lock."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shardkit import metrics
from shardkit._program import Blocking, Program, call, role, rule
from shardkit._sync.combine import Combiner
from shardkit.cache.base import Cache
from shardkit.counters.adjuster import Adjusting
from shardkit.counters.base import (
    CounterCore,
    CounterRoles,
    CounterSettings,
    Options,
    best_effort,
    log,
)
from shardkit.counters.sizing import LOOKBACK, WINDOW, Sizing, Window
from shardkit.errors import BackendError, ShardkitError
from shardkit.store.base import CounterInfo, Deleted, Store
from shardkit.validation import check_delta, check_name, check_shards, sums_fit

# How often a writer re-reads the counter's configuration, to follow a grow(), delete or
# reset made elsewhere.
_SHARDS_REFRESH = 10.0
# A keyed write purges expired idempotency keys with this probability.
_PURGE_CHANCE = 1 / 1000
# Kinds of cache failures that the counter rides out (logged by the kit's FailureLog).
_TICKET = metrics.action("taking a shard ticket")
_READ = metrics.action("reading a cached value")
_CACHING = metrics.action("caching a value")
_GROWING = metrics.action("growing a counter")

Write = tuple[int, str | None]  # (delta, idempotency key)


@role("writes")
class Writes(Protocol):
    """The role that carries out a counter's writes: a combiner (concurrent writes share
    one statement), or a plain call of the counter's ``_write``."""

    def __call__(self, write: Write, /) -> bool | ShardkitError: ...


@dataclass(frozen=True, slots=True)
class ShardedRoles(CounterRoles):
    """What a sharded counter's programs run on."""

    writes: Writes


class ShardedCore(CounterCore):
    """The sharded counter's rules, for its sync and async forms (see ``ShardedCounter``).

    Its programs run on ``ShardedRoles``.
    """

    kind = "sharded"
    """The counter's kind."""
    roles: ShardedRoles

    def __init__(self, info: CounterInfo, options: Options, local: Any) -> None:
        """``local`` holds a writer's shard ticket: per thread, or per process where one
        task at a time writes."""
        super().__init__(info, options)
        self._shards = info.shards
        self._value_key = value_key(options, self.name)
        self._ticket_key = options.cache_key(self.name, "sharded:ticket")
        self._local = local
        self._sizing: Sizing | None = None  # an automatic counter's, where shards help

    def _writers_key(self, second: int) -> str:
        """The cache key counting the processes that wrote this counter in ``second``
        (of the epoch, in ``WINDOW``s)."""
        return self._options.cache_key(self.name, f"sharded:writers:{second}")

    def size_automatically(self, row_locks: bool) -> None:
        """Grow this counter when its writes wait on their rows (``counters.sizing``):
        from now on, in this process, where the store has ``row_locks``."""
        if row_locks and self._sizing is None:
            self._sizing = Sizing(self._options.max_shards)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} shards={self._shards}>"

    # -- writes ------------------------------------------------------------------------

    @rule
    def incr(self, delta: int = 1, *, key: str | None = None) -> Program[bool]:
        """Add ``delta`` (an int within signed 64-bit, may be negative).

        Returns True when applied, False when ``key`` had been applied already.
        """
        return metrics.timed(self.kind, self._add(check_delta(delta), key))

    @rule
    def decr(self, delta: int = 1, *, key: str | None = None) -> Program[bool]:
        """Subtract ``delta``; the same contract as ``incr``."""
        return metrics.timed(self.kind, self._add(check_delta(-check_delta(delta)), key))

    def _add(self, delta: int, key: str | None) -> Program[bool]:
        options = self._options
        if key is not None:
            check_name(key, "idempotency key")
        applied = outcome((yield from call(Writes.__call__, (delta, key))))
        if key is not None and options.random() < _PURGE_CHANCE:
            yield from call(Store.purge_keys, time.time() - options.key_retention)
        return applied

    def _write(self, writes: Sequence[Write]) -> Program[list[bool | ShardkitError]]:
        """Write a batch of ``(delta, key)`` to this writer's home shard, in one statement
        (or transaction, with keys); then leave the applied sum to the kit's adjuster.
        Writes that might sum outside signed 64-bit are made one by one, each with its
        own outcome."""
        if len(writes) > 1 and not sums_fit([delta for delta, _ in writes]):
            outcomes: list[bool | ShardkitError] = []
            for write in writes:
                try:
                    outcomes.extend((yield from self._write([write])))
                except ShardkitError as exc:
                    outcomes.append(exc)
            return outcomes
        metrics.meter.combined(self.kind, len(writes))
        # A writer's home shard: its ticket (taken once), within the current shard count.
        ticket = held_ticket(self._local)
        if ticket is None:
            ticket = yield from take_ticket(self._options, self._ticket_key, self._local)
        if self._look_due(_SHARDS_REFRESH):  # as writing_shards, inline: the hot path
            yield from self._refresh_shards()
        shard = ticket % self._shards
        sized = self._sizing is not None  # an automatic counter times its writes
        started = time.perf_counter() if sized else 0.0
        applied = yield from call(Store.add_many, self.name, shard, writes)
        if sized:
            # Its writers: the process, its writes combined; else each thread, on its shard.
            writer = None if self.roles.store.combinable else ticket
            sizing = self._timed(time.perf_counter() - started, writer)
            if sizing is not None:  # the write ended a window: once a second at most
                yield from sizing
        moved = sum([delta for (delta, _), ok in zip(writes, applied, strict=True) if ok])
        if moved:
            yield from call(Adjusting.add, self._value_key, moved)
        return list(applied)

    @rule
    def writing_shards(self) -> Program[int]:
        """The shard count this process's writers write within: the one it holds, read
        again from the store once it is ``_SHARDS_REFRESH`` seconds old (the bound within
        which a growth made elsewhere is taken up)."""
        if self._look_due(_SHARDS_REFRESH):
            yield from self._refresh_shards()
        return self._shards

    @rule
    def wrote(self, seconds: float, writer: object = None) -> Program[None]:
        """Note that a write to this counter's rows took ``seconds`` (its own, or a
        statement of the caller's: the Django app's counting updates, whose ``writer``
        is the ticket of the thread that made it, which picks its shard): an automatic
        counter may grow from it (``counters.sizing``)."""
        sizing = self._timed(seconds, writer)
        if sizing is not None:
            yield from sizing

    def _timed(self, seconds: float, writer: object) -> Program[None] | None:
        """Time a write (``wrote``): the program deciding on a growth when the write ended
        a window of this counter's writes (once a second at most), else None: nothing to
        run."""
        if self._sizing is None:
            return None
        window = self._sizing.timed(seconds, writer)
        return None if window is None else self._sized(self._sizing, window)

    def _sized(self, sizing: Sizing, window: Window) -> Program[None]:
        """After a window of this process's writes (``counters.sizing``): count its
        writers among the counter's writers of this second, and grow the counter when
        it should. Best effort, after a write that stands whatever happens here."""
        second = int(time.time() / WINDOW)
        key = self._writers_key
        try:
            yield from call(Cache.add, key(second), 0, (LOOKBACK + 2) * WINDOW)
            yield from call(Cache.incr, key(second), window.writers)
            writers = 0
            if window.contended:  # the seconds before, whole: each writer in one of them
                seconds = [key(second - ago) for ago in range(1, LOOKBACK + 1)]
                counts = yield from call(Cache.get_many, seconds)
                writers = max(counts.values(), default=0)
                if self._look_due(_SHARDS_REFRESH):  # decided against the current count
                    yield from self._refresh_shards()
            shards = sizing.grow_to(window, writers, self._shards)
            if shards is None:
                return
            before = self._shards
            yield from ShardedCore.grow.program(self, shards)
        except ShardkitError as exc:
            self._options.failures.failed(_GROWING, "failed while %s: %s", _GROWING, exc)
            return
        self._options.failures.worked(_GROWING)
        metrics.meter.grew(self.kind)
        log.info(
            "sharded counter %r grew from %d to %d shards: %d writers a second, "
            "%d writes of this process in %g s spending %.0f%% of their time waiting",
            self.name,
            before,
            self._shards,
            writers,
            window.writes,
            WINDOW,
            100 * window.waiting,
        )

    @rule
    def read_shards(self) -> Program[int]:
        """The current shard count, read from the store (following the name to its
        current incarnation, as a write would)."""
        return (yield from self._refresh_shards())

    def _refresh_shards(self) -> Program[int]:
        """The current shard count, read from the store (following the name to its
        current incarnation: ``CounterCore._follow``)."""
        yield from self._follow()
        self._shards = max(self._shards, self.info.shards)
        return self._shards

    def _moved(self) -> None:
        self._shards = self.info.shards

    @rule
    def applied(self, delta: int) -> Program[None]:
        """Note that a statement of the caller's own has added ``delta`` to this counter's
        shard rows (the Django app's counting updates write them in the statement that
        finds the objects): its cached value is moved as an increment's would be."""
        yield from call(Adjusting.add, self._value_key, check_delta(delta))

    @rule
    def grow(self, shards: int) -> Program[int]:
        """Raise the shard count to ``shards`` (never lowers it); return the new count.

        The value is unchanged: it is the sum of the rows, and new rows start empty.
        """
        check_shards(shards, self._options.max_shards)
        info = yield from call(Store.open_counter, self.name, self.kind, shards)
        self._hold(info)
        self._shards = max(self._shards, info.shards)
        return self._shards

    # -- reads -------------------------------------------------------------------------

    @rule
    def value(self, *, fresh: bool = False) -> Program[int]:
        """The counter's value: cached (stale by at most ``cache_ttl``) unless ``fresh``."""
        options = self._options
        if not fresh:
            yield from call(Adjusting.sync)  # this process's own writes are in what it reads
            try:
                cached = yield from call(Cache.get, self._value_key)
            except BackendError as exc:
                options.failures.failed(_READ, "failed while %s: %s", _READ, exc)
                cached = None
            else:
                options.failures.worked(_READ)
            if cached is not None:
                return cached
        total = yield from call(Store.total, self.name)
        if not fresh:
            caching = call(Cache.add, self._value_key, total, options.cache_ttl)
            yield from best_effort(options, _CACHING, caching)
        return total


class ShardedCounter(ShardedCore, Blocking):
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
      kit's ``adjust_delay`` (0.1 s); writes racing with the cache's fill (read from the
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

    def __init__(self, info: CounterInfo, settings: CounterSettings) -> None:
        super().__init__(info, settings, threading.local())
        # Concurrent writes from this process's threads share one statement, unless each
        # belongs to its caller's transaction.
        writes: Writes = (
            Combiner(self._write_now)
            if settings.store.combinable
            else lambda write: self._write_now([write])[0]
        )
        roles = settings.roles
        self.roles = ShardedRoles(roles.store, roles.cache, roles.adjuster, writes)

    def _write_now(self, writes: Sequence[Write]) -> list[bool | ShardkitError]:
        return self._carry_out(self._write(writes))

    def incr(self, delta: int = 1, *, key: str | None = None) -> bool:
        """Add ``delta`` (an int within signed 64-bit, may be negative).

        Returns True when applied, False when ``key`` had been applied already.
        """
        if key is not None:
            return self._carry_out(ShardedCore.incr.program(self, delta, key=key))
        # ``ShardedCore.incr`` without a key is one step, the write: made here with no
        # program run around it (the hot path), with the same outcome and metrics.
        return metrics.timed_call(self.kind, self._write_unkeyed, check_delta(delta))

    def _write_unkeyed(self, delta: int) -> bool:
        return outcome(self.roles.writes((delta, None)))

    @property
    def shards(self) -> int:
        """The current shard count, read from the store: ``read_shards()``, which is the
        async counter's one way to read it (``await counter.read_shards()``)."""
        return self.read_shards()

    def wrote(self, seconds: float, writer: object = None) -> None:
        """``ShardedCore.wrote``, running a program only when the write ended a window:
        a caller reporting each of its writes (the Django app's counting updates) pays
        for no more than the timing in between."""
        sizing = self._timed(seconds, writer)
        if sizing is not None:
            self._carry_out(sizing)


def outcome(write: bool | ShardkitError) -> bool:
    """Whether a write (``Writes``' result) applied; its error raised."""
    if isinstance(write, ShardkitError):
        raise write
    return write


def value_key(options: Options, name: str) -> str:
    """The cache key of a sharded counter's cached value. It names no incarnation: the
    value is read by name (``Kit.values``), and a cached value lives ``cache_ttl``
    seconds at most, the staleness every cached read allows."""
    return options.cache_key(name, "sharded:value")


def forget(options: Options, deleted: Deleted) -> Program[None]:
    """Remove the cached value of the deleted sharded counter ``deleted``."""
    yield from call(Cache.delete, value_key(options, deleted.info.name))


def held_ticket(local: Any) -> int | None:
    """The shard ticket ``local`` holds for this process, or None: none taken yet, or
    taken by the parent of this forked child (which takes its own, not its parent's
    shard)."""
    pid, ticket = getattr(local, "ticket", (None, 0))
    return int(ticket) if pid == os.getpid() else None


def take_ticket(options: Options, key: str, local: Any) -> Program[int]:
    """A number unique among the takers of ``key``'s tickets while the cache keeps it, to
    pick a home shard by, kept in ``local`` for this process (see ``held_ticket``); the
    first taker seeds it at random, so that private (per-process) caches still spread
    their processes over the shards."""
    failures = options.failures
    try:
        yield from call(Cache.add, key, random.randrange(1 << 30), 86400)
        ticket = yield from call(Cache.incr, key, 1)
    except BackendError as exc:
        failures.failed(_TICKET, "failed while %s: %s", _TICKET, exc)
        ticket = None
    else:
        failures.worked(_TICKET)
    taken = random.randrange(1 << 30) if ticket is None else ticket
    local.ticket = (os.getpid(), taken)
    return taken
