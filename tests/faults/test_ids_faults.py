"""The id allocator's guarantee under faults: many processes take ids while the cache is
wiped and takers are SIGKILLed and replaced; no id is ever handed out twice, and every
process's ids increase; with sub-blocks, every id the store reserved is accounted for.
With sub-blocks on a shared cache the blocks grow, so the blocks the store reserved are
recorded as it reserves them (a trigger on PostgreSQL's marks table).

Takers are forked (entry point in ``ids_workers.py``); each appends every id it is handed
to its own file before taking the next, so a SIGKILL loses only an id no caller saw (a
hole). The test synchronises on those files and on lock-free shared flags, polled with a
deadline, never on sleeps. Redis database 8 (of the tests' server) is this file's alone:
the wipes empty it.
"""

from __future__ import annotations

import bisect
import itertools
import multiprocessing
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

import ids_workers as iw
import shardkit
from backends import PREFIX, store_url_for, wait_for
from shardkit.counters.ids import SUB_BLOCK

FORK = multiprocessing.get_context("fork")
DEADLINE = 30.0  # seconds: a generous bound for anything a test waits for


@dataclass
class Run:
    """One taker process: the slot it fills, and the file it records its ids in."""

    slot: int
    path: str
    proc: Any
    report: Any  # the receiving end of its pipe
    killed: bool = False


@dataclass
class Wipe:
    """What every taker's file held just before a wipe of the cache, and just after."""

    before: dict[str, int]
    after: dict[str, int]


@dataclass
class Outcome:
    runs: list[Run]
    ids: dict[str, list[int]]  # by file, in the order handed out
    wipes: list[Wipe] = field(default_factory=list)
    seconds: float = 0.0


class Takers:
    """``count`` slots of taker processes (``ids_workers.taker``, one thread each) on one
    allocator; a killed taker is replaced by a new process, with its own kit and its own
    file."""

    def __init__(
        self, where: iw.Where, name: str, blocks: tuple[int, int], directory: Path, count: int
    ):
        self.where, self.name, self.blocks, self.directory = where, name, blocks, directory
        self.start, self.stop = FORK.RawValue("b", 0), FORK.RawValue("b", 0)
        self.runs: list[Run] = []  # every taker ever started
        self.running = [self._launch(slot) for slot in range(count)]

    def _launch(self, slot: int) -> Run:
        path = str(self.directory / f"taker{slot:02d}-{len(self.runs):03d}.ids")
        report, send = FORK.Pipe(duplex=False)
        args = (self.where, self.name, *self.blocks, [path], self.start, self.stop, send)
        proc = FORK.Process(target=iw.taker, args=args, daemon=True)
        run = Run(slot, path, proc, report)
        self.runs.append(run)
        proc.start()
        send.close()  # the child's copy is the only one: EOF once it is dead
        return run

    def progress(self) -> int:
        """Ids recorded so far, by every taker ever started."""
        return sum(iw.recorded(run.path) for run in self.runs)

    def newest(self) -> int:
        """The highest id any running taker has recorded last."""
        return max(iw.last_id(run.path) for run in self.running)

    def counts(self) -> dict[str, int]:
        return {run.path: iw.recorded(run.path) for run in self.runs}

    def alive(self) -> bool:
        """True while every running taker runs; fails the test with its report once one
        has exited by itself."""
        for run in self.running:
            if not run.proc.is_alive():
                try:
                    message = run.report.recv() if run.report.poll(DEADLINE) else "no report"
                except EOFError:
                    message = "no report"
                pytest.fail(f"taker {run.path} exited ({run.proc.exitcode}): {message}")
        return True

    def kill_one(self) -> Run:
        """SIGKILL a running taker that has taken ids, and start its replacement."""
        wait_for(
            lambda: self.alive() and any(iw.recorded(run.path) for run in self.running),
            "a taker with ids",
        )
        victim = random.choice([run for run in self.running if iw.recorded(run.path)])
        victim.proc.kill()
        victim.proc.join(DEADLINE)
        assert victim.proc.exitcode == -9  # died by SIGKILL, nothing else
        victim.killed = True
        victim.report.close()
        self.running[victim.slot] = self._launch(victim.slot)
        return victim

    def finish(self) -> None:
        """Stop the running takers; check each took exactly the ids its file holds."""
        self.stop.value = 1
        for run in self.running:
            assert run.report.poll(DEADLINE), f"taker {run.path} never reported"
            taken, _, error = run.report.recv()
            assert error is None, f"taker {run.path} failed:\n{error}"
            run.proc.join(DEADLINE)
            assert run.proc.exitcode == 0
            assert taken == iw.recorded(run.path)
            run.report.close()

    def close(self) -> None:
        """Kill whatever still runs (after a failure), and reap every process."""
        for run in self.runs:
            if run.proc.is_alive():
                run.proc.kill()
        for run in self.runs:
            run.proc.join(DEADLINE)


