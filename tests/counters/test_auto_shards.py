"""Automatic sharded counters (``shards="auto"``): grown when more writers than shards
take turns on their rows, never otherwise."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import re
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import shardkit
from backends import PREFIX, redis_database, store_url_for, wait_for
from received import shard_counts
from shardkit import _program
from shardkit.counters.sharded import _SHARDS_REFRESH
from shardkit.counters.sizing import BUSY, LOOKBACK, SETTLE, WINDOW, Sizing, Window
from workers import auto_writer

CACHE = redis_database(11)  # shared by the writer processes: they count each other there
SECONDS = 4.0  # each writer's run: a few windows


def _run_writers(
    store_url: str, name: str, processes: int, cache: str = CACHE
) -> tuple[int, list[int]]:
    """``processes`` spawned writers on ``name`` at once, on ``cache``; their increments'
    total and the shard counts they ended with."""
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    where = (store_url, cache, PREFIX)
    children = [
        context.Process(target=auto_writer, args=(where, name, SECONDS, start, results))
        for _ in range(processes)
    ]
    for child in children:
        child.start()
    start.set()
    outcomes = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(30)
    errors = [error for _, _, error in outcomes if error]
    assert not errors, errors[0]
    return sum(done for done, _, _ in outcomes), [shards for _, shards, _ in outcomes]


@pytest.mark.parametrize("kind", ["postgres", "mysql"])
def test_writers_taking_turns_on_a_row_grow_the_counter_once_and_count_exactly(
    kind: str, sqlite_url: str
) -> None:
    """4 writer processes take turns on the row of a counter that 12 more writers are
    reported to write (as other processes of a fleet count themselves): the processes
    that decide, each at most once in its run (``SETTLE``), see 12 to 16 writers in a
    second (each process counts itself once a window, a second at least), which all
    round up to 16 shards. The store's row takes one growth, from 1 to 16."""
    store_url = store_url_for(kind, sqlite_url)
    name = f"test:auto:{uuid.uuid4().hex}"
    with (
        shardkit.connect(store_url, CACHE, prefix=PREFIX) as kit,
        shard_counts(kit.store.engine, PREFIX, name) as written,
    ):
        assert kit.sharded(name, shards="auto").shards == 1  # created with one
        _report_writers(kit, name, 12, RUN)
        done, seen = _run_writers(store_url, name, 4)
        with shardkit.connect(store_url, CACHE, prefix=PREFIX) as reader:
            counter = reader.sharded(name)
            assert counter.value(fresh=True) == done  # exact through the growth
            grown = counter.shards
        assert written() == [1, 16]  # created with one shard, grown once, to 16
    assert SECONDS < SETTLE
    assert grown == 16
    assert max(seen) == grown  # the one count, as the process that decided it writes


def test_with_the_in_process_cache_writer_processes_never_grow_it_together(
    sqlite_url: str,
) -> None:
    """The stated limit: with ``memory://`` each process counts only itself among the
    counter's writers, so 4 processes taking turns on its row leave it at one shard (with
    a shared cache they grow it: the test above)."""
    store_url = store_url_for("postgres", sqlite_url)
    name = f"test:auto:{uuid.uuid4().hex}"
    done, seen = _run_writers(store_url, name, 4, cache="memory://")
    assert done > 4 * 2 * BUSY  # busy enough to be measured
    assert seen == [1, 1, 1, 1]
    with shardkit.connect(store_url, prefix=PREFIX) as kit:
        counter = kit.sharded(name, 1)
        assert (counter.shards, counter.value(fresh=True)) == (1, done)


@pytest.mark.parametrize("kind", ["sqlite", "postgres", "mysql"])
def test_a_lone_writer_never_grows_the_counter(kind: str, sqlite_url: str) -> None:
    store_url = store_url_for(kind, sqlite_url)
    name = f"test:auto:{uuid.uuid4().hex}"
    done, seen = _run_writers(store_url, name, 1)
    assert done > 2 * BUSY  # busy enough to be measured
    assert seen == [1]


