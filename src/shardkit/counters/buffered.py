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
created, holding its sums offset by ``_BASE``. An increment is one ``Cache.bump``; a
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
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from shardkit import metrics
from shardkit._program import Blocking, Program, call, role, rule
from shardkit._sync.combine import Combiner
from shardkit.cache.base import Cache
from shardkit.counters.base import (
    CounterCore,
    CounterRoles,
    Options,
    best_effort,
    incarnation_key,
)
from shardkit.errors import (
    BackendError,
    CounterOverflow,
    FlushFailed,
    InvalidDelta,
    ShardkitError,
)
from shardkit.executor.base import Executor
from shardkit.store.base import RETIRED, CounterInfo, Deleted, Flushed, Store
from shardkit.validation import (
    INT64_MAX,
    INT64_MIN,
    check_delta,
    check_interval,
    check_name,
    check_stripes,
)

# A writer that finds its generation dead adopts or starts another; a cache being wiped
# again and again while it does so gives up after this many tries.
_ATTEMPTS = 5
# How many counters one flush reads from the cache in one round trip.
_BATCH = 500
# A generation's keys start here: a cache that lost one and re-created it on an increment
# shows a value far below. Leaves 2**62 - 1 for each sum (memcached adds its own 2**63).
_BASE = 2**62
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
FLUSH = metrics.action("flush")  # the background task, bound by the kits


# A read of buffered counters: the store's records of each one's generations, the cache
# keys of their sums by (name, generation), and the values the cache holds under them.
_Readings = tuple[
    dict[str, dict[int, Flushed]], dict[tuple[str, int], tuple[str, str]], dict[str, int]
]


class Parts(NamedTuple):
    """A buffered counter's value: what the store holds, and what waits in the cache."""

    stored: int
    """What the store holds: every flushed increment."""
    pending: int
    """What waits in the cache for the next flush."""

    @property
    def total(self) -> int:
        """The counter's value: stored and pending together."""
        return self.stored + self.pending


@role("bumps")
class Bumps(Protocol):
    """The role that adds to a generation's sums: a combiner per side, so that
    concurrent increments (side 0) or decrements (1) share one cache command."""

    def __call__(self, side: int, amount: int, /) -> None: ...


class Sides:
    """Plays ``Bumps`` with one combiner (thread or coroutine) per side."""

    def __init__(self, up: Any, down: Any) -> None:
        self.sides = (up, down)

    def __call__(self, side: int, amount: int) -> Any:
        return self.sides[side](amount)


@dataclass(frozen=True, slots=True)
class BufferedRoles(CounterRoles):
    """What a buffered counter's programs run on."""

    executor: Executor
    """Runs the scheduled flushes."""
    bumps: Bumps