@contextmanager
def _takers(
    where: iw.Where, name: str, blocks: tuple[int, int], directory: Path, count: int
) -> Iterator[Takers]:
    takers = Takers(where, name, blocks, directory, count)
    try:
        yield takers
    finally:
        takers.close()


def _take_under_faults(
    where: iw.Where,
    name: str,
    directory: Path,
    *,
    takers: int,
    block: int,
    sub_block: int,
    total: int,
    kills: int,
    wipes: int = 0,
    wipe: Callable[[], None] | None = None,
    marks: Callable[[], list[int]] | None = None,
) -> Outcome:
    """Run ``takers`` processes until they have recorded ``total`` ids, meanwhile calling
    ``wipe()`` ``wipes`` times and SIGKILLing (and replacing) ``kills`` takers, each at a
    moment of the workload: kills at random, wipes spread out evenly (give or take a
    little), each once the newest id recorded lies in the first half of its block (of
    ``block`` ids, or of those ``marks()`` returns where blocks grow), so that the wipe
    finds a block in use with ids left to lose."""
    step = total / (wipes + 1)
    moments = [(step * (n + random.uniform(0.75, 1.25)), "wipe") for n in range(wipes)]
    moments += [(total * random.uniform(0.05, 0.9), "kill") for _ in range(kills)]
    moments.sort()
    with _takers(where, name, (block, sub_block), directory, takers) as procs:
        known: list[int] = []  # the marks read so far

        def early_in_its_block() -> bool:
            newest = procs.newest()
            if marks is None:
                return (newest - 1) % block < block // 2
            last = known[-1] if known else 0
            if newest > last:  # in a block reserved since, of ``block`` ids or more
                if newest - last <= block // 2:
                    return True
                known[:] = marks()
                newest = procs.newest()  # again: reading the marks takes a while
            index = bisect.bisect_left(known, newest)
            if not newest or index == len(known):
                return False
            start = known[index - 1] if index else 0
            return newest - start <= (known[index] - start) // 2

        def reach(count: int, what: str, early: bool = False) -> None:
            wait_for(
                lambda: (
                    procs.alive()
                    and procs.progress() >= count
                    and (not early or early_in_its_block())
                ),
                f"{what} at {count} ids" + (" early in a block" if early else ""),
                DEADLINE,
                lambda: f"({procs.progress()} ids recorded, newest {procs.newest()})",
            )

        procs.start.value = 1
        began = time.monotonic()
        done: list[Wipe] = []
        floor = 0  # ids recorded past which a wipe's effect has been seen
        for at, what in moments:
            reach(max(round(at), floor), what, early=what == "wipe")
            if what == "kill":
                procs.kill_one()
            else:
                assert wipe is not None
                before = procs.counts()
                wipe()
                after = procs.counts()
                done.append(Wipe(before, after))
                # After a wipe, a taker records at most one id in flight and the rest of
                # the sub-block in its hand from the blocks the wipe retired: this many
                # ids more, and some taker has gone on in a new block (the takers can
                # outrun the polls, so a late wipe is not followed by the next moment's
                # ids alone).
                floor = sum(after.values()) + takers * (sub_block + 1)
        reach(max(total, floor), "the end")
        procs.finish()
        seconds = time.monotonic() - began
        runs = procs.runs
    return Outcome(runs, {run.path: iw.read_ids(run.path) for run in runs}, done, seconds)


def _check_unique_and_increasing(outcome: Outcome, reserved: int) -> list[int]:
    """Every id recorded: none twice, increasing within each taker, in 1 … ``reserved``."""
    every = [each for ids in outcome.ids.values() for each in ids]
    twice = [each for each, times in Counter(every).items() if times > 1]
    assert not twice, f"{len(twice)} ids handed out more than once, e.g. {sorted(twice)[:10]}"
    for path, ids in outcome.ids.items():
        falls = [(a, b) for a, b in itertools.pairwise(ids) if a >= b]
        assert not falls, f"{path}: ids did not increase, e.g. {falls[:5]}"
    assert min(every) >= 1
    assert max(every) <= reserved
    return every


