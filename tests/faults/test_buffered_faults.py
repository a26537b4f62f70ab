"""Buffered counters under faults, on real Redis and PostgreSQL: flushes SIGKILLed at each
of their three crash points while writers write, the cache wiped under load, flushes
racing each other, and the stored value following the increments by scheduled flushes.

Children are forked (entry points in ``buffered_workers.py``); they synchronise on events,
pipes and shared counters polled with a deadline, never on sleeps (the few sleeps pick
moments of the workload). Redis database 11 is this file's alone: the wipe test empties it.
"""

from __future__ import annotations

import itertools
import multiprocessing
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis

import buffered_workers as bw
import shardkit
from backends import NEVER, PREFIX, store_url_for, wait_for
from shardkit.counters.generations import Parts

FORK = multiprocessing.get_context("fork")
DEADLINE = 30.0  # seconds: a generous bound for anything a test waits for


@pytest.fixture
def where(sqlite_url: str, own_redis: str) -> bw.Where:
    """The worker's own Redis (the wipe test empties it) and PostgreSQL, under the
    session's table prefix."""
    return (store_url_for("postgres", sqlite_url), own_redis, PREFIX)


@contextmanager
def _processes(target: Callable[..., None], args: list[tuple[Any, ...]]) -> Iterator[list[Any]]:
    """Forked processes running ``target(*a)`` for each ``a``; killed if still alive."""
    procs = [FORK.Process(target=target, args=a, daemon=True) for a in args]
    try:
        for proc in procs:
            proc.start()
        yield procs
    finally:
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                proc.kill()
        for proc in procs:
            if proc.pid is not None:
                proc.join(DEADLINE)


def _results(queue: Any, count: int) -> dict[int, Any]:
    """``count`` results from worker processes, each ``(slot, payload, error)``, by slot."""
    got = [queue.get(timeout=DEADLINE) for _ in range(count)]
    errors = [error for _, _, error in got if error]
    assert not errors, "a worker failed:\n" + "\n".join(errors)
    return {slot: payload for slot, payload, _ in got}


def _alive(procs: list[Any], queue: Any) -> bool:
    """True while every process runs; fails the test with their errors once one exits."""
    if all(proc.is_alive() for proc in procs):
        return True
    _results(queue, sum(not proc.is_alive() for proc in procs))
    pytest.fail("a worker exited before it was told to stop")


class Writers:
    """Writer processes on one buffered counter (``buffered_workers.writer``)."""

    def __init__(
        self,
        where: bw.Where,
        name: str,
        count: int,
        *,
        signed: bool,
        interval: float,
        flushing: bool,
    ) -> None:
        self.count = count
        self.signed = signed
        self.seeds = [random.randrange(1 << 32) for _ in range(count)]
        self.start, self.stop = FORK.Event(), FORK.Event()
        self.begun, self.done = FORK.RawArray("q", count), FORK.RawArray("q", count)
        self.queue = FORK.Queue()
        self.shared = (self.start, self.stop, self.begun, self.done, self.queue)
        self.args = [
            (where, name, slot, seed, signed, interval, flushing, *self.shared)
            for slot, seed in enumerate(self.seeds)
        ]

    def started_sum(self) -> int:
        """The sum of every delta whose ``incr`` has been called so far (returned or not)."""
        begun = zip(self.seeds, list(self.begun), strict=True)
        return sum(bw.deltas_sum(seed, self.signed, count) for seed, count in begun)

    def finish(self) -> tuple[int, int]:
        """Stop the writers; return (increments acknowledged, their sum), checked against
        the deltas each writer was given."""
        self.stop.set()
        reports = _results(self.queue, self.count)
        for slot, (acked, total) in reports.items():
            assert acked == self.done[slot] == self.begun[slot]  # none left in flight
            assert total == bw.deltas_sum(self.seeds[slot], self.signed, acked)
        return sum(n for n, _ in reports.values()), sum(t for _, t in reports.values())


# -- (a) flushers killed at each crash point --------------------------------------------

FLUSHERS = 27  # 9 per crash point


