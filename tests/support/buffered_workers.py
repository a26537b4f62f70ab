"""Entry points of the processes the buffered-counter fault tests start (importable by a
child), and the helpers they share with the tests.

Each entry point takes plain strings for where the kit lives (and multiprocessing
primitives), so a spawned child would need neither pytest nor conftest; the tests fork
them for speed.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import shardkit
import shardkit.aio
from backends import NEVER
from shardkit.executor import Marks, Task

Where = tuple[str, str, str]  # (store URL, cache URL, table prefix)
TIMEOUT = 60.0  # seconds any worker waits for its start signal or a condition

# The three points at which a flush can die.
BEFORE_READ = 1  # before reading the cache's sums
BEFORE_COMMIT = 2  # the store's compare-and-set called, not yet run
AFTER_COMMIT = 3  # the compare-and-set committed, nothing else done since
STAGES = (BEFORE_READ, BEFORE_COMMIT, AFTER_COMMIT)


class NoFlush:
    """An executor that runs nothing: a kit connected with it never flushes by itself, so
    only explicit ``flush()`` calls move counts."""

    url = "none://"

    def bind(self, tasks: Mapping[str, Task], marks: Marks) -> None:
        pass

    def submit(self, task: str, args: Mapping[str, Any], **options: Any) -> bool:
        return False

    def close(self) -> None:
        pass


def connect(where: Where, *, flushing: bool) -> shardkit.Kit:
    """A kit on ``where``: with the default local executor when ``flushing``, else with
    one that never flushes."""
    store_url, cache_url, prefix = where
    executor = None if flushing else NoFlush()
    return shardkit.connect(store_url, cache_url, prefix=prefix, executor=executor)


def delta_stream(seed: int, signed: bool) -> Iterator[int]:
    """Endless non-zero deltas (of both signs when ``signed``), the same for one seed."""
    rng = random.Random(seed)
    while True:
        size = rng.randint(1, 1000)
        yield rng.choice((-1, 1)) * size if signed else size


def deltas_sum(seed: int, signed: bool, count: int) -> int:
    """The sum of the first ``count`` deltas of ``delta_stream(seed, signed)``."""
    return sum(itertools.islice(delta_stream(seed, signed), count))


def wait_until(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    """Poll ``condition`` until it holds; raise TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.002)


def writer(
    where: Where,
    name: str,
    slot: int,
    seed: int,
    signed: bool,
    interval: float,
    flushing: bool,
    start: Any,
    stop: Any,
    begun: Any,
    done: Any,
    results: Any,
) -> None:
    """Once ``start`` is set, increment the buffered counter ``name`` with
    ``delta_stream(seed, signed)`` until ``stop`` is set. ``begun[slot]`` counts the
    ``incr`` calls started (raised before each call), ``done[slot]`` those that returned
    (acknowledged). Puts ``(slot, (acknowledged, their sum), error)`` on ``results``
    after closing the kit (which, when ``flushing``, runs its waiting flushes)."""
    acked = total = 0
    try:
        with connect(where, flushing=flushing) as kit:
            counter = kit.buffered(name, interval=interval)
            if not start.wait(TIMEOUT):
                raise TimeoutError("never told to start")
            for delta in delta_stream(seed, signed):
                if stop.is_set():
                    break
                begun[slot] = acked + 1
                counter.incr(delta)
                acked += 1
                total += delta
                done[slot] = acked
        results.put((slot, (acked, total), None))
    except BaseException:
        results.put((slot, (acked, total), traceback.format_exc()))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("survived SIGKILL")  # pragma: no cover


def store_record(kit: shardkit.Kit, name: str) -> dict[int, tuple[int, int]]:
    """The store's record of every generation of ``name``: generation -> (up, down)."""
    found = kit.store.generations([name]).get(name, {})
    return {generation: (applied.up, applied.down) for generation, applied in found.items()}


def arm(kit: shardkit.Kit | shardkit.aio.AsyncKit, stage: int, conn: Any) -> None:
    """Make this process SIGKILL itself at ``stage`` of the kit's next flush, after
    reporting on ``conn`` what it was doing (a sync or an async kit: its programs call
    the patched methods through their roles)."""
    store: Any = kit.store
    cache: Any = kit.cache
    if stage == BEFORE_READ:

        def get_many(keys: Any) -> dict[str, int]:
            conn.send(("reading",))
            _die()
            return {}  # pragma: no cover

        cache.get_many = get_many
    elif stage == BEFORE_COMMIT:

        def advance(name: str, generation: int, seen: Any, to: Any) -> bool:
            conn.send(("advancing", generation, (seen.up, seen.down), (to.up, to.down)))
            _die()
            return False  # pragma: no cover

        store.advance = advance
    elif stage == AFTER_COMMIT:
        real = store.advance

        def committed(advanced: bool, generation: int, seen: Any, to: Any) -> bool:
            if advanced:
                conn.send(("advanced", generation, (seen.up, seen.down), (to.up, to.down)))
                _die()
            return advanced

        if inspect.iscoroutinefunction(real):

            async def advance_later(name: str, generation: int, seen: Any, to: Any) -> bool:
                return committed(await real(name, generation, seen, to), generation, seen, to)

            store.advance = advance_later
        else:
            store.advance = lambda name, generation, seen, to: committed(
                real(name, generation, seen, to), generation, seen, to
            )
    else:
        raise ValueError(f"no stage {stage}")


