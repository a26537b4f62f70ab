"""Many processes on one counter: exact totals while the shard count grows, idempotency
keys raced across processes, and writers killed mid-flight.

Writers are spawned processes (entry points in ``workers.py``); they synchronise on
events, barriers and logs polled with a deadline, never on sleeps.
"""

from __future__ import annotations

import itertools
import multiprocessing
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import workers
from backends import CACHE_URLS, NEVER, Target, require, store_url_for, wait_for

SPAWN = multiprocessing.get_context("spawn")
DEADLINE = 90.0  # seconds: a generous bound for anything a test waits for


def _where(target: Target) -> workers.Where:
    return (target.store_url, target.cache_url, target.prefix)


@contextmanager
def _processes(target: Callable[..., None], args: list[tuple[Any, ...]]) -> Iterator[list[Any]]:
    """Spawned processes running ``target(*a)`` for each ``a``; killed if still alive."""
    procs = [SPAWN.Process(target=target, args=a, daemon=True) for a in args]
    for proc in procs:
        proc.start()
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(DEADLINE)
            proc.close()


def _results(queue: Any, count: int) -> list[tuple[Any, ...]]:
    """``count`` results from worker processes, each ``(slot, payload, error)``."""
    got = [queue.get(timeout=DEADLINE) for _ in range(count)]
    errors = [error for _, _, error in got if error]
    assert not errors, "a worker failed:\n" + "\n".join(errors)
    return sorted(got)


def _none_exited(procs: list[Any], queue: Any) -> bool:
    """True while every process runs; fails the test with their errors once one exits."""
    if all(proc.is_alive() for proc in procs):
        return True
    _results(queue, sum(not proc.is_alive() for proc in procs))
    pytest.fail("a worker exited before it was told to stop")


def _kit_target(store_url: str) -> Target:
    return Target(store_url, CACHE_URLS["memory"])


# -- exact totals while growing ------------------------------------------------------------

WRITERS = 8
# Increments per writer at least: SQLite takes one writer at a time, so it gets fewer.
WRITES = {"sqlite": 150, "postgres": 600, "mysql": 600}
FIRST_SHARDS = 4  # below the default (20): opening the counter elsewhere must not grow it
GROWTH = [(0.2, 8), (0.45, 16), (0.7, 32)]  # (share of the increments done, grow to)


@pytest.fixture(
    params=[
        ("sqlite", "memory"),
        ("postgres", "memory"),
        ("mysql", "memory"),
        ("postgres", "redis"),
    ],
    ids=lambda p: "+".join(p),
)
def grow_target(request: pytest.FixtureRequest, sqlite_url: str) -> tuple[str, Target]:
    store_kind, cache_kind = request.param
    cache_url = CACHE_URLS[cache_kind]
    if cache_url != "memory://":
        require(cache_url)
    return store_kind, Target(store_url_for(store_kind, sqlite_url), cache_url)


@pytest.mark.slow
def test_many_writers_exact_total_while_shard_count_grows(
    grow_target: tuple[str, Target], name: str
) -> None:
    store_kind, target = grow_target
    count = WRITES[store_kind]
    seeds = [random.randrange(1 << 32) for _ in range(WRITERS)]
    planned = WRITERS * count
    with target.connect() as kit:
        counter = kit.sharded(name, shards=FIRST_SHARDS)
        start, stop = SPAWN.Event(), SPAWN.Event()
        progress = SPAWN.RawArray("q", WRITERS)
        queue = SPAWN.Queue()
        args = [
            (_where(target), name, slot, seed, count, start, stop, progress, queue)
            for slot, seed in enumerate(seeds)
        ]
        with _processes(workers.random_writer, args) as procs:
            start.set()
            for share, shards in GROWTH:
                wait_for(
                    lambda share=share: (  # type: ignore[misc]
                        _none_exited(procs, queue) and sum(progress) >= share * planned
                    ),
                    f"{share:.0%} of the increments",
                    DEADLINE,
                    status=lambda: f"(done: {list(progress)})",
                )
                assert counter.grow(shards) == shards
            # Writers stop only once told to: every grow ran while all of them wrote.
            stop.set()
            reports = {slot: report for slot, report, _ in _results(queue, WRITERS)}
        queue.close()
        queue.join_thread()
    for slot, (done, total) in reports.items():
        assert count <= done < workers.CAP * count  # not one writer ran out before the last grow
        assert progress[slot] == done
        assert total == sum(workers.deltas(seeds[slot], done))  # the first `done` of its deltas
    expected = sum(total for _, total in reports.values())

    with target.connect() as kit:  # a new kit: nothing cached from the writes
        counter = kit.get(name)
        assert counter.value(fresh=True) == expected
        assert counter.shards == GROWTH[-1][1]
        info = kit.store.counter(name)
        assert info is not None
        assert info.shards == GROWTH[-1][1]
        shards = kit.store.shards_table  # type: ignore[attr-defined]
        with kit.store.engine.connect() as conn:  # type: ignore[attr-defined]
            top, total = conn.execute(
                sa.select(sa.func.max(shards.c.shard), sa.func.sum(shards.c.value)).where(
                    shards.c.name == name
                )
            ).one()
        assert total == expected
        assert 0 <= top < GROWTH[-1][1]  # no row outside the counter's shards


# -- idempotency keys --------------------------------------------------------------------


def test_same_key_twice_in_one_process_applies_once(store_url: str, name: str) -> None:
    with _kit_target(store_url).connect() as kit:
        counter = kit.sharded(name, shards=4)
        assert counter.incr(5, key="order-1") is True
        assert counter.incr(5, key="order-1") is False
        assert counter.decr(5, key="order-1") is False  # the key, not the delta, decides
        assert counter.incr(-3, key="order-2") is True
        assert counter.value(fresh=True) == 2
        assert counter.value() == 2