@pytest.mark.slow
@pytest.mark.parametrize(
    "flusher", [bw.doomed_flusher, bw.async_doomed_flusher], ids=["sync", "async"]
)
def test_flushes_killed_at_every_crash_point_never_lose_or_double(
    where: bw.Where, name: str, flusher: Callable[..., None]
) -> None:
    """Flushes (of a sync kit, or an async one, while sync writers count) killed at each
    point of a flush: what the store holds is exactly what the flushes that committed
    moved, and a last flush moves the rest, exactly."""
    began = time.monotonic()
    writers = Writers(where, name, 3, signed=True, interval=NEVER, flushing=False)
    killed = dict.fromkeys(bw.STAGES, 0)
    moved_by_kills = 0  # by flushes that committed and then died
    with bw.connect(where, flushing=False) as kit:
        counter = kit.buffered(name, interval=NEVER)
        with _processes(bw.writer, writers.args) as procs:
            writers.start.set()
            wait_for(lambda: _alive(procs, writers.queue) and min(writers.done) > 0, "writes")
            expected_stored = 0  # what the flushers reported moving, so far
            for index in range(FLUSHERS):
                assert _alive(procs, writers.queue)
                stage = bw.STAGES[index % len(bw.STAGES)]
                report, send = FORK.Pipe(duplex=False)
                args = (where, name, stage, random.randint(0, 2), send)
                with _processes(flusher, [args]) as (doomed,):
                    send.close()  # the child's copy is the only one: EOF once it is dead
                    messages = []
                    while report.poll(DEADLINE):
                        try:
                            messages.append(report.recv())
                        except EOFError:
                            break
                    doomed.join(DEADLINE)
                    assert doomed.exitcode == -9, messages  # died by SIGKILL, nothing else
                report.close()

                # What the flusher did before it died, and what the store holds now.
                (warmed, moved), (armed, record), last = messages
                assert (warmed, armed) == ("warmed", "armed"), messages
                expected_stored += sum(moved)
                after = bw.store_record(kit, name)
                if stage == bw.BEFORE_READ:
                    assert last == ("reading",)
                    assert after == record  # died before reading: nothing applied
                elif stage == bw.BEFORE_COMMIT:
                    what, generation, seen, to = last
                    assert what == "advancing"
                    assert record[generation] == seen != to
                    assert after == record  # died before committing: nothing applied
                else:
                    what, generation, seen, to = last
                    assert what == "advanced"
                    assert record[generation] == seen != to
                    assert after == {**record, generation: to}  # committed, then died
                    moved_by_kills += (to[0] - to[1]) - (seen[0] - seen[1])
                    expected_stored += (to[0] - to[1]) - (seen[0] - seen[1])
                killed[stage] += 1
                assert counter.parts().stored == expected_stored
            stored_before_end = counter.parts().stored
            increments, acked = writers.finish()
        assert counter.flush() == acked - stored_before_end
        assert counter.parts() == Parts(stored=acked, pending=0)
        assert kit.store.total(name) == acked
    assert killed == dict.fromkeys(bw.STAGES, FLUSHERS // len(bw.STAGES))
    # Flushes killed after their commit really moved counts, so a double or a loss shows.
    assert moved_by_kills != 0
    assert stored_before_end == expected_stored != 0
    print(
        f"\n{FLUSHERS} flushers killed ({killed}); {increments} increments, "
        f"sum {acked}, {time.monotonic() - began:.1f} s"
    )


# -- (c) the cache wiped under load -------------------------------------------------------

WIPE_INTERVAL = 0.5


@pytest.mark.slow
def test_a_wiped_cache_loses_at_most_what_was_pending(where: bw.Where, name: str) -> None:
    writers = Writers(where, name, 3, signed=False, interval=WIPE_INTERVAL, flushing=True)
    raw = redis.Redis.from_url(where[1])
    try:
        with bw.connect(where, flushing=False) as kit:
            counter = kit.buffered(name, interval=WIPE_INTERVAL)
            with _processes(bw.writer, writers.args) as procs:
                writers.start.set()
                began = time.monotonic()

                def two_flushes(when: str) -> None:
                    for what in (f"a flush {when}", f"a second flush {when}"):
                        floor = counter.parts().stored
                        wait_for(
                            lambda floor=floor: (  # type: ignore[misc]
                                _alive(procs, writers.queue) and counter.parts().stored > floor
                            ),
                            what,
                        )

                # Scheduled flushes have run twice: writes and flushes are in full swing.
                two_flushes("before the wipe")
                # Wipe at a random moment of an interval, not just after a flush (when
                # little is pending): this sleep picks the moment, it waits for nothing.
                time.sleep(random.uniform(0, WIPE_INTERVAL))
                stored_before = counter.parts().stored
                raw.flushdb()
                phase = time.time() % WIPE_INTERVAL  # scheduled flushes fall at multiples
                started_at_wipe = writers.started_sum()  # every increment the wipe can lose
                stored_after = counter.parts().stored
                assert stored_after >= stored_before
                # The counter keeps working: new increments are flushed, twice.
                two_flushes("after the wipe")
                increments, acked = writers.finish()
                elapsed = time.monotonic() - began
            counter.flush()
            stored, pending = counter.parts()
            generations = kit.store.generations([name])[name]
    finally:
        raw.close()
    loss = acked - stored
    pending_at_wipe = started_at_wipe - stored_before  # an upper bound
    mean = acked / increments
    print(
        f"\ncache wiped {phase:.2f} s into a {WIPE_INTERVAL} s interval: lost {loss} "
        f"(~{loss / mean:.0f} increments) of {acked} acknowledged ({increments} increments); "
        f"pending at the wipe ≤ {pending_at_wipe} (~{pending_at_wipe / mean:.0f} increments); "
        f"{increments / elapsed:.0f} increments/s by {writers.count} processes for "
        f"{elapsed:.1f} s; {len(generations)} generations"
    )
    assert 0 <= loss <= pending_at_wipe
    assert pending == 0
    assert stored > stored_after  # flushed after the wipe
    assert len(generations) >= 2  # the wiped generation, and the writers' new one(s)


# -- (d) concurrent flushes ---------------------------------------------------------------

RACING_PROCESSES = 2
THREADS = 2  # per racing process, and in this one
FLUSH_CALLS = 600  # at least, in all


@pytest.mark.slow
def test_concurrent_flushes_never_apply_a_count_twice(where: bw.Where, name: str) -> None:
    writers = Writers(where, name, 2, signed=True, interval=NEVER, flushing=False)
    slots = (RACING_PROCESSES + 1) * THREADS
    calls = FORK.RawArray("q", slots)
    stop = FORK.Event()
    queue = FORK.Queue()
    args = [
        (where, name, slot, THREADS, writers.start, stop, calls, queue)
        for slot in range(RACING_PROCESSES)
    ]
    with bw.connect(where, flushing=False) as kit:
        counter = kit.buffered(name, interval=NEVER)
        conflicts = bw.count_conflicts(kit)
        with _processes(bw.writer, writers.args), _processes(bw.racing_flusher, args) as procs:
            moved: list[int] = []
            errors: list[BaseException] = []

            def run(index: int) -> None:
                try:
                    moved.append(bw.flush_loop(counter, stop, calls, slots - THREADS + index))
                except BaseException as exc:
                    errors.append(exc)
                    stop.set()

            threads = [threading.Thread(target=run, args=(index,)) for index in range(THREADS)]
            writers.start.set()
            for thread in threads:
                thread.start()
            try:
                wait_for(
                    lambda: (
                        _alive(procs, queue)
                        and sum(calls) >= FLUSH_CALLS
                        and min(calls) > 0
                        and min(writers.done) > 0
                    ),
                    f"{FLUSH_CALLS} flushes",
                    status=lambda: list(calls),
                )
                increments, acked = writers.finish()
            finally:
                stop.set()
                for thread in threads:
                    thread.join(DEADLINE)
            assert not errors, errors
            reports = _results(queue, RACING_PROCESSES)
        last = counter.flush()
        assert counter.parts() == Parts(stored=acked, pending=0)
    total_moved = sum(moved) + sum(amount for amount, _ in reports.values()) + last
    assert total_moved == acked  # every amount moved was counted once, by one flush
    lost_races = conflicts[0] + sum(lost for _, lost in reports.values())
    print(
        f"\n{sum(calls)} concurrent flushes, {lost_races} compare-and-sets lost and "
        f"retried; {increments} increments, sum {acked}"
    )
    assert lost_races > 0  # the flushes did race: the compare-and-set's retry path ran


# -- (e) the stored value following the increments ----------------------------------------

STALE_INTERVAL = 0.5
ADVANCES = 3  # the stored value advances this often while the increments go on
POLL = 0.02


def _watch_stored(
    counter: Any, stop: Any, done: Callable[[], list[int] | None]
) -> tuple[list[int], list[int]]:
    """The values ``counter.parts().stored`` takes (sampled every POLL seconds) while an
    incrementer increments, nobody flushing but its kit's schedule: once the value has
    advanced ADVANCES times, ``stop`` is set; once ``done()`` returns the acknowledged
    deltas, sampling goes on until the value holds their sum. Fails after DEADLINE
    seconds, which only a flush that is never scheduled misses. Returns (the values, in
    order, the acknowledged deltas)."""
    seen = [counter.parts().stored]
    acked: list[int] | None = None
    deadline = time.monotonic() + DEADLINE
    while True:
        value = counter.parts().stored
        if value != seen[-1]:
            seen.append(value)
        if len(seen) > ADVANCES:
            stop.set()
        if acked is None:
            acked = done()
        if acked is not None and value == sum(acked):
            return seen, acked
        assert time.monotonic() < deadline, (
            f"the stored value took {seen} in {DEADLINE} s; acknowledged: {acked}"
        )
        time.sleep(POLL)


def _check_order(seen: list[int], acked: list[int]) -> None:
    """Each value the store held was the sum of the increments acknowledged up to some
    point (one incrementer, positive deltas: flushes move them in order, none twice or
    skipped), increasing to their sum; it advanced ADVANCES times before the increments
    stopped, so scheduled flushes, not the end, moved them."""
    prefixes = set(itertools.accumulate(acked, initial=0))
    assert [value for value in seen if value not in prefixes] == []
    assert seen == sorted(seen)
    assert seen[-1] == sum(acked)
    assert len(seen) > ADVANCES  # the stop came after the ADVANCES-th advance
    print(f"\n{len(acked)} increments, the stored value advanced {len(seen) - 1} times")


@pytest.mark.slow
def test_stored_value_follows_the_increments_by_scheduled_flushes(
    where: bw.Where, name: str
) -> None:
    """An incrementing process, whose kit flushes every interval (PostgreSQL, Redis);
    this process reads the stored value and never flushes."""
    start, stop, release = FORK.Event(), FORK.Event(), FORK.Event()
    queue = FORK.Queue()
    args = (where, name, random.randrange(1 << 32), STALE_INTERVAL)
    with bw.connect(where, flushing=False) as kit:
        counter = kit.buffered(name, interval=STALE_INTERVAL)
        with _processes(bw.incrementer, [(*args, start, stop, release, queue)]) as (proc,):
            start.set()
            results: list[Any] = []

            def done() -> list[int] | None:
                if not results and not queue.empty():
                    results.append(queue.get())
                if not results:
                    assert proc.is_alive(), "the incrementer died"
                    return None
                acked, error = results[0]
                assert error is None, error
                return acked  # type: ignore[no-any-return]

            try:
                seen, acked = _watch_stored(counter, stop, done)
            finally:
                stop.set()
                release.set()
            proc.join(DEADLINE)
            assert proc.exitcode == 0
    _check_order(seen, acked)


@pytest.mark.slow
def test_stored_value_follows_the_increments_by_scheduled_flushes_embedded(
    sqlite_url: str, name: str
) -> None:
    """The embedded default (SQLite file, in-process cache): the flush runs in this
    process, scheduled by the kit's own local executor."""
    store_url_for("sqlite", sqlite_url)  # the session drops its tables at the end
    with shardkit.connect(sqlite_url, "memory://", prefix=PREFIX) as kit:
        counter = kit.buffered(name, interval=STALE_INTERVAL)
        stop = threading.Event()
        results: list[list[int]] = []
        errors: list[BaseException] = []

        def increment() -> None:
            try:
                results.append(bw.increment_until(counter, random.randrange(1 << 32), stop))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=increment)
        thread.start()

        def done() -> list[int] | None:
            if thread.is_alive():
                return None
            assert not errors, errors
            return results[0]

        try:
            seen, acked = _watch_stored(counter, stop, done)
        finally:
            stop.set()
            thread.join(DEADLINE)
    _check_order(seen, acked)