def doomed_flusher(where: Where, name: str, stage: int, warmups: int, conn: Any) -> None:
    """Flush ``name`` ``warmups`` times, wait until something is pending, then flush once
    more, dying by SIGKILL at ``stage`` of that flush. Reports on ``conn``, in order:
    ``("warmed", [amounts moved])``, ``("armed", record)`` (the store's record when the
    trap was set), what the flush was doing when it died, and — if it did not die —
    ``("survived", moved)`` or ``("error", traceback)``."""
    try:
        kit = connect(where, flushing=False)
        counter = kit.buffered(name, interval=NEVER)
        conn.send(("warmed", [counter.flush() for _ in range(warmups)]))
        # Something pending, so the flush reaches the store's compare-and-set. Only this
        # process flushes now: nothing can take it away before the trap is set.
        wait_until(lambda: counter.parts().pending != 0, "something pending")
        conn.send(("armed", store_record(kit, name)))
        arm(kit, stage, conn)
        conn.send(("survived", counter.flush()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def async_doomed_flusher(where: Where, name: str, stage: int, warmups: int, conn: Any) -> None:
    """``doomed_flusher``, flushing with an async kit (the same reports)."""

    async def main() -> None:
        store_url, cache_url, prefix = where
        kit = await shardkit.aio.connect(store_url, cache_url, prefix=prefix)
        counter = await kit.buffered(name, interval=NEVER)
        conn.send(("warmed", [await counter.flush() for _ in range(warmups)]))
        deadline = time.monotonic() + TIMEOUT
        while (await counter.parts()).pending == 0:
            if time.monotonic() > deadline:
                raise TimeoutError("nothing pending")
            await asyncio.sleep(0.005)
        found = (await kit.store.generations([name])).get(name, {})
        conn.send(("armed", {g: (a.up, a.down) for g, a in found.items()}))
        arm(kit, stage, conn)
        conn.send(("survived", await counter.flush()))

    try:
        asyncio.run(main())
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def count_conflicts(kit: shardkit.Kit) -> list[int]:
    """Wrap the kit's store so that every compare-and-set it loses is counted; returns
    the one-element list holding the count."""
    conflicts = [0]
    lock = threading.Lock()
    real = kit.store.advance

    def advance(name: str, generation: int, seen: Any, to: Any) -> bool:
        advanced = real(name, generation, seen, to)
        if not advanced:
            with lock:
                conflicts[0] += 1
        return advanced

    kit.store.advance = advance  # type: ignore[method-assign]
    return conflicts


def flush_loop(counter: Any, stop: Any, calls: Any, slot: int) -> int:
    """Call ``counter.flush()`` until ``stop`` is set, counting calls in ``calls[slot]``;
    return the sum of the amounts they moved."""
    moved = 0
    while not stop.is_set():
        moved += counter.flush()
        calls[slot] += 1
    return moved


def racing_flusher(
    where: Where,
    name: str,
    slot: int,
    threads: int,
    start: Any,
    stop: Any,
    calls: Any,
    results: Any,
) -> None:
    """Flush ``name`` from ``threads`` threads in a tight loop between ``start`` and
    ``stop`` (calls counted in ``calls[slot * threads + thread]``); put ``(slot, (amount
    moved, compare-and-sets lost), error)`` on ``results``."""
    moved: list[int] = []
    errors: list[str] = []
    conflicts = [0]
    try:
        with connect(where, flushing=False) as kit:
            counter = kit.buffered(name, interval=NEVER)
            conflicts = count_conflicts(kit)
            if not start.wait(TIMEOUT):
                raise TimeoutError("never told to start")

            def run(index: int) -> None:
                try:
                    moved.append(flush_loop(counter, stop, calls, slot * threads + index))
                except BaseException:
                    errors.append(traceback.format_exc())
                    stop.set()

            pool = [threading.Thread(target=run, args=(index,)) for index in range(threads)]
            for thread in pool:
                thread.start()
            for thread in pool:
                thread.join()
        results.put((slot, (sum(moved), conflicts[0]), "\n".join(errors) or None))
    except BaseException:
        results.put((slot, (sum(moved), conflicts[0]), traceback.format_exc()))


def increment_until(counter: Any, seed: int, stop: Any) -> list[int]:
    """Increment ``counter`` by random positive deltas at random moments until ``stop``
    (an event) is set; return the acknowledged deltas, in order."""
    rng = random.Random(seed)
    acked: list[int] = []
    while not stop.is_set():
        time.sleep(rng.choice((0.0, 0.001, rng.uniform(0, 0.3))))  # the workload's pace
        delta = rng.randint(1, 1000)
        counter.incr(delta)
        acked.append(delta)
    return acked


def incrementer(
    where: Where,
    name: str,
    seed: int,
    interval: float,
    start: Any,
    stop: Any,
    release: Any,
    results: Any,
) -> None:
    """``increment_until`` on a kit with the default local executor (flushing every
    ``interval``), from ``start`` to ``stop``; puts ``(acknowledged deltas, error)`` on
    ``results``, then keeps the kit (and its scheduled flushes) open until ``release``."""
    acked: list[int] = []
    try:
        with connect(where, flushing=True) as kit:
            counter = kit.buffered(name, interval=interval)
            if not start.wait(TIMEOUT):
                raise TimeoutError("never told to start")
            acked = increment_until(counter, seed, stop)
            results.put((acked, None))
            if not release.wait(TIMEOUT):
                raise TimeoutError("never released")
    except BaseException:
        results.put((acked, traceback.format_exc()))
