"""The buffered (write-behind) counter, over every store and cache."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest
import sqlalchemy as sa

import shardkit
from backends import (
    CACHE_URLS,
    NEVER,
    PREFIX,
    Target,
    require,
    run_together,
    store_url_for,
    wait_for,
)
from shardkit.counters.generations import Parts
from shardkit.counters.generations import sum_keys as buffered_keys
from shardkit.errors import CounterKindMismatch, InvalidDelta, ValidationError
from shardkit.executor import LocalExecutor
from shardkit.store.base import RETIRED
from shardkit.store.sql import SqlStore


def test_increments_wait_in_the_cache_until_flushed(kit: shardkit.Kit, name: str) -> None:
    hits = kit.buffered(name, interval=NEVER)
    hits.incr()
    hits.incr(5)
    hits.decr(2)
    hits.incr(-10)
    assert hits.parts() == Parts(stored=0, pending=-6)
    assert kit.store.total(name) == 0
    assert hits.flush() == -6
    assert hits.parts() == Parts(stored=-6, pending=0)
    assert hits.flush() == 0  # nothing left: a repeated flush is a no-op
    hits.incr(10)
    assert hits.value() == 4
    assert hits.parts() == Parts(stored=-6, pending=10)
    assert kit.store.total(name) == -6


def test_flush_all_flushes_every_buffered_counter(kit: shardkit.Kit, name: str) -> None:
    names = [f"{name}:{index}" for index in range(3)]
    for index, each in enumerate(names):
        kit.buffered(each, interval=NEVER).incr(index + 1)
    kit.sharded(f"{name}:sharded").incr(7)
    moved = kit.flush_all()
    assert {each: moved[each] for each in names} == {names[0]: 1, names[1]: 2, names[2]: 3}
    assert f"{name}:sharded" not in moved
    assert kit.values([*names, f"{name}:sharded"]) == {
        names[0]: 1,
        names[1]: 2,
        names[2]: 3,
        f"{name}:sharded": 7,
    }
    assert all(kit.buffered(each, interval=NEVER).parts().pending == 0 for each in names)


def test_a_counter_is_found_by_kind_and_its_name_is_not_reused(
    kit: shardkit.Kit, store_url: str, cache_url: str, name: str
) -> None:
    kit.buffered(name).incr()
    assert isinstance(kit.get(name), shardkit.BufferedCounter)
    with pytest.raises(CounterKindMismatch):
        kit.sharded(name)
    kit.sharded(f"{name}:s")
    with pytest.raises(CounterKindMismatch):
        kit.buffered(f"{name}:s")
    with Target(store_url, cache_url).connect() as other:
        assert isinstance(other.get(name), shardkit.BufferedCounter)
        with pytest.raises(CounterKindMismatch):
            other.sharded(name)


@pytest.mark.parametrize("delta", [1.5, True, "1", None, 2**63, -(2**63)])
@pytest.mark.pairs
def test_bad_deltas_are_refused(kit: shardkit.Kit, name: str, delta: Any) -> None:
    hits = kit.buffered(name, interval=NEVER)
    with pytest.raises(InvalidDelta):
        hits.incr(delta)
    assert hits.parts() == Parts(0, 0)


@pytest.mark.parametrize("interval", [0, -1.0, float("nan"), "5", True])
@pytest.mark.pairs
def test_bad_intervals_are_refused_before_anything_is_written(
    kit: shardkit.Kit, name: str, interval: Any
) -> None:
    with pytest.raises(ValidationError):
        kit.buffered(name, interval=interval)
    assert kit.store.counter(name) is None


def test_a_lost_generation_loses_only_what_was_pending(kit: shardkit.Kit, name: str) -> None:
    hits = kit.buffered(name, interval=NEVER, stripes=1)
    hits.incr(5)
    hits.flush()
    hits.incr(7)
    (generation,) = kit.store.generations([name])[name]
    for key in hits._keys(generation):  # the cache loses the generation's keys
        kit.cache.delete(key)
    hits.incr(1)
    assert len(kit.store.generations([name])[name]) == 2
    assert hits.parts() == Parts(stored=5, pending=1)
    assert hits.flush() == 1
    assert hits.value() == 6


def lose_keys(kit: shardkit.Kit, name: str) -> None:
    """The cache loses the keys of every generation of counter ``name``."""
    for generation in kit.store.generations([name]).get(name, {}):
        for key in buffered_keys(kit.settings, name, generation):
            kit.cache.delete(key)


def age_generations(kit: shardkit.Kit, name: str) -> None:
    """Make every generation of counter ``name`` older than the kit's ``fold_after``."""
    assert isinstance(kit.store, SqlStore)
    table = kit.store.flushed_table
    older = table.c.created_at - 2 * kit.settings.fold_after
    with kit.store.engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.name == name).values(created_at=older))