RACERS = 8
KEYS = 200


@pytest.mark.slow
def test_processes_racing_on_the_same_keys_apply_each_key_once(store_url: str, name: str) -> None:
    target = _kit_target(store_url)
    rng = random.Random()
    keys = {f"key-{i}": rng.choice((-1, 1)) * rng.randint(1, 10**9) for i in range(KEYS)}
    with target.connect() as kit:
        kit.sharded(name, shards=8)
    barrier = SPAWN.Barrier(RACERS)
    queue = SPAWN.Queue()
    # Racers share an order in pairs, so every key also meets a head-on race.
    seed = rng.randrange(1 << 32)
    args = [
        (_where(target), name, slot, keys, seed + slot // 2, barrier, queue)
        for slot in range(RACERS)
    ]
    with _processes(workers.keyed_racer, args):
        applied = [keys_applied for _, keys_applied, _ in _results(queue, RACERS)]
    queue.close()
    queue.join_thread()

    winners = [key for keys_applied in applied for key in keys_applied]
    assert len(winners) == KEYS  # True returned once per key across all processes…
    assert set(winners) == set(keys)  # …for every key
    with target.connect() as kit:
        counter = kit.get(name)
        assert counter.value(fresh=True) == sum(keys.values())
        for key in rng.sample(sorted(keys), 5):  # and the keys stay spent
            assert counter.incr(keys[key], key=key) is False
        assert counter.value(fresh=True) == sum(keys.values())


# -- writers killed mid-flight -------------------------------------------------------------

KILLED = 4


def _read_log(path: Path) -> list[str]:
    """The complete lines of a worker's log (a line cut by the kill is left out)."""
    if not path.exists():
        return []
    text = path.read_text()
    return text.split("\n")[:-1]


def _done(lines: list[str]) -> int:
    for line in lines:
        if line.startswith("error"):
            pytest.fail(f"a writer failed: {line}")
    return sum(line.startswith("done ") for line in lines)


def _server_ids_alive(engine: sa.Engine, ids: list[int]) -> bool:
    """Whether any of the server-side connections ``ids`` still exists."""
    if not ids:
        return False
    if engine.dialect.name == "postgresql":
        sql = sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid IN :ids")
    else:
        sql = sa.text("SELECT count(*) FROM information_schema.processlist WHERE id IN :ids")
    sql = sql.bindparams(sa.bindparam("ids", expanding=True))
    with engine.connect() as conn:
        return bool(conn.execute(sql, {"ids": ids}).scalar())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "threads"), [("sharded", 1), ("sharded", 4), ("buffered", 4)], ids=str
)
def test_killed_writers_lose_at_most_their_in_flight_increment(
    store_url: str, name: str, tmp_path: Path, kind: str, threads: int
) -> None:
    """Four writer processes killed at random moments, of one thread each or of four
    whose increments are combined (a sharded counter's into one statement, a buffered
    one's, on a shared cache, into one command): every increment acknowledged is in the
    value, and of those in flight, any subset."""
    target = _kit_target(store_url)
    if kind == "buffered":  # a process's private cache would die with it
        require(CACHE_URLS["redis"])
        target = Target(store_url, CACHE_URLS["redis"])
    rng = random.Random()
    logs = [tmp_path / f"writer-{slot}.log" for slot in range(KILLED)]
    # Each writer is killed after a random number of completed increments.
    kill_after = [rng.randint(30, 150) for _ in range(KILLED)]
    with target.connect() as kit:
        if kind == "buffered":
            counter: Any = kit.buffered(name, interval=NEVER)
        else:
            counter = kit.sharded(name, shards=FIRST_SHARDS)
        args = [
            (_where(target), name, slot, rng.randrange(1 << 32), str(logs[slot]), threads)
            for slot in range(KILLED)
        ]
        with _processes(workers.logging_writer, args) as procs:
            alive = set(range(KILLED))

            def kill_due() -> bool:
                for slot in list(alive):
                    if _done(_read_log(logs[slot])) >= kill_after[slot]:
                        procs[slot].kill()
                        alive.discard(slot)
                    else:
                        assert procs[slot].is_alive(), f"writer {slot} died on its own"
                return not alive

            wait_for(kill_due, "every writer to be killed", DEADLINE)
            for proc in procs:
                proc.join(DEADLINE)
                assert proc.exitcode == -9  # SIGKILL, not an exit of its own

        lines = [_read_log(path) for path in logs]
        done = 0
        in_flight: list[int] = []
        for slot, log in enumerate(lines):
            assert _done(log) >= kill_after[slot]
            done += sum(int(line.split()[1]) for line in log if line.startswith("done "))
            last: dict[str, str] = {}  # each thread's last step
            for line in log:
                if line.startswith(("intent ", "done ")):
                    last[line.split()[2]] = line
            in_flight += [int(line.split()[1]) for line in last.values() if line[0] == "i"]

        engine = kit.store.engine  # type: ignore[attr-defined]
        if engine.dialect.name != "sqlite":
            # A killed writer's last statement may still be running on the server: wait
            # until the server has dropped every connection the writers opened.
            ids = [
                int(line.split()[1]) for log in lines for line in log if line.startswith("conn ")
            ]
            assert ids
            wait_for(lambda: not _server_ids_alive(engine, ids), "the killed connections", DEADLINE)

        value = counter.value() if kind == "buffered" else counter.value(fresh=True)
        possible = {
            done + sum(chosen)
            for size in range(len(in_flight) + 1)
            for chosen in itertools.combinations(in_flight, size)
        }
        assert value in possible, (
            f"value {value} is not the {done} logged as done plus a subset of the "
            f"in-flight deltas {in_flight}"
        )