def _blocks(ids: list[int], marks: list[int]) -> set[int]:
    """The blocks the ids lie in, by their marks: the store reserves each block above the
    last, from 0, so the block of mark ``marks[k]`` is ``marks[k - 1] + 1 … marks[k]``."""
    return {marks[bisect.bisect_left(marks, each)] for each in ids}


def _sizes(marks: list[int]) -> Counter[int]:
    """How many blocks of each size ``marks`` reserved."""
    return Counter(b - a for a, b in itertools.pairwise([0, *marks]))


def _summary(outcome: Outcome, every: list[int], marks: list[int]) -> str:
    kills = sum(run.killed for run in outcome.runs)
    sizes = ", ".join(f"{n} of {size}" for size, n in sorted(_sizes(marks).items()))
    return (
        f"{len(every)} ids by {len(outcome.runs)} processes ({kills} SIGKILLed and "
        f"replaced), {len(outcome.wipes)} cache wipes; {len(marks)} blocks reserved "
        f"({sizes}), {len(_blocks(every, marks))} used; {outcome.seconds:.1f} s "
        f"({len(every) / outcome.seconds:.0f} ids/s)"
    )


@contextmanager
def _reservations(url: str, name: str) -> Iterator[Callable[[], list[int]]]:
    """Record the mark of every block the PostgreSQL store at ``url`` reserves for
    allocator ``name`` from now on, in the reserving transaction (by a trigger on the
    marks table): yields what reads them, in increasing order."""
    engine = sa.create_engine(url)
    log = f"{PREFIX}test_marks_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {log} (name text NOT NULL, mark bigint NOT NULL)")
        conn.exec_driver_sql(
            f"CREATE FUNCTION {log}() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN INSERT INTO {log} VALUES (NEW.name, NEW.mark); RETURN NULL; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER {log} AFTER INSERT OR UPDATE ON {PREFIX}marks "
            f"FOR EACH ROW EXECUTE FUNCTION {log}()"
        )

    def marks() -> list[int]:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql(
                f"SELECT mark FROM {log} WHERE name = %(name)s ORDER BY mark", {"name": name}
            )
            return [int(mark) for (mark,) in rows]

    try:
        yield marks
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER {log} ON {PREFIX}marks")
            conn.exec_driver_sql(f"DROP FUNCTION {log}()")
            conn.exec_driver_sql(f"DROP TABLE {log}")
        engine.dispose()


# -- PostgreSQL + Redis ---------------------------------------------------------------------

TAKERS = 16
TOTAL = 80_000
BLOCK = 200
WIPES = 12
KILLS = 5