@pytest.mark.parametrize("kind", ["postgres", "mysql"])
def test_threads_of_one_process_leave_it_at_one_shard(kind: str, sqlite_url: str) -> None:
    """8 threads writing at once in one process: their writes are combined into the
    process's statements, one at a time on the row, which never wait for each other."""
    store_url = store_url_for(kind, sqlite_url)
    name = f"test:auto:{uuid.uuid4().hex}"
    with shardkit.connect(store_url, CACHE, prefix=PREFIX) as kit:
        counter = kit.sharded(name)
        done = [0] * 8
        end = time.monotonic() + SECONDS

        def write(slot: int) -> None:
            while time.monotonic() < end:
                counter.incr()
                done[slot] += 1

        threads = [threading.Thread(target=write, args=(slot,)) for slot in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sum(done) > 8 * BUSY  # busy enough to be measured
        assert (counter.shards, counter.value(fresh=True)) == (1, sum(done))


def test_on_sqlite_writers_taking_turns_leave_it_at_one_shard(sqlite_url: str) -> None:
    name = f"test:auto:{uuid.uuid4().hex}"
    done, seen = _run_writers(sqlite_url, name, 3)
    with shardkit.connect(sqlite_url, CACHE, prefix=PREFIX) as kit:
        counter = kit.sharded(name)
        assert (counter.shards, counter.value(fresh=True)) == (1, done)
    assert seen == [1, 1, 1]


@contextlib.contextmanager
def _row_held(store_url: str, name: str) -> Iterator[None]:
    """Another writer's transactions on ``name``'s rows, each holding their locks for
    10 ms, one after another until the block ends."""
    engine = sa.create_engine(store_url)
    stop = threading.Event()

    def hold() -> None:
        while not stop.is_set():
            with engine.begin() as conn:
                conn.exec_driver_sql(
                    f"SELECT value FROM {PREFIX}shards WHERE name = %s FOR UPDATE", (name,)
                )
                time.sleep(0.01)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        yield
    finally:
        stop.set()
        holder.join()
        engine.dispose()


GROWN = 30.0  # seconds: a deadline for a counter to grow, never a pause
RUN = 120.0  # seconds: a deadline for writer processes to start and finish their run


def _report_writers(kit: shardkit.Kit, name: str, writers: int, span: float = GROWN) -> None:
    """Count ``writers`` more writers of ``name`` in every second of a test's run (up to
    ``span`` seconds from now), as other processes would count themselves."""
    second = int(time.time() / WINDOW)
    for offset in range(-LOOKBACK, int(span / WINDOW) + 2):
        key = kit.settings.cache_key(name, f"sharded:writers:{second + offset}")
        kit.cache.add(key, writers, 2 * span)


def _growths() -> float:
    """The growths this process's metrics counted (a kit records into prometheus_client's
    default registry)."""
    import prometheus_client

    counted = prometheus_client.REGISTRY.get_sample_value(
        "shardkit_shard_growths_total", {"kind": "sharded"}
    )
    return counted or 0.0


def _logged_growths(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "grew" in r.getMessage()]


def test_a_growth_is_logged_once_with_its_measure(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Writes held on their row by another transaction, counted with other writers: the
    counter grows once, and says why."""
    store_url = store_url_for("postgres", sqlite_url)
    name = f"test:auto:{uuid.uuid4().hex}"
    caplog.set_level(logging.INFO, logger="shardkit")
    with shardkit.connect(store_url, CACHE, prefix=PREFIX) as kit:
        counter = kit.sharded(name, shards="auto")
        counter.incr()
        grown_before = _growths()
        _report_writers(kit, name, 3)
        with _row_held(store_url, name):
            end = time.monotonic() + GROWN
            while not _logged_growths(caplog) and time.monotonic() < end:
                counter.incr()
        assert counter.shards == 4
    assert _growths() == grown_before + 1  # counted in the metrics, once
    growths = _logged_growths(caplog)
    assert len(growths) == 1, growths
    # 3 writers reported by hand, and this process in one of the two seconds or not.
    assert re.search(f"{re.escape(repr(name))} grew from 1 to 4 shards: [34] writers", growths[0])


def test_an_async_counter_waiting_on_its_row_grows_once_and_counts_exactly(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    import shardkit.aio

    store_url = store_url_for("postgres", sqlite_url)
    name = f"test:auto:{uuid.uuid4().hex}"
    caplog.set_level(logging.INFO, logger="shardkit")

    async def main() -> tuple[int, int, int]:
        async with shardkit.aio.connect(store_url, CACHE, prefix=PREFIX) as kit:
            counter = await kit.sharded(name)
            done = 0
            with _row_held(store_url, name):
                end = time.monotonic() + GROWN
                # Two writers at a time, combined or not, until the counter grows: a
                # window of writes waiting on the row, as many as BUSY, however long.
                while not _logged_growths(caplog) and time.monotonic() < end:
                    await asyncio.gather(counter.incr(), counter.incr())
                    done += 2
            return await counter.read_shards(), await counter.value(fresh=True), done

    with (
        shardkit.connect(store_url, CACHE, prefix=PREFIX) as kit,
        shard_counts(kit.store.engine, PREFIX, name) as written,
    ):
        _report_writers(kit, name, 3)
        shards, value, done = asyncio.run(main())
        assert written() == [1, 4]  # created with one shard, grown once, to 4
    assert (shards, value) == (4, done)
    assert len(_logged_growths(caplog)) == 1


def test_a_writer_takes_up_a_growth_decided_elsewhere_within_the_refresh(
    sqlite_url: str,
) -> None:
    """A writing process follows a count another one grew at its first write once
    ``_SHARDS_REFRESH`` seconds have passed since it last read the count: from that write
    on, its home shard (the 4th ticket) is a row of its own."""
    store_url = store_url_for("postgres", sqlite_url)
    name = f"test:auto:{uuid.uuid4().hex}"
    with (
        shardkit.connect(store_url, CACHE, prefix=PREFIX) as writer,
        shardkit.connect(store_url, CACHE, prefix=PREFIX) as other,
    ):
        counter = writer.sharded(name)
        writer.cache.add(writer.settings.cache_key(name, "sharded:ticket"), 2, 60)
        counter.incr()  # ticket 3, on shard 3 % 1
        looked = counter._looked_at  # when this process last read the count
        assert other.sharded(name).grow(4) == 4
        rows = sa.table(f"{PREFIX}shards", sa.column("name"), sa.column("shard"))
        homes = sa.select(rows.c.shard).where(rows.c.name == name)
        starts: list[float] = []
        ends: list[float] = []

        def home_taken() -> bool:
            starts.append(time.monotonic())
            counter.incr()
            ends.append(time.monotonic())
            with other.store.engine.connect() as conn:
                return 3 in conn.execute(homes).scalars().all()

        wait_for(home_taken, "the writer's home shard", timeout=_SHARDS_REFRESH + 30)
        assert counter.value(fresh=True) == 1 + len(starts)  # exact across the growth
    # The write that took it up ended once the refresh was due, the one before began before.
    assert ends[-1] >= looked + _SHARDS_REFRESH
    assert len(starts) == 1 or starts[-2] < looked + _SHARDS_REFRESH


def test_a_reported_write_runs_a_program_only_when_it_ends_a_window(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wrote``, which the Django app calls for each counting update: timed in the
    counter's window, with no program run (none of a rule's cost) until a write ends it."""
    runs: list[object] = []
    real = _program.run

    def counted(program: _program.Program[object], roles: _program.Roles) -> object:
        runs.append(program)
        return real(program, roles)

    now = [0.0]
    with shardkit.connect(sqlite_url, prefix=PREFIX) as kit:
        counter = kit.sharded(f"test:auto:{uuid.uuid4().hex}")
        counter._sizing = Sizing(kit.settings.max_shards, clock=lambda: now[0])  # as automatic
        monkeypatch.setattr(_program, "run", counted)  # counts the programs run
        for _ in range(50):
            counter.wrote(0.001, 1)
        assert runs == []
        now[0] += WINDOW
        counter.wrote(0.001, 1)  # ends the window: its writers counted in the cache
        assert len(runs) == 1
        second = int(time.time() / WINDOW)  # the window's, or the one after
        keys = [counter._writers_key(second - ago) for ago in (0, 1)]
        assert sum(kit.cache.get_many(keys).values()) == 1


def test_sizing_waits_for_busy_contended_windows_and_settles() -> None:
    now = [0.0]
    sizing = Sizing(maximum=8, clock=lambda: now[0])
    windows: list[Window] = []

    def write(seconds: float, count: int) -> None:
        for _ in range(count):
            now[0] += seconds
            window = sizing.timed(seconds)
            if window is not None:
                windows.append(window)

    write(0.001, 1000)  # one second of unhindered writes
    assert not windows[-1].contended
    assert sizing.grow_to(windows[-1], writers=4, shards=1) is None  # nobody waited
    write(0.004, 260)  # each waits 3 ms beyond the fastest: 75 % of their time
    assert windows[-1].contended
    assert sizing.grow_to(windows[-1], writers=1, shards=1) is None  # alone: slow, not shared
    assert sizing.grow_to(windows[-1], writers=3, shards=1) == 4  # writers, to a power of two
    write(0.004, 260)
    assert sizing.grow_to(windows[-1], writers=12, shards=4) is None  # settling
    now[0] += SETTLE
    write(0.001, 100)  # a few writes unhindered, then most waiting
    write(0.004, 230)
    assert windows[-1].contended
    assert sizing.grow_to(windows[-1], writers=12, shards=4) == 8  # 16, at most the maximum
    now[0] += SETTLE
    write(0.001, 100)
    write(0.004, 230)
    assert sizing.grow_to(windows[-1], writers=12, shards=8) is None  # at the maximum
    write(0.5, 3)  # few writes, however slow
    assert not windows[-1].contended


def test_the_async_kit_opens_automatic_counters_too(sqlite_url: str) -> None:
    import asyncio

    import shardkit.aio

    store_url = store_url_for("postgres", sqlite_url)
    name = f"test:auto:{uuid.uuid4().hex}"

    async def main() -> tuple[int, int, bool]:
        async with shardkit.aio.connect(store_url, CACHE, prefix=PREFIX) as kit:
            counter = await kit.sharded(name, shards="auto")
            await asyncio.gather(*(counter.incr() for _ in range(50)))
            return (
                await counter.read_shards(),
                await counter.value(fresh=True),
                bool(counter._sizing),
            )

    assert asyncio.run(main()) == (1, 50, True)  # sized by this process as it writes
