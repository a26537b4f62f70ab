"""The id allocator, over every store and cache."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

import shardkit
from backends import CACHE_URLS, PREFIX, RefusingCache, Target, require, run_together
from shardkit._program import Blocking
from shardkit.cache.redis import RedisCache
from shardkit.counters.base import incarnation_key
from shardkit.counters.ids import Guard, IdCore, block_key
from shardkit.errors import BackendError, CounterKindMismatch, ValidationError
from shardkit.store import Store


def test_ids_are_unique_increasing_and_reserved_first(kit: shardkit.Kit, name: str) -> None:
    ids = kit.ids(name, block=10)
    taken = ids.take(35)
    assert taken == sorted(set(taken))
    assert taken[0] >= 1
    assert ids.reserved() >= taken[-1]
    # Four blocks of ten, reserved before their ids were used, and with a shared cache
    # the next one, published ahead for the processes that share it.
    assert ids.reserved() == (50 if kit.cache.shared else 40)
    assert isinstance(kit.get(name), shardkit.IdAllocator)


@pytest.mark.parametrize("sub_block", [1, 7])
@pytest.mark.pairs
def test_concurrent_threads_never_share_an_id(kit: shardkit.Kit, name: str, sub_block: int) -> None:
    """Threads share their process's sub-block: none is handed an id twice, each its ids
    in increasing order, and one process's ids leave no hole (but the rest of its last
    sub-block, still in hand), nor a spent block's key in the cache."""
    ids = kit.ids(name, block=50, sub_block=sub_block)
    got: list[list[int]] = [[] for _ in range(8)]
    run_together(8, lambda index: got[index].extend(ids.next() for _ in range(300)))
    every = [each for taken in got for each in taken]
    assert sorted(every) == list(range(1, 2401))
    assert all(taken == sorted(taken) for taken in got)
    reserved = ids.reserved()
    assert reserved == (2450 if sub_block > 1 and kit.cache.shared else 2400)
    # No key of a spent block is left behind, but the last one's (2400, until a writer
    # moves on, unless the next was published ahead).
    keys = {mark: ids._key_of(mark) for mark in range(50, reserved + 1, 50)}
    counts = kit.cache.get_many(list(keys.values()))
    assert all(counts[key] < mark for mark, key in keys.items() if key in counts and mark < 2400)
    assert (keys[2400] in counts) == (reserved == 2400)


@pytest.mark.parametrize("sub_block", [1, 10])
def test_a_lost_cache_continues_above_every_id_handed_out(
    kit: shardkit.Kit, name: str, sub_block: int
) -> None:
    """At once with a sub-block of 1; once the rest of the sub-block in hand when the
    cache lost it is handed out, otherwise."""
    ids = kit.ids(name, block=100, sub_block=sub_block)
    before = ids.take(3)
    reserved = ids.reserved()  # 200 with a block published ahead
    claim = incarnation_key(kit.settings, ids.info, "ids:claim:100")  # its publisher's
    for key in (ids._key_of(100), ids._key_of(200), ids._pointer_key, claim):  # all lost
        kit.cache.delete(key)
    after = ids.take(10)
    rest = list(range(4, sub_block + 1))  # 4 … 10 with a sub-block of 10
    assert after[: len(rest)] == rest
    assert min(after[len(rest) :]) > reserved >= max(before)
    assert ids.reserved() == 2 * reserved


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
        taken = [
            kit.ids(name, block=3, sub_block=1).next() for _ in range(15) for kit in (one, two)
        ]
        # One sequence across both kits: each used-up block is replaced once, for both.
        assert taken == list(range(1, 31))
        assert one.ids(name, block=3).reserved() == 30


