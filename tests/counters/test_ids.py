"""The id allocator, over every store and cache."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import shardkit
from backends import CACHE_URLS, PREFIX, RefusingCache, Target, require, run_together
from shardkit._program import Blocking
from shardkit.counters.ids import Guard, IdCore
from shardkit.errors import BackendError, CounterKindMismatch, ValidationError
from shardkit.store import Store


def test_ids_are_unique_increasing_and_reserved_first(kit: shardkit.Kit, name: str) -> None:
    ids = kit.ids(name, block=10)
    taken = ids.take(35)
    assert taken == sorted(set(taken))
    assert taken[0] >= 1
    assert ids.reserved() >= taken[-1]
    assert ids.reserved() == 40  # four blocks of ten, reserved before their ids were used
    assert isinstance(kit.get(name), shardkit.IdAllocator)


@pytest.mark.pairs
def test_concurrent_threads_never_share_an_id(kit: shardkit.Kit, name: str) -> None:
    ids = kit.ids(name, block=50)
    got: list[list[int]] = [[] for _ in range(8)]
    run_together(8, lambda index: got[index].extend(ids.next() for _ in range(300)))
    every = [each for taken in got for each in taken]
    assert len(set(every)) == len(every) == 2400
    assert all(taken == sorted(taken) for taken in got)
    assert max(every) <= ids.reserved()


def test_a_lost_cache_continues_above_every_id_handed_out(kit: shardkit.Kit, name: str) -> None:
    ids = kit.ids(name, block=100)
    before = ids.take(5)
    reserved = ids.reserved()
    for key in (ids._key_of(reserved), ids._pointer_key):  # the cache loses everything
        kit.cache.delete(key)
    after = ids.take(5)
    assert min(after) > reserved >= max(before)


def test_a_block_whose_key_the_cache_refuses_to_increment_is_left_behind(
    sqlite_url: str, name: str
) -> None:
    cache = RefusingCache(":ids:", refusals=2)
    with shardkit.connect(sqlite_url, cache, prefix=PREFIX) as kit:
        taken = kit.ids(name, block=10).take(15)
    assert len(cache.refused) == 2
    # The two refused blocks (1-10, 11-20) are holes; every id is new and increasing.
    assert taken == list(range(21, 36))
    always = RefusingCache(":ids:", refusals=10**6)
    with (
        shardkit.connect(sqlite_url, always, prefix=PREFIX) as kit,
        pytest.raises(BackendError, match="non-numeric"),
    ):
        kit.ids(name + ":refused", block=10).next()
    assert len(always.refused) == 5  # a cache that always refuses: bounded attempts


def test_a_new_kit_with_an_empty_cache_continues_above_every_id_handed_out(
    store_url: str, name: str
) -> None:
    target = Target(store_url, "memory://")
    with target.connect() as kit:
        first = kit.ids(name, block=100).take(3)
    with target.connect() as kit:  # as a new process would: its memory cache is empty
        second = kit.ids(name, block=100).take(3)
    assert min(second) > max(first)


def test_kits_sharing_a_cache_take_increasing_ids_from_shared_blocks(
    store_url: str, name: str
) -> None:
    require(CACHE_URLS["redis"])
    target = Target(store_url, CACHE_URLS["redis"])
    with target.connect() as one, target.connect() as two:
        taken = [kit.ids(name, block=3).next() for _ in range(15) for kit in (one, two)]
        # One sequence across both kits: each used-up block is replaced once, for both.
        assert taken == list(range(1, 31))
        assert one.ids(name, block=3).reserved() == 30


@pytest.mark.parametrize("block", [0, -5, 2**40 + 1, 1.5, True, "10"])
@pytest.mark.pairs
def test_bad_blocks_are_refused_before_anything_is_written(
    kit: shardkit.Kit, name: str, block: Any
) -> None:
    with pytest.raises(ValidationError):
        kit.ids(name, block=block)
    assert kit.store.counter(name) is None


def test_its_name_is_not_reused_by_another_kind(kit: shardkit.Kit, name: str) -> None:
    kit.ids(name).next()
    with pytest.raises(CounterKindMismatch):
        kit.sharded(name)


def test_concurrent_reservations_are_disjoint(store: Store, name: str) -> None:
    marks: list[int] = []
    run_together(8, lambda _: marks.extend(store.reserve(name, 10) for _ in range(10)))
    assert sorted(marks) == list(range(10, 810, 10))


@pytest.mark.parametrize("count", [0, -1, 10**6 + 1, True, 2.0, "3"])
def test_a_take_of_an_unusable_count_is_refused_and_takes_nothing(
    sqlite_url: str, name: str, count: Any
) -> None:
    with shardkit.connect(sqlite_url, prefix=PREFIX) as kit:
        ids = kit.ids(name, block=10)
        assert ids.take(2) == [1, 2]
        with pytest.raises(ValidationError):
            ids.take(count)
        assert ids.next() == 3


def test_an_allocator_is_built_with_its_guard_and_clock_checked(sqlite_url: str, name: str) -> None:
    """The rules take the form's collaborators (a lock and a clock) and build their roles
    with the kit's backends: one that cannot play its role is refused when built."""

    class Allocator(IdCore, Blocking):
        pass

    class Clock:
        def sleep(self, seconds: float) -> None:
            raise AssertionError("no writer waits here")

    with shardkit.connect(sqlite_url, "memory://", prefix=PREFIX) as kit:
        info = kit.store.open_counter(name, IdCore.kind, 1)
        with pytest.raises(TypeError, match="cannot play the role 'clock': it has no sleep"):
            Allocator(info, kit.settings, 10, Guard(threading.Lock()), object())  # type: ignore[arg-type]
        clock = Clock()
        ids = Allocator(info, kit.settings, 10, Guard(threading.Lock()), clock)
        roles = ids.roles
        assert (roles.store, roles.cache, roles.clock) == (kit.store, kit.cache, clock)
        assert ids.take(12) == list(range(1, 13))  # two blocks
        assert kit.ids(name, block=10).next() == 13  # the same cache: the same block
