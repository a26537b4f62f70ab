"""The buffered (write-behind) counter: increments land in the cache, flushes move them to
the store, at most one scheduled flush per counter per interval.

How a flush can neither lose nor double a count, whatever crashes and whatever runs
twice: the cache never holds a *pending delta* that a flush must move out. It holds, per
*generation* of the counter, two cumulative sums that only grow — every increment ever
made (``up``) and every decrement (``down``) — and the store records, per generation,
how much of each sum it has applied. A flush reads the sums and advances the store's
record to them with one compare-and-set statement. Applying the same reading twice is a
no-op, a stale reading never moves the record back, and a flush killed at any point
leaves the sums in the cache for the next flush to apply. The counter's stored value is
the net of every generation's record; its pending part is what the cache holds beyond.

A generation is a random 63-bit id, recorded in the store *before* its cache keys are
created, holding its sums offset by ``BASE``. An increment is one ``Cache.bump``; a
result below the offset means the cache had lost the key (and the bump re-created it
near 0): the generation is dead, that increment did not count, and the writer moves to
another generation. What was pending in the dead one is what is lost, and only that. A
reading below the offset is ignored, so a re-created key can never look like a sum
below what the store applied.

Overflow is made impossible rather than detected: one call adds at most ``MAX_DELTA``
(2**40) either way, and a writer whose increment takes a sum past ``_FULL`` (2**61)
moves the counter to a new generation, so a sum would reach its capacity, 2**62 - 1
(where Redis would refuse and memcached's biased values would wrap), only if 2**21
writers all added 2**40 to one generation after it filled. The store's records of each
sum stay within that capacity, and a flush that would take the counter's stored value
(the net of its records) outside signed 64-bit is refused with ``CounterOverflow``,
leaving the sums in the cache.

Each cache loss leaves a dead generation's row behind, which every read and flush of the
counter would go on reading. With a shared cache, a flush folds it into the ``RETIRED``
generation once it is ``CounterSettings.fold_after`` seconds old and both its keys read
below the offset. (A private cache holds no other process's keys: there, a generation
that looks dead may be alive elsewhere, and only ``Kit.close()`` folds, its own.) That
is safe: past its creation (recorded, then its keys added at the offset), nothing can
bring a dead generation's keys back at the offset, and an increment that re-creates one
does not count; the fold is ``Store.retire``'s compare-and-set on what is applied, so a
flush that advances the generation first makes it wait for a later flush, and a flush
that comes after it finds the generation gone (what it read from the cache before the
loss is lost with the cache, as the guarantees allow).

An increment with an idempotency key goes to the counter's *keyed* generation (a
negative id; one a counter, whatever its stripes), whose sums share a server with the
records of the keys: the counter's own hash tag. A key's record is the counter
incarnation's, whichever generation takes the increment, and lives ``key_retention``
seconds. It is set in one atomic step with the increment (``Recording.incr_once``: one
Lua script on Redis, the lock of the in-process cache), a step left out if the record
is there and taken only if the generation's sums are (a dead generation takes
neither), so a retry counts once, even after the writer moved to a new generation. A
cache that loses a record loses the increment with it while that is pending; once a
flush has moved the increment to the store, a retry after the loss counts it again.
memcached has no atomic command over several keys: a keyed increment is refused there,
before anything is written.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from shardkit import metrics
from shardkit._program import Blocking, Program, call, role, rule
from shardkit._sync.combine import Combiner
from shardkit.cache.base import Cache, Recording
from shardkit.counters.base import (
    CounterCore,
    CounterRoles,
    Options,
    best_effort,
    incarnation_key,
)
from shardkit.counters.generations import (
    BASE,
    FLUSH,
    Parts,
    flush_counters,
    read_parts,
    sum_keys,
)
from shardkit.errors import (
    BackendError,
    FlushFailed,
    InvalidDelta,
    KeysUnsupported,
    ShardkitError,
)
from shardkit.executor.base import Executor
from shardkit.store.base import CounterInfo, Deleted, Store
from shardkit.validation import check_delta, check_interval, check_name, check_stripes

# A writer that finds its generation dead adopts or starts another; a cache being wiped
# again and again while it does so gives up after this many tries.
_ATTEMPTS = 5
# A writer whose increment takes a sum past this starts a new generation (see above).
_FULL = 2**61
# A generation of a stripe is drawn until its keys land on the stripe's server: at most
# this many draws (each lands there with probability 1 / servers).
_PLACING = 64
MAX_DELTA = 2**40
"""The largest increment or decrement one call of a buffered counter takes."""
# The kinds of failure that an increment rides out (logged by the kit's FailureLog).
_SCHEDULE = metrics.action("scheduling a flush")
_MOVE = metrics.action("starting a generation")
R = TypeVar("R")


@role("bumps")
class Bumps(Protocol):
    """The role that adds to a counter's sums: a combiner per side, so that concurrent
    increments (side 0) or decrements (1) share one cache command, and one for those
    with an idempotency ``key``, which share one too. Returns whether it counted."""

    def __call__(self, side: int, amount: int, key: str | None, /) -> bool: ...


class Sides:
    """Plays ``Bumps`` with one combiner (thread or coroutine) per side, and one
    (``keyed``) for keyed increments of either side."""

    def __init__(self, up: Any, down: Any, keyed: Any) -> None:
        self.sides = (up, down)
        self.keyed = keyed

    def __call__(self, side: int, amount: int, key: str | None) -> Any:
        return self.sides[side](amount) if key is None else self.keyed((side, amount, key))


@dataclass(frozen=True, slots=True)
class BufferedRoles(CounterRoles):
    """What a buffered counter's programs run on."""

    executor: Executor
    """Runs the scheduled flushes."""
    bumps: Bumps
    recording: Recording | None
    """The cache, if it can record idempotency keys (else keyed increments are refused)."""