def test_kits_sharing_a_cache_take_sub_blocks_of_shared_blocks_and_hand_each_id_once(
    store_url: str, name: str
) -> None:
    """Two kits (as two processes would) alternate, each handing out its sub-blocks of
    4 in turn; a block's end cuts a sub-block short (9-10), and the kit that reserved a
    block publishes the next ahead once it takes a sub-block of it: a kit that joins,
    or uses up its block, moves to the newest at once."""
    require(CACHE_URLS["redis"])
    target = Target(store_url, CACHE_URLS["redis"])
    with target.connect() as one, target.connect() as two:
        ids = [kit.ids(name, block=10, sub_block=4) for kit in (one, two)]
        taken: list[list[int]] = [[], []]
        for _ in range(12):
            for index in (0, 1):
                taken[index].append(ids[index].next())
        assert taken == [[*range(1, 11), 21, 22], [*range(11, 21), 31, 32]]
        # One reserved every block: 1-10, 11-20 ahead, 21-30 (two had used 11-20 up
        # before one took any of it) and 31-40 ahead.
        assert ids[0].reserved() == 40


def test_a_cache_wiped_mid_sub_block_moves_each_kit_above_every_id_once_its_own_is_used(
    store_url: str, own_redis: str, name: str
) -> None:
    """A wipe loses the blocks' keys: each kit hands out the rest of its own sub-block
    (ids no other kit can hold), then moves to a new block, above every id reserved
    before."""
    target = Target(store_url, own_redis)
    wipe = redis.Redis.from_url(own_redis)
    with target.connect() as one, target.connect() as two, wipe:
        ids = [kit.ids(name, block=100, sub_block=10) for kit in (one, two)]
        before = [each.take(3) for each in ids]
        assert before == [[1, 2, 3], [101, 102, 103]]  # two joins the block published ahead
        assert ids[0].reserved() == 200
        wipe.flushdb()  # this worker's own server
        after = [each.take(9) for each in ids]
        # One starts a block and publishes the next ahead, which two joins.
        assert after == [[*range(4, 11), 201, 202], [*range(104, 111), 301, 302]]
        assert ids[0].reserved() == 400


class Publishing(RedisCache):
    """Redis, calling ``during(mark, start)`` whenever it is asked to add the key of a
    block ``start + 1 … mark`` of the allocator its ``blocks`` pattern matches: as the
    block's publisher does, once it has reserved the block and before it points the
    allocator at it."""

    blocks = re.compile("")
    during: Callable[[int, int], None] = staticmethod(lambda mark, start: None)

    def add(self, key: str, value: int, ttl: float | None) -> bool:
        found = self.blocks.fullmatch(key)
        if found:
            self.during(int(found[1]), value)
        return super().add(key, value, ttl)


@dataclass
class Published:
    """What the blocks of one allocator were, in the order they were published."""

    sizes: list[int] = field(default_factory=list)
    used_up: list[int] = field(default_factory=list)
    """The marks of the blocks in use that a writer found used up while the next was
    being published."""
    reserved: int = 0
    """The store's mark at the end."""
    grown: int | None = None
    """The size the blocks have grown to, as the cache holds it at the end."""
    grown_for: float = 0.0
    """Seconds that size has left to live."""