def test_dead_generations_are_folded_after_the_grace_period(
    shared_kit: shardkit.Kit, name: str
) -> None:
    kit = shared_kit
    hits, stale = kit.buffered(name, interval=NEVER), kit.buffered(name, interval=NEVER)
    stale.incr(100)  # writes into the first generation from now on
    for _ in range(10):
        hits.incr(3)
        hits.decr(1)
        hits.flush()
        lose_keys(kit, name)
    hits.incr(5)  # a generation of its own
    assert len(kit.store.generations([name])[name]) == 11
    hits.flush()  # dead ones, but too young to fold
    assert len(kit.store.generations([name])[name]) == 11
    assert hits.value() == 125

    age_generations(kit, name)
    assert hits.flush() == 0
    assert set(kit.store.generations([name])[name]) == {RETIRED, hits._writing[0][0]}  # type: ignore[index]
    assert hits.parts() == Parts(125, 0)
    # A writer still on a folded generation re-creates a key below the offset: that
    # increment does not count there, and it moves to the live generation.
    stale.incr(1)
    assert set(kit.store.generations([name])[name]) == {RETIRED, hits._writing[0][0]}  # type: ignore[index]
    assert hits.parts() == Parts(125, 1)
    assert hits.flush() == 1
    assert hits.value() == 126


def test_folds_racing_flushes_and_writers_are_exact(shared_kit: shardkit.Kit, name: str) -> None:
    kit = shared_kit
    hits = kit.buffered(name, interval=NEVER)
    for _ in range(20):
        hits.incr(2)
        hits.flush()
        lose_keys(kit, name)
    hits.incr(1)
    age_generations(kit, name)  # every dead one may be folded; the live one has keys
    moved: list[int] = []

    def work(index: int) -> None:
        for step in range(60):
            hits.incr(index + 1)
            if step % 5 == 0:
                moved.append(hits.flush())

    run_together(6, work)
    moved.append(hits.flush())
    expected = 40 + 1 + sum(60 * (index + 1) for index in range(6))
    assert hits.parts() == Parts(expected, 0)
    assert sum(moved) == expected - 40
    assert len(kit.store.generations([name])[name]) == 2  # RETIRED and the live one


def test_a_private_cache_never_folds_another_kits_generation(store_url: str, name: str) -> None:
    target = Target(store_url, "memory://")
    with target.connect() as one, target.connect() as two:
        one.buffered(name, interval=NEVER).incr(4)  # its keys live only in one's cache
        age_generations(one, name)
        two.buffered(name, interval=NEVER).flush()  # sees no keys: not a dead generation
        assert len(one.store.generations([name])[name]) == 1
        assert one.buffered(name, interval=NEVER).flush() == 4
    with target.connect() as three:
        assert three.store.total(name) == 4


@pytest.fixture(params=["redis", "memcached"])
def shared_cache_url(request: pytest.FixtureRequest) -> str:
    url = CACHE_URLS[request.param]
    require(url)
    return url


def test_a_second_kit_writes_into_the_same_generation(
    store_url: str, shared_cache_url: str, name: str
) -> None:
    target = Target(store_url, shared_cache_url)
    with target.connect() as one, target.connect() as two:
        one.buffered(name, interval=NEVER).incr(2)
        two.buffered(name, interval=NEVER).incr(3)
        assert len(one.store.generations([name])[name]) == 1
        assert two.buffered(name, interval=NEVER).parts() == Parts(0, 5)
        assert one.buffered(name, interval=NEVER).flush() == 5


