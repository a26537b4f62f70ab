"""A buffered counter's generations (see ``shardkit.counters.buffered``): the cache keys
of their sums, the reading of them, and the flushes that advance the store's records of
each generation to them, which can neither lose nor double a count."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from shardkit import metrics
from shardkit._program import Program, call
from shardkit.cache.base import Cache
from shardkit.counters.base import Options
from shardkit.errors import CounterOverflow, FlushFailed, ShardkitError
from shardkit.store.base import RETIRED, Flushed, Store
from shardkit.validation import INT64_MAX, INT64_MIN, check_name

# How many counters one flush reads from the cache in one round trip.
_BATCH = 500
BASE = 2**62
"""Where a generation's sums start: a cache that lost one and re-created it on an
increment shows a value far below. Leaves 2**62 - 1 for each sum (memcached adds its
own 2**63)."""
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


def sum_keys(options: Options, name: str, generation: int) -> tuple[str, str]:
    """A generation's two sums, on one server: a stripe's generation is their hash tag;
    the keyed generation's (a negative id) is the counter's own, which the records of its
    idempotency keys share."""
    tag = str(generation) if generation > 0 else None
    return (
        options.cache_key(name, f"buffered:{generation}:up", tag=tag),
        options.cache_key(name, f"buffered:{generation}:down", tag=tag),
    )


def _reading(applied: Flushed, keys: tuple[str, str], live: dict[str, int]) -> Flushed:
    """A generation's sums as read from the cache, never below what the store applied
    (an absent or re-created key — a dead generation — reads as what was applied)."""
    up, down = (live.get(key, 0) - BASE for key in keys)
    return Flushed(max(applied.up, up), max(applied.down, down))


def _generations_and_sums(options: Options, names: list[str]) -> Program[_Readings]:
    """What the store has applied of each generation of the buffered counters ``names``,
    the cache keys of their sums, and what the cache holds under them: one store read,
    then one cache read, in that order (a flush between the two is never counted
    twice)."""
    recorded = yield from call(Store.generations, names)
    keys = {
        (name, generation): sum_keys(options, name, generation)
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
        (generation, recorded, _reading(recorded, sum_keys(options, name, generation), live))
        for generation, recorded in generations.items()
        if generation != RETIRED
    ]
    # Generations (a counter's stripes) that move the value towards 0 first: an advance
    # is refused only if the value itself would leave signed 64-bit, not on the way.
    readings.sort(key=lambda r: (r[2].net - r[1].net) * (1 if stored >= 0 else -1))
    for generation, recorded, reading in readings:
        if all(live.get(key, 0) < BASE for key in sum_keys(options, name, generation)):
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