def _publish_while_others_take(
    store_url: str, name: str, others_take: int, count: int
) -> Published:
    """One kit (a process) takes ``count`` ids of an allocator of blocks of 10, 2 at a
    time; while it publishes a block, other processes' writers take ``others_take`` ids
    of the block in use, 2 at a time (as they would while the reservation takes long),
    up to the first of them that finds it used up (that one waits for the block being
    published)."""
    require(CACHE_URLS["redis"])
    published = Published()
    cache = Publishing.from_url(CACHE_URLS["redis"])
    with (
        shardkit.connect(store_url, cache, prefix=PREFIX) as kit,
        redis.Redis.from_url(CACHE_URLS["redis"]) as other,
    ):
        ids = kit.ids(name, block=10, sub_block=2)

        def others(mark: int, start: int) -> None:
            published.sizes.append(mark - start)
            in_use = other.get(ids._pointer_key)
            if in_use is None:  # the first block
                return
            for _ in range(others_take // 2):
                top = other.incrby(block_key(kit.settings, name, int(in_use)), 2)
                if top - 2 >= int(in_use):
                    published.used_up.append(int(in_use))
                    break

        pattern = re.escape(block_key(kit.settings, name, 123456789))
        cache.blocks = re.compile(pattern.replace("123456789", r"(\d+)"))
        cache.during = others
        ids.take(count)
        published.reserved = ids.reserved()
        grown = incarnation_key(kit.settings, ids.info, "ids:block")
        published.grown = kit.cache.get(grown)
        published.grown_for = other.pttl(grown) / 1000
    return published


def test_blocks_grow_when_a_writer_finds_the_block_in_use_used_up_before_the_next_is_out(
    store_url: str, name: str
) -> None:
    """While each block is published, the others take 16 ids of the one in use: a block
    of 10 is used up first, and a writer waits. The blocks published from then on are
    twice as large, by every process (the size is in the cache, for a minute); only
    once: the block published while the last block of 10 is in use comes late too, but
    is already larger. Blocks of 20 outlast their publication: no writer finds one used
    up, and they grow no more."""
    published = _publish_while_others_take(store_url, name, 16, 12)
    assert published.sizes == [10, 10, 20, 20, 20]
    assert published.used_up == [10, 20]  # no writer waits once the blocks have grown
    assert published.reserved == sum(published.sizes) == 80
    assert published.grown == 20
    assert 50 < published.grown_for <= 60


def test_blocks_grow_to_64_times_block_at_most(store_url: str, name: str) -> None:
    """Others use up the block in use while each block is published: the blocks double
    with every other block published (the one published while a smaller block is in
    use does not count), up to 640. Each sub-block of 2 the kit takes is the first of
    a block it published: 18 published ahead, after the one it started."""
    published = _publish_while_others_take(store_url, name, 10**6, 36)
    assert published.sizes == [10 * 2 ** min(k // 2, 6) for k in range(19)]
    assert len(published.used_up) == 18
    assert published.grown == 640


@pytest.mark.parametrize(
    ("sub_block", "grown", "reserved"), [(2, 3, 20), (2, 40, 80), (2, 10**6, 1280), (1, 40, 10)]
)
def test_a_process_reserves_the_size_grown_to_within_its_own_bounds(
    store_url: str, name: str, sub_block: int, grown: int, reserved: int
) -> None:
    """The size the blocks have grown to, in the cache, is every process's that shares
    it and takes sub-blocks, within its own bounds (processes may use blocks of their
    own): ``block`` … 64 times ``block``. A process starts a block and publishes the next
    ahead (not with a sub-block of 1: its blocks are of ``block`` ids)."""
    require(CACHE_URLS["redis"])
    with Target(store_url, CACHE_URLS["redis"]).connect() as kit:
        ids = kit.ids(name, block=10, sub_block=sub_block)
        assert kit.cache.add(incarnation_key(kit.settings, ids.info, "ids:block"), grown, 60)
        assert ids.next() == 1
        assert ids.reserved() == reserved


@pytest.mark.parametrize("what", ["block", "sub_block"])
@pytest.mark.parametrize("block", [0, -5, 2**40 + 1, 1.5, True, "10"])
@pytest.mark.pairs
def test_bad_blocks_are_refused_before_anything_is_written(
    kit: shardkit.Kit, name: str, block: Any, what: str
) -> None:
    with pytest.raises(ValidationError, match=f"^{what} must be"):
        kit.ids(name, **{what: block})
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
            Allocator(info, kit.settings, 10, 1, Guard(threading.Lock), object())  # type: ignore[arg-type]
        clock = Clock()
        ids = Allocator(info, kit.settings, 10, 1, Guard(threading.Lock), clock)
        roles = ids.roles
        assert (roles.store, roles.cache, roles.clock) == (kit.store, kit.cache, clock)
        assert ids.take(12) == list(range(1, 13))  # two blocks
        assert kit.ids(name, block=10, sub_block=1).next() == 13  # the same cache and block