class BufferedCore(CounterCore):
    """The buffered counter's rules, for its sync and async forms (see
    ``BufferedCounter``). Its programs run on ``BufferedRoles``."""

    kind = "buffered"
    """The counter's kind."""
    roles: BufferedRoles

    # The form's: what combines concurrent bumps, and what runs a program.
    _combiner: Callable[[Callable[[Sequence[Any]], Any]], Any]
    _carry_out: Callable[[Program[Any]], Any]

    def __init__(
        self,
        info: CounterInfo,
        options: Options,
        executor: Executor,
        interval: float,
        stripes: int = 1,
    ) -> None:
        super().__init__(info, options)
        self.interval = check_interval(interval)
        """Seconds between flushes (at most one is scheduled per interval)."""
        self.stripes = check_stripes(stripes)
        """Generations taking increments at once (on a Redis Cluster: one per primary)."""
        self._combining = [self._combiner(self._bumping(side)) for side in (0, 1)]
        self._combining.append(self._combiner(self._recording))
        roles, sides = options.roles, Sides(*self._combining)
        self.roles = BufferedRoles(
            roles.store, roles.cache, roles.adjuster, executor, sides, options.recording
        )
        # Each stripe has a generation of its own, and so do keyed increments (the lane
        # after the stripes), which the cache points at.
        self._pointer_keys = pointer_keys(options, info, self.stripes)
        self._writing: list[tuple[int, tuple[str, str]] | None] = [None] * (self.stripes + 1)
        # Generations this object started, with the process that started each: a forked
        # child's copy must never retire its parent's live generation.
        self._started: list[tuple[int, int]] = []  # (pid, generation)
        self._scheduled: tuple[int, int] | None = None  # (pid, interval number)
        metrics.meter.flushes_every(self.interval)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name!r} interval={self.interval} stripes={self.stripes}>"
        )

    def _keys(self, generation: int) -> tuple[str, str]:
        return sum_keys(self._options, self.name, generation)

    # -- writes ------------------------------------------------------------------------

    @rule
    def incr(self, delta: int = 1, *, key: str | None = None) -> Program[bool]:
        """Add ``delta``, an int within ±``MAX_DELTA`` (2**40; a larger one raises
        ``InvalidDelta`` and counts nothing); one cache round trip, which concurrent
        increments from other threads (or coroutines) of the process share (it returns
        once the cache has taken it), plus one per interval per process to schedule the
        flush (and one when the generation fills).

        Returns True, or False where the idempotency ``key`` was counted already (then
        nothing is counted): its record is kept with the increment, in the cache, for
        ``key_retention`` seconds. A key on a cache that cannot record it in one atomic
        step with the increment (memcached) raises ``KeysUnsupported``, before anything
        is written.

        A call that raises ``BackendError`` may or may not have counted: retry it with
        the same ``key`` to make the retry safe.
        """
        return metrics.timed(self.kind, self._add(self._checked(delta, key), key))

    def _checked(self, delta: int, key: str | None) -> int:
        """``delta``, an increment's, checked with its ``key`` (see ``incr``)."""
        delta = check_delta(delta)
        if abs(delta) > MAX_DELTA:
            raise InvalidDelta(f"delta {delta} is outside ±2**40, a buffered counter's limit")
        if key is not None:
            check_name(key, "idempotency key")
            if self.roles.recording is None:
                raise KeysUnsupported(
                    f"the cache {self.roles.cache.url} cannot record an idempotency key in "
                    "one atomic step with the increment it guards: keyed increments of a "
                    "buffered counter need Redis, Redis Cluster or memory://"
                )
        return delta

    def _add(self, delta: int, key: str | None) -> Program[bool]:
        if not delta and key is None:
            return True
        counted = yield from call(Bumps.__call__, int(delta < 0), abs(delta), key)
        if counted and self._schedule_due():
            yield from self._schedule()
        return counted

    def _schedule_due(self) -> bool:
        """Whether this interval's flush is yet to be scheduled by this process (the
        interval's first increment schedules it: ``_schedule``)."""
        return self._scheduled != (os.getpid(), int(time.time() // self.interval))

    @rule
    def decr(self, delta: int = 1, *, key: str | None = None) -> Program[bool]:
        """Subtract ``delta``; the same contract as ``incr``."""
        return BufferedCore.incr.program(self, -check_delta(delta), key=key)

    def _bumping(self, side: int) -> Callable[[Sequence[int]], Any]:
        return lambda amounts: self._carry_out(self._bump(side, amounts))

    def _bump(self, side: int, amounts: Sequence[int]) -> Program[list[bool]]:
        """Add a batch of increments (``side`` 0) or decrements (1) to the sum of the
        generation of a stripe drawn at random, in one cache command."""
        metrics.meter.combined(self.kind, len(amounts))
        amount = sum(amounts)

        def bump(keys: tuple[str, str]) -> Program[tuple[int, None] | None]:
            total = (yield from call(Cache.bump, keys[side], amount)) - BASE
            return (total, None) if total >= amount else None

        yield from self._write(random.randrange(self.stripes) if self.stripes > 1 else 0, bump)
        return [True] * len(amounts)

    def _recording(self, writes: Sequence[tuple[int, int, str]]) -> Any:
        return self._carry_out(self._record(writes))

    def _record(self, writes: Sequence[tuple[int, int, str]]) -> Program[list[bool]]:
        """Add a batch of keyed increments, each ``(side, amount, key)``, to the sums of
        the counter's keyed generation, with the records of their keys, in one atomic
        cache command; one whose key has a record already is left out (False)."""
        metrics.meter.combined(self.kind, len(writes))

        def bump(keys: tuple[str, str]) -> Program[tuple[int, list[bool]] | None]:
            guarded = [(self._record_key(key), side, amount) for side, amount, key in writes]
            ttl = self._options.key_retention
            done = yield from call(Recording.incr_once, keys, guarded, ttl)
            return None if done is None else (max(done[0]) - BASE, done[1])

        return (yield from self._write(self.stripes, bump))

    def _record_key(self, key: str) -> str:
        """The cache key of the record of idempotency key ``key``: one for the counter's
        incarnation, whichever generation takes the increment (named by a digest: any
        key, one length)."""
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        return incarnation_key(self._options, self.info, f"buffered:key:{digest}")

    def _write(
        self, lane: int, bump: Callable[[tuple[str, str]], Program[tuple[int, R] | None]]
    ) -> Program[R]:
        """``bump`` the sums of the generation of ``lane`` (a stripe, or the keyed lane
        after them), which returns the highest sum after it and its result, or None if
        the generation is dead: then the lane moves to another, bumped in turn."""
        if self._look_due(self._options.cache_ttl):
            yield from self._follow()
        writing = self._writing[lane]
        for _ in range(_ATTEMPTS):
            if writing is None:
                writing = yield from self._adopt(lane, dead=None)
            bumped = yield from bump(writing[1])
            if bumped is not None:
                if bumped[0] > _FULL:  # counted; the next increments go to a new generation
                    moving = self._adopt(lane, writing[0])
                    yield from best_effort(self._options, _MOVE, moving)
                return bumped[1]
            writing = yield from self._adopt(lane, dead=writing[0])
        raise BackendError(f"the cache kept losing counter {self.name!r}'s keys")

    def _adopt(self, lane: int, dead: int | None) -> Program[tuple[int, tuple[str, str]]]:
        """The generation of ``lane`` to write to (and its keys), now that ``dead`` (if
        any) has lost its keys: the one the cache points at, unless that is ``dead`` or
        absent; then a new one."""
        pointer = yield from call(Cache.get, self._pointer_keys[lane])
        if pointer is None or pointer == dead:
            # A generation that died, or a look that is due: the counter may have been
            # deleted or reset (its keys went with it).
            looks = dead is not None or self._look_due(self._options.cache_ttl)
            if looks and (yield from self._follow()):
                return (yield from self._adopt(lane, dead=None))
            pointer = yield from self._start_generation(lane, replacing=pointer)
        writing = self._writing[lane] = (pointer, self._keys(pointer))
        return writing

    def _new_generation(self, lane: int) -> int:
        """A random generation id: for the keyed lane, a negative one (its keys share
        the counter's hash tag); for a stripe, where the cache's keys live on several
        servers, one whose keys are on the stripe's server (they take turns over them)."""
        generation = random.randrange(1, 2**63)
        placement = self._options.placement
        if lane == self.stripes:
            return -generation
        if placement is None or self.stripes == 1:
            return generation
        owners = placement.owners()
        target = owners[lane % len(owners)]
        for _ in range(_PLACING):
            if placement.owner(self._keys(generation)[0]) == target:
                break
            generation = random.randrange(1, 2**63)
        return generation

    def _start_generation(self, lane: int, replacing: int | None) -> Program[int]:
        generation = self._new_generation(lane)
        pointer_key = self._pointer_keys[lane]
        # Recorded first: a flush only reads generations the store knows, so the keys
        # must not take increments before the record exists.
        yield from call(Store.add_generation, self.name, generation)
        keys = self._keys(generation)
        for key in keys:
            yield from call(Cache.add, key, BASE, None)
        if replacing is not None:
            yield from call(Cache.delete, pointer_key)
        if (yield from call(Cache.add, pointer_key, generation, None)):
            self._record_start(generation)
            return generation
        # Another writer started one first. Nobody else knows ours, so it took nothing:
        # drop its keys and write into the winner's. (Racing replacers may still leave two
        # live generations; both are flushed, so that costs only a row.)
        winner = yield from call(Cache.get, pointer_key)
        if winner is None:
            self._record_start(generation)
            return generation
        for key in keys:
            yield from call(Cache.delete, key)
        return winner

    def _record_start(self, generation: int) -> None:
        """Remember a generation this process started, for ``_retire``: only with a
        private cache (a shared cache's generations outlive the process; flushes fold
        them once dead), so a long-lived counter on a shared cache keeps no list."""
        if not self._options.shared_cache:
            self._started.append((os.getpid(), generation))

    def _moved(self) -> None:
        self._pointer_keys = pointer_keys(self._options, self.info, self.stripes)
        self._writing = [None] * (self.stripes + 1)

    def _schedule(self) -> Program[None]:
        """Submit this interval's flush, once per process (and, through the executor's
        deduplication, once in all) per interval; due when the interval ends."""
        now = time.time()
        number = int(now // self.interval)
        if self._scheduled == (os.getpid(), number):
            return
        self._scheduled = (os.getpid(), number)
        delay = (number + 1) * self.interval - now
        failures = self._options.failures
        submitted = False
        try:
            yield from call(
                Executor.submit,
                FLUSH,
                {"name": self.name, "since": number * self.interval, "interval": self.interval},
                delay=delay,
                dedupe=f"flush:{self.name}:{number}",
                window=self.interval,
                merge=f"flush:{self.name}",
            )
            submitted = True
        except ShardkitError as exc:
            # The increment has counted: failing the call now would invite a doubled
            # retry. The next increment tries again.
            failures.failed(_SCHEDULE, "could not schedule a flush of %r: %s", self.name, exc)
        else:
            failures.worked(_SCHEDULE)
        finally:
            if not submitted:  # failed, or the caller was cancelled: the next one tries
                self._scheduled = None

    # -- flushes -----------------------------------------------------------------------

    @rule
    def flush(self) -> Program[int]:
        """Move what is pending into the store now; return how much this call moved.

        Safe at any time, from anywhere, concurrently with writers and other flushes.
        Raises the counter's error (``CounterOverflow``, ``BackendError``) if it fails.
        """
        try:
            moved = yield from flush_counters(self._options, [self.name])
        except FlushFailed as exc:
            raise exc.failed[self.name] from None
        return moved.get(self.name, 0)

    def _retire(self) -> Program[None]:
        """Flush, then fold the generations this process started into the store's
        ``RETIRED`` generation, so that a private (per-process) cache does not leave a
        generation row per process behind. Only for a cache nobody else writes to, once
        nothing else in the process flushes: closing the kit does it after closing the
        executor. (A generation started before a fork is the parent's: a child leaves it.)"""
        yield from flush_counters(self._options, [self.name])
        generations = yield from call(Store.generations, [self.name])
        recorded = generations.get(self.name, {})
        pid = os.getpid()
        for started_by, generation in self._started:
            if started_by != pid:
                continue
            if generation in recorded:
                yield from call(Store.retire, self.name, generation, recorded[generation])
            for key in self._keys(generation):
                yield from call(Cache.delete, key)
        self._started.clear()
        self._writing = [None] * (self.stripes + 1)

    # -- reads -------------------------------------------------------------------------

    @rule
    def parts(self) -> Program[Parts]:
        """The stored and pending parts of the value: one store read, then one cache read
        (in that order, so a flush between the two is never counted twice)."""
        return (yield from read_parts(self._options, [self.name]))[self.name]

    @rule
    def value(self) -> Program[int]:
        """The exact value now: stored plus pending."""
        return (yield from BufferedCore.parts.program(self)).total


class BufferedCounter(BufferedCore, Blocking):
    """A counter whose increments cost one cache round trip and reach the store in
    flushes, at most one scheduled per counter per ``interval`` seconds.

    Guarantees:

    * An increment that returns is in the cache. It reaches the store with the flush
      of its interval, scheduled on the kit's executor: within about ``interval``
      plus the executor's lag.
    * A flush — scheduled, ``flush()``, ``Kit.flush_all()``, run concurrently, run twice,
      killed at any point — never loses or doubles a count (see the module docstring).
    * Only a cache that loses data loses increments: those made since the last flush of
      the generation it lost, at most. Nothing already flushed is ever lost.
    * A retried increment with the same idempotency ``key`` counts once while the cache
      keeps the key's record (``key_retention`` seconds): the record is written in one
      atomic step with the increment, on its server. One that raised without a key may
      or may not have counted.
    * ``value()`` is exact at the moment it reads: stored plus pending.

    Thread-safe; usable in a forked child.
    """

    _combiner = Combiner

    def incr(self, delta: int = 1, *, key: str | None = None) -> bool:
        """Add ``delta``, an int within ±``MAX_DELTA`` (2**40; a larger one raises
        ``InvalidDelta`` and counts nothing); one cache round trip, which concurrent
        increments from other threads (or coroutines) of the process share (it returns
        once the cache has taken it), plus one per interval per process to schedule the
        flush (and one when the generation fills).

        Returns True, or False where the idempotency ``key`` was counted already (then
        nothing is counted): its record is kept with the increment, in the cache, for
        ``key_retention`` seconds. A key on a cache that cannot record it in one atomic
        step with the increment (memcached) raises ``KeysUnsupported``, before anything
        is written.

        A call that raises ``BackendError`` may or may not have counted: retry it with
        the same ``key`` to make the retry safe.
        """
        if key is not None:
            counted: bool = self._carry_out(BufferedCore.incr.program(self, delta, key=key))
            return counted
        # ``BufferedCore.incr`` without a key: its steps made here with no program run
        # around the bump (the hot path), with the same outcome and metrics.
        return metrics.timed_call(self.kind, self._add_unkeyed, self._checked(delta, None))

    def _add_unkeyed(self, delta: int) -> bool:
        if not delta:
            return True
        counted = self.roles.bumps(int(delta < 0), abs(delta), None)
        if counted and self._schedule_due():
            self._carry_out(self._schedule())
        return counted


def pointer_keys(options: Options, info: CounterInfo, stripes: int) -> list[str]:
    """The keys that point each of ``stripes`` stripes of a buffered counter's
    incarnation ``info``, then its keyed increments, at the generation each writes to."""
    parts = ["buffered:generation" + (f":{s}" if s else "") for s in range(stripes)]
    return [incarnation_key(options, info, part) for part in [*parts, "buffered:keyed"]]


def forget(options: Options, deleted: Deleted, stripes: int) -> Program[None]:
    """Remove the cache keys of the deleted buffered counter ``deleted``: its
    generations' sums (what was pending in them is gone with it; a writer still holding
    the counter finds them dead) and the pointers of its first ``stripes`` stripes and of
    its keyed increments. The records of its idempotency keys are left to expire."""
    info = deleted.info
    for key in pointer_keys(options, info, stripes):
        yield from call(Cache.delete, key)
    for generation in deleted.generations:
        for key in sum_keys(options, info.name, generation):
            yield from call(Cache.delete, key)