@pytest.mark.slow
@pytest.mark.parametrize("sub_block", [1, 10], ids=["sequence", "sub-blocks"])
def test_ids_stay_unique_through_cache_wipes_and_killed_processes(
    sqlite_url: str, own_redis: str, tmp_path: Path, sub_block: int
) -> None:
    where = (store_url_for("postgres", sqlite_url), own_redis, PREFIX)
    name = f"test:{uuid.uuid4().hex}"
    raw = redis.Redis.from_url(own_redis)
    try:
        raw.ping()  # connected now: a wipe is then one quick round trip
        with (
            shardkit.connect(where[0], own_redis, prefix=PREFIX) as kit,
            _reservations(where[0], name) as reserved_marks,
        ):
            allocator = kit.ids(name, block=BLOCK)  # created before any taker starts
            outcome = _take_under_faults(
                where,
                name,
                tmp_path,
                takers=TAKERS,
                block=BLOCK,
                sub_block=sub_block,
                total=TOTAL,
                kills=KILLS,
                wipes=WIPES,
                wipe=raw.flushdb,  # database 8 only, never FLUSHALL
                marks=reserved_marks if sub_block > 1 else None,  # blocks grow or not
            )
            reserved = allocator.reserved()
            marks = reserved_marks()
    finally:
        raw.close()
    every = _check_unique_and_increasing(outcome, reserved)
    print("\n" + _summary(outcome, every, marks))
    assert len(every) >= TOTAL
    assert len(outcome.wipes) == WIPES >= 10
    assert sum(run.killed for run in outcome.runs) == KILLS >= 4
    assert len(outcome.runs) == TAKERS + KILLS
    # Blocks of 200, growing with sub-blocks only, to 64 times that at most.
    assert marks[-1] == reserved
    grown = range(BLOCK, 64 * BLOCK + 1, BLOCK) if sub_block > 1 else [BLOCK]
    assert set(_sizes(marks)) <= set(grown)
    # The wipes mattered. Each one retired every block in use: after it (after the record
    # that may have been in flight), a taker hands out first the rest of the sub-block in
    # its hand (none with a sub-block of 1), then no id of a block that handed out an id
    # before it. And the newest of those blocks was left with ids unused, lost to the wipe.
    highest: dict[int, int] = {}  # block (its mark) -> the highest id recorded in it
    for each in every:
        block = marks[bisect.bisect_left(marks, each)]
        highest[block] = max(highest.get(block, 0), each)
    left_unused = []
    for number, wiped in enumerate(outcome.wipes):
        before: set[int] = set()
        after: set[int] = set()
        for path, ids in outcome.ids.items():
            before |= _blocks(ids[: wiped.before.get(path, 0)], marks)
        assert before, f"no ids before wipe {number}"
        for path, ids in outcome.ids.items():
            later = ids[wiped.after[path] + 1 if path in wiped.after else 0 :]
            rest = []
            for each in later:
                if not _blocks([each], marks) <= before:
                    break
                rest.append(each)
            assert len(rest) < sub_block, f"wipe {number}: {path} went on with {rest}"
            after |= _blocks(later[len(rest) :], marks)
        assert after, f"no ids after wipe {number}"
        assert not before & after, f"wipe {number}: blocks {sorted(before & after)} lived on"
        newest = max(before)
        left_unused.append(newest - highest[newest])
    print(f"ids left unused in the newest block by each wipe: {left_unused}")
    assert sum(map(bool, left_unused)) >= WIPES // 2


# -- sub-blocks, exactly: processes of many threads, one SIGKILLed ----------------------

CREW = 3  # processes that finish
THREADS = 4  # a process's
EACH = 400  # ids a thread takes
CREW_BLOCK = 100
CREW_SUB_BLOCK = 7  # so that a block's end cuts most blocks' last sub-block short