class BufferedCore(CounterCore):
    """The buffered counter's rules, for its sync and async forms (see
    ``BufferedCounter``). Its programs run on ``BufferedRoles``."""

    kind = "buffered"
    """The counter's kind."""
    roles: BufferedRoles

    # The form's: what combines concurrent bumps of a side, and what runs a program.
    _combiner: Callable[[Callable[[Sequence[int]], Any]], Any]
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
        self._sides = [self._combiner(self._bumping(side)) for side in (0, 1)]
        roles = options.roles
        self.roles = BufferedRoles(
            roles.store, roles.cache, roles.adjuster, executor, Sides(*self._sides)
        )
        # Each stripe has a generation of its own, which the cache points at.
        self._pointer_keys = pointer_keys(options, info, self.stripes)
        self._writing: list[tuple[int, tuple[str, str]] | None] = [None] * self.stripes
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
        return _keys(self._options, self.name, generation)

    # -- writes ------------------------------------------------------------------------

    @rule
    def incr(self, delta: int = 1) -> Program[None]:
        """Add ``delta``, an int within ±``MAX_DELTA`` (2**40; a larger one raises
        ``InvalidDelta`` and counts nothing); one cache round trip, which concurrent
        increments from other threads (or coroutines) of the process share (it returns
        once the cache has taken it), plus one per interval per process to schedule the
        flush (and one when the generation fills).

        A call that raises ``BackendError`` may or may not have counted.
        """
        delta = check_delta(delta)
        if abs(delta) > MAX_DELTA:
            raise InvalidDelta(f"delta {delta} is outside ±2**40, a buffered counter's limit")
        return metrics.timed(self.kind, self._add(delta))

    def _add(self, delta: int) -> Program[None]:
        if delta:
            yield from call(Bumps.__call__, int(delta < 0), abs(delta))
            yield from self._schedule()

    @rule
    def decr(self, delta: int = 1) -> Program[None]:
        """Subtract ``delta``; the same contract as ``incr``."""
        return BufferedCore.incr.program(self, -check_delta(delta))

    def _bumping(self, side: int) -> Callable[[Sequence[int]], Any]:
        return lambda amounts: self._carry_out(self._bump(side, amounts))

    def _bump(self, side: int, amounts: Sequence[int]) -> Program[list[None]]:
        """Add a batch of increments (``side`` 0) or decrements (1) to the sum of the
        generation of a stripe drawn at random, in one cache command."""
        metrics.meter.combined(self.kind, len(amounts))
        if self._look_due(self._options.cache_ttl):
            yield from self._follow()
        amount = sum(amounts)
        stripe = random.randrange(self.stripes) if self.stripes > 1 else 0
        writing = self._writing[stripe]
        for _ in range(_ATTEMPTS):
            if writing is None:
                writing = yield from self._adopt(stripe, dead=None)
            total = (yield from call(Cache.bump, writing[1][side], amount)) - _BASE
            if total >= amount:
                if total > _FULL:  # counted; the next increments go to a new generation
                    moving = self._adopt(stripe, writing[0])
                    yield from best_effort(self._options, _MOVE, moving)
                return [None] * len(amounts)
            writing = yield from self._adopt(stripe, dead=writing[0])
        raise BackendError(f"the cache kept losing counter {self.name!r}'s keys")

    def _adopt(self, stripe: int, dead: int | None) -> Program[tuple[int, tuple[str, str]]]:
        """The generation of ``stripe`` to write to (and its keys), now that ``dead`` (if
        any) has lost its keys: the one the cache points at, unless that is ``dead`` or
        absent; then a new one."""
        pointer = yield from call(Cache.get, self._pointer_keys[stripe])
        if pointer is None or pointer == dead:
            # A generation that died, or a look that is due: the counter may have been
            # deleted or reset (its keys went with it).
            looks = dead is not None or self._look_due(self._options.cache_ttl)
            if looks and (yield from self._follow()):
                return (yield from self._adopt(stripe, dead=None))
            pointer = yield from self._start_generation(stripe, replacing=pointer)
        writing = self._writing[stripe] = (pointer, self._keys(pointer))
        return writing

    def _new_generation(self, stripe: int) -> int:
        """A random generation id; where the cache's keys live on several servers, one
        whose keys are on the server of ``stripe`` (the stripes take turns over them)."""
        generation = random.randrange(1, 2**63)
        placement = self._options.placement
        if placement is None or self.stripes == 1:
            return generation
        owners = placement.owners()
        target = owners[stripe % len(owners)]
        for _ in range(_PLACING):
            if placement.owner(self._keys(generation)[0]) == target:
                break
            generation = random.randrange(1, 2**63)
        return generation

    def _start_generation(self, stripe: int, replacing: int | None) -> Program[int]:
        generation = self._new_generation(stripe)
        pointer_key = self._pointer_keys[stripe]
        # Recorded first: a flush only reads generations the store knows, so the keys
        # must not take increments before the record exists.
        yield from call(Store.add_generation, self.name, generation)
        keys = self._keys(generation)
        for key in keys:
            yield from call(Cache.add, key, _BASE, None)
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
        self._writing = [None] * self.stripes

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
        self._writing = [None] * self.stripes

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
    * ``value()`` is exact at the moment it reads: stored plus pending.

    Thread-safe; usable in a forked child.
    """

    _combiner = Combiner


def pointer_keys(options: Options, info: CounterInfo, stripes: int) -> list[str]:
    """The keys that point each of ``stripes`` stripes of a buffered counter's
    incarnation ``info`` at the generation it writes to."""
    return [
        incarnation_key(options, info, "buffered:generation" + (f":{s}" if s else ""))
        for s in range(stripes)
    ]


def forget(options: Options, deleted: Deleted, stripes: int) -> Program[None]:
    """Remove the cache keys of the deleted buffered counter ``deleted``: its
    generations' sums (what was pending in them is gone with it; a writer still holding
    the counter finds them dead) and the pointers of its first ``stripes`` stripes."""
    info = deleted.info
    for key in pointer_keys(options, info, stripes):
        yield from call(Cache.delete, key)
    for generation in deleted.generations:
        for key in _keys(options, info.name, generation):
            yield from call(Cache.delete, key)


def _keys(options: Options, name: str, generation: int) -> tuple[str, str]:
    """A generation's two sums, on one server (the generation is their hash tag)."""
    return (
        options.cache_key(name, f"buffered:{generation}:up", tag=str(generation)),
        options.cache_key(name, f"buffered:{generation}:down", tag=str(generation)),
    )