class RecordingExecutor(LocalExecutor):
    """The local executor, recording what it was asked to run."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted: list[tuple[str, dict[str, Any], bool]] = []

    def submit(self, task: str, args: Mapping[str, Any], **options: Any) -> bool:
        accepted = super().submit(task, args, **options)
        self.submitted.append((task, dict(args), accepted))
        return accepted


def test_one_flush_is_scheduled_per_interval(store_url: str, cache_url: str, name: str) -> None:
    target = Target(store_url, cache_url)
    first, second = RecordingExecutor(), RecordingExecutor()
    with (
        shardkit.connect(store_url, cache_url, prefix=target.prefix, executor=first) as one,
        shardkit.connect(store_url, cache_url, prefix=target.prefix, executor=second) as two,
    ):
        run_together(4, lambda _: [one.buffered(name, interval=NEVER).incr() for _ in range(50)])
        two.buffered(name, interval=NEVER).incr()
        # Racing threads may each submit, but only one submission is accepted.
        assert {(task, args["name"]) for task, args, _ in first.submitted} == {("flush", name)}
        assert [accepted for *_, accepted in first.submitted].count(True) == 1
        # Kits sharing a cache share the marks: the second kit's submission is a no-op.
        shared = cache_url != "memory://"
        [(task, args, accepted)] = second.submitted
        assert (task, args["name"], accepted) == ("flush", name, not shared)
        # The start of the interval it flushes, for its lag (the metric).
        assert args["since"] % NEVER == 0
        assert 0 <= time.time() - args["since"] < 2 * NEVER


def test_the_scheduled_flush_runs_when_its_interval_ends(kit: shardkit.Kit, name: str) -> None:
    hits = kit.buffered(name, interval=0.2)
    hits.incr(3)
    wait_for(lambda: hits.parts().stored == 3, "the scheduled flush", 10)
    assert hits.parts() == Parts(3, 0)


def test_closing_the_kit_runs_the_flushes_waiting_in_its_executor(
    store_url: str, name: str
) -> None:
    target = Target(store_url, "memory://")
    with target.connect() as kit:
        kit.buffered(name, interval=NEVER).incr(4)
    with target.connect() as kit:
        assert kit.store.total(name) == 4


@pytest.mark.pairs
def test_concurrent_writers_and_flushes_are_exact(kit: shardkit.Kit, name: str) -> None:
    hits = kit.buffered(name, interval=NEVER)
    moved: list[int] = []

    def work(index: int) -> None:
        for step in range(100):
            hits.incr(index + 1 if step % 3 else -1)
            if step % 10 == 0:
                moved.append(hits.flush())

    run_together(6, work)
    moved.append(hits.flush())
    expected = sum(66 * (index + 1) - 34 for index in range(6))
    assert hits.parts() == Parts(expected, 0)
    assert sum(moved) == expected


def test_flushes_that_fall_behind_wait_one_per_counter_and_lose_nothing(
    sqlite_url: str, name: str
) -> None:
    """The store's write lock held by another connection: every flush waits for it, and
    the one worker with it. Thirty intervals of increments of twenty counters then
    leave at most one flush per counter waiting (a flush a counter an interval piled
    up before: 600), and once the lock is let go every count is moved, exact."""
    store_url_for("sqlite", sqlite_url)
    executor = LocalExecutor(workers=1)
    with shardkit.connect(sqlite_url, prefix=PREFIX, executor=executor) as kit:
        interval = 0.01
        counters = [kit.buffered(f"{name}:{n}", interval=interval) for n in range(20)]
        for counter in counters:
            counter.incr()
        kit.flush_all()
        blocker = sa.create_engine(sqlite_url).connect()
        blocker.exec_driver_sql("BEGIN IMMEDIATE")  # SQLite's write lock, held
        try:
            last = int(time.time() // interval)
            for _ in range(30):
                wait_for(lambda last=last: time.time() // interval > last, "the next interval")
                last = int(time.time() // interval)
                for counter in counters:
                    counter.incr()
            wait_for(lambda: executor.queued >= len(counters) - 1, "the flushes to queue up")
            assert executor.queued <= len(counters)
        finally:
            blocker.rollback()
            blocker.close()
        kit.flush_all()
        assert [counter.parts() for counter in counters] == [(31, 0)] * len(counters)