@pytest.mark.slow
def test_sub_blocks_account_for_every_id_reserved_across_threads_processes_and_a_kill(
    sqlite_url: str, own_redis: str, tmp_path: Path
) -> None:
    """Processes of four threads share blocks by sub-blocks while one of them is
    SIGKILLed: no id is handed out twice, each thread's ids increase, none lies above
    the store's mark, and every id the store reserved is handed out, in the hand of a
    process that finished, above the count of the block in use, or lost with the killed
    process (the rest of its sub-block and an id a thread, or a whole block it reserved
    and died before publishing). Every block's key is read at the end: the writers
    that waited for a killed claimant may each have started a block of their own."""
    where = (store_url_for("postgres", sqlite_url), own_redis, PREFIX)
    name = f"test:{uuid.uuid4().hex}"
    start, stop = FORK.RawValue("b", 0), FORK.RawValue("b", 0)
    procs: list[tuple[Any, list[str], Any]] = []

    def launch(slot: int, count: int | None) -> tuple[Any, list[str], Any]:
        paths = [str(tmp_path / f"crew{slot}-{thread}.ids") for thread in range(THREADS)]
        report, send = FORK.Pipe(duplex=False)
        blocks = (CREW_BLOCK, CREW_SUB_BLOCK)
        args = (where, name, *blocks, paths, start, stop, send, count)
        proc = FORK.Process(target=iw.taker, args=args, daemon=True)
        proc.start()
        send.close()
        procs.append((proc, paths, report))
        return procs[-1]

    with (
        shardkit.connect(where[0], own_redis, prefix=PREFIX) as kit,
        _reservations(where[0], name) as reserved_marks,
    ):
        allocator = kit.ids(name, block=CREW_BLOCK, sub_block=CREW_SUB_BLOCK)
        try:
            crew = [launch(slot, EACH) for slot in range(CREW)]
            victim, victim_paths, _ = launch(CREW, None)  # takes until killed
            start.value = 1
            wait_for(
                lambda: victim.is_alive() and sum(map(iw.recorded, victim_paths)) >= 300,
                "the victim's ids",
                DEADLINE,
            )
            victim.kill()
            victim.join(DEADLINE)
            assert victim.exitcode == -9
            in_hand = []
            for proc, _, report in crew:
                assert report.poll(DEADLINE), "a process never reported"
                taken, rest, error = report.recv()
                assert error is None, error
                proc.join(DEADLINE)
                assert (proc.exitcode, taken) == (0, THREADS * EACH)
                in_hand += range(rest[0], rest[1] + 1)
        finally:
            stop.value = 1
            for proc, _, _ in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(DEADLINE)
        reserved = allocator.reserved()
        marks = reserved_marks()
        # What each block's key has handed out, while it still has ids left: a block
        # used up has none (its leaver deleted it), one never published neither.
        counts = kit.cache.get_many([allocator._key_of(mark) for mark in marks])
    handed = {path: iw.read_ids(path) for _, paths, _ in procs for path in paths}
    every = [each for ids in handed.values() for each in ids]
    assert len(every) >= CREW * THREADS * EACH + 300
    for path, ids in handed.items():
        assert ids == sorted(ids), f"{path}: ids did not increase"
    untaken = [
        each
        for mark in marks
        if (count := counts.get(allocator._key_of(mark))) is not None
        for each in range(count + 1, mark + 1)
    ]
    accounted = Counter([*every, *in_hand, *untaken])
    twice = [each for each, times in accounted.items() if times > 1]
    assert not twice, f"{len(twice)} ids twice (handed, in hand or untaken): {sorted(twice)[:10]}"
    assert min(accounted) >= 1
    assert max(accounted) <= reserved
    missing = set(range(1, reserved + 1)) - set(accounted)
    whole = _blocks(list(missing), marks) - _blocks(every, marks)
    lost = sorted(each for each in missing if not _blocks([each], marks) <= whole)
    sizes = ", ".join(f"{n} of {size}" for size, n in sorted(_sizes(marks).items()))
    print(
        f"\n{len(every)} ids by {CREW} processes of {THREADS} threads and one killed; "
        f"blocks {sizes}; {len(in_hand)} in hand at the end, {len(untaken)} untaken, "
        f"{len(lost)} lost with the killed process {lost}, {len(whole)} whole blocks lost"
    )
    assert marks[-1] == reserved
    assert set(_sizes(marks)) <= set(range(CREW_BLOCK, 64 * CREW_BLOCK + 1, CREW_BLOCK))
    assert len(lost) <= CREW_SUB_BLOCK - 1 + THREADS


# -- the embedded default: SQLite file, in-process cache --------------------------------

EMBEDDED_TAKERS = 4
EMBEDDED_TOTAL = 40_000
EMBEDDED_BLOCK = 100
EMBEDDED_KILLS = 2


@pytest.mark.slow
def test_embedded_ids_stay_unique_through_killed_processes(sqlite_url: str, tmp_path: Path) -> None:
    store_url_for("sqlite", sqlite_url)  # the session drops its tables at the end
    where = (sqlite_url, "memory://", PREFIX)
    name = f"test:{uuid.uuid4().hex}"
    with shardkit.connect(sqlite_url, "memory://", prefix=PREFIX) as kit:
        allocator = kit.ids(name, block=EMBEDDED_BLOCK)
        outcome = _take_under_faults(
            where,
            name,
            tmp_path,
            takers=EMBEDDED_TAKERS,
            block=EMBEDDED_BLOCK,
            sub_block=SUB_BLOCK,
            total=EMBEDDED_TOTAL,
            kills=EMBEDDED_KILLS,
        )
        reserved = allocator.reserved()
    # Each process's cache is its own: its blocks are never published ahead, nor grow.
    marks = list(range(EMBEDDED_BLOCK, reserved + 1, EMBEDDED_BLOCK))
    every = _check_unique_and_increasing(outcome, reserved)
    print("\n" + _summary(outcome, every, marks))
    assert len(every) >= EMBEDDED_TOTAL
    assert sum(run.killed for run in outcome.runs) == EMBEDDED_KILLS
    assert len(outcome.runs) == EMBEDDED_TAKERS + EMBEDDED_KILLS
    # Every block served exactly one process.
    owners: dict[int, str] = {}
    for path, ids in outcome.ids.items():
        for each in _blocks(ids, marks):
            assert owners.setdefault(each, path) == path, f"block {each} served two processes"