def _reading(applied: Flushed, keys: tuple[str, str], live: dict[str, int]) -> Flushed:
    """A generation's sums as read from the cache, never below what the store applied
    (an absent or re-created key — a dead generation — reads as what was applied)."""
    up, down = (live.get(key, 0) - _BASE for key in keys)
    return Flushed(max(applied.up, up), max(applied.down, down))


def _generations_and_sums(
    options: Options, names: list[str]
) -> Program[
    tuple[dict[str, dict[int, Flushed]], dict[tuple[str, int], tuple[str, str]], dict[str, int]]
]:
    """What the store has applied of each generation of the buffered counters ``names``,
    the cache keys of their sums, and what the cache holds under them: one store read,
    then one cache read, in that order (a flush between the two is never counted
    twice)."""
    recorded = yield from call(Store.generations, names)
    keys = {
        (name, generation): _keys(options, name, generation)
        for name, generations in recorded.items()
        for generation in generations
        if generation != RETIRED
    }
    live = yield from call(Cache.get_many, [key for pair in keys.values() for key in pair])
    return recorded, keys, live


def read_parts(options: Options, names: Iterable[str]) -> Program[dict[str, Parts]]:
    """The stored and pending parts of the buffered counters ``names`` (unknown names
    read 0): one store read, then one cache read, in that order, so a flush between the
    two is never counted twice."""
    wanted = list(dict.fromkeys(names))
    recorded, keys, live = yield from _generations_and_sums(options, wanted)
    parts = dict.fromkeys(wanted, Parts(0, 0))
    for name, generations in recorded.items():
        stored = pending = 0
        for generation, applied in generations.items():
            stored += applied.net
            if (name, generation) in keys:
                pending += _reading(applied, keys[name, generation], live).net - applied.net
        parts[name] = Parts(stored, pending)
    return parts


def scheduled_flush(options: Options, args: Mapping[str, Any]) -> Program[dict[str, int]]:
    """The executor's ``flush`` task: flush the counter ``args["name"]``, and report the
    flush's lag: from ``args["since"]``, the start of the interval whose first increment
    scheduled it (its oldest increment, unless an earlier flush failed), to now, by the
    counter's ``args["interval"]``."""
    moved = yield from flush_counters(options, [check_name(args["name"])])
    since, interval = args.get("since"), args.get("interval")
    if moved and isinstance(since, int | float) and isinstance(interval, int | float):
        metrics.meter.flush_lag(interval, time.time() - since)
    return moved


def flush_counters(options: Options, names: Iterable[str]) -> Program[dict[str, int]]:
    """Flush the buffered counters ``names``: for each generation, advance the store's
    record to the cache's sums. Returns the amount moved per counter that moved.

    Every counter that can be flushed is: when some cannot (``CounterOverflow``, a
    backend error), ``FlushFailed`` is raised after the others, naming each with its
    error and carrying what the others moved. A failed counter's sums stay in the cache.

    Idempotent and safe to run concurrently: each advance is a compare-and-set that is
    retried against the newer record when another flush got there first.
    """
    moved: dict[str, int] = {}
    failed: dict[str, ShardkitError] = {}
    wanted = list(dict.fromkeys(names))
    for start in range(0, len(wanted), _BATCH):
        batch = wanted[start : start + _BATCH]
        try:
            recorded, _, live = yield from _generations_and_sums(options, batch)
        except ShardkitError as exc:
            failed.update(dict.fromkeys(batch, exc))
            for _ in batch:
                metrics.meter.flushed("failed")
            continue
        for name, generations in recorded.items():
            try:
                yield from _flush_one(options, name, generations, live, moved)
            except ShardkitError as exc:
                failed[name] = exc
            metrics.meter.flushed(
                "failed" if name in failed else "moved" if moved.get(name) else "idle"
            )
    if failed:
        raise FlushFailed(failed, moved)
    return moved


def _flush_one(
    options: Options,
    name: str,
    generations: dict[int, Flushed],
    live: dict[str, int],
    moved: dict[str, int],
) -> Program[None]:
    """Advance the records of counter ``name``'s ``generations`` to the ``live`` sums,
    adding what moved to ``moved[name]``; refuse (``CounterOverflow``) an advance that
    would take its stored value outside signed 64-bit. Then, with a shared cache, fold
    its dead generations that are old enough (see the module docstring)."""
    stored = sum(applied.net for applied in generations.values())
    dead: list[int] = []
    readings = [
        (generation, recorded, _reading(recorded, _keys(options, name, generation), live))
        for generation, recorded in generations.items()
        if generation != RETIRED
    ]
    # Generations (a counter's stripes) that move the value towards 0 first: an advance
    # is refused only if the value itself would leave signed 64-bit, not on the way.
    readings.sort(key=lambda r: (r[2].net - r[1].net) * (1 if stored >= 0 else -1))
    for generation, recorded, reading in readings:
        if all(live.get(key, 0) < _BASE for key in _keys(options, name, generation)):
            dead.append(generation)
        applied: Flushed | None = recorded
        while applied is not None and reading != applied:
            if not INT64_MIN <= stored + reading.net - applied.net <= INT64_MAX:
                raise CounterOverflow(
                    f"flushing counter {name!r} would take its stored value outside signed "
                    "64-bit; its pending increments stay in the cache"
                )
            if (yield from call(Store.advance, name, generation, applied, reading)):
                stored += reading.net - applied.net
                moved[name] = moved.get(name, 0) + reading.net - applied.net
                break
            # Another flush advanced the record (go on from what it applied), or folded
            # the generation (its keys were gone: nothing is left to apply).
            metrics.meter.lost_race()
            newer_records = yield from call(Store.generations, [name])
            newer = newer_records.get(name, {}).get(generation)
            if newer is not None:
                stored += newer.net - applied.net
                reading = Flushed(max(newer.up, reading.up), max(newer.down, reading.down))
            applied = newer
    if dead and options.shared_cache:
        yield from _fold(options, name, dead, generations)


def _fold(
    options: Options, name: str, dead: list[int], recorded: dict[int, Flushed]
) -> Program[None]:
    """Fold the generations ``dead`` of counter ``name`` (both keys read below the offset)
    that were recorded ``fold_after`` seconds ago or earlier into ``RETIRED`` (see the
    module docstring). A generation a flush has advanced since ``recorded`` is left for a
    later flush."""
    before = time.time() - options.fold_after
    recorded_at = yield from call(Store.recorded_at, name, dead)
    for generation, at in recorded_at.items():
        if at <= before:
            yield from call(Store.retire, name, generation, recorded[generation])
