"""The sharded counter, over every store and cache."""

from __future__ import annotations

import threading
import time

import pytest

import shardkit
from backends import PREFIX, RefusingCache, run_together, shard_values, wait_for
from shardkit.counters.sharded import value_key
from shardkit.errors import CounterKindMismatch, CounterNotFound


def test_incr_decr_and_exact_value(kit: shardkit.Kit, name: str) -> None:
    votes = kit.sharded(name, shards=5)
    assert votes.incr()
    assert votes.incr(5)
    assert votes.decr(2)
    assert votes.incr(-10)
    assert votes.value(fresh=True) == -6
    assert votes.value() == -6


def test_cached_value_is_served_from_the_cache_and_adjusted_on_write(
    kit: shardkit.Kit, name: str
) -> None:
    votes = kit.sharded(name)
    votes.incr(3)
    assert votes.value() == 3  # fills the cache
    kit.store.add(name, 0, 100)  # a write the cache does not see
    assert votes.value() == 3
    assert votes.value(fresh=True) == 103
    votes.incr(4)  # adjusts the cached value after the store commits
    assert votes.value() == 7
    assert votes.value(fresh=True) == 107


def _adjusters() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shardkit-adjuster"]


def test_the_adjusters_thread_ends_when_idle_and_a_later_write_starts_another(
    shared_kit: shardkit.Kit, name: str
) -> None:
    votes = shared_kit.sharded(name)
    assert votes.value() == 0  # caches the value
    cached = value_key(shared_kit.settings, name)
    votes.incr(4)
    wait_for(lambda: not _adjusters(), "the adjuster's thread to end, idle")
    assert shared_kit.cache.get(cached) == 4  # what the cache holds: sent before it ended
    votes.incr(5)
    wait_for(lambda: shared_kit.cache.get(cached) == 9, "a new thread to send the next one")


def test_a_cached_value_the_cache_fails_to_adjust_is_dropped(sqlite_url: str, name: str) -> None:
    cache = RefusingCache(":value:", refusals=1)
    with shardkit.connect(sqlite_url, cache, prefix=PREFIX) as kit:
        votes = kit.sharded(name)
        assert votes.value() == 0  # cached
        assert votes.incr(7)
        assert len(cache.refused) == 1
        assert votes.value() == 7  # from the store: the cached 0 was dropped, not kept
        assert votes.incr(1)
        assert votes.value() == 8  # cached again and adjusted


def test_a_write_does_not_create_a_cached_value(kit: shardkit.Kit, name: str) -> None:
    votes = kit.sharded(name)
    votes.incr(3)
    votes.incr(4)
    assert votes.value() == 7  # had the writes created the cached value, it would read 4


@pytest.mark.pairs
def test_shards_only_grow_and_growing_keeps_the_value(
    kit: shardkit.Kit, store_url: str, name: str
) -> None:
    votes = kit.sharded(name, shards=2)
    for delta in range(1, 21):
        votes.incr(delta)
    assert votes.shards == 2
    assert votes.grow(8) == 8
    assert votes.grow(3) == 8
    assert kit.sharded(name, shards=4).shards == 8
    with shardkit.connect(store_url, prefix=PREFIX) as elsewhere:
        assert elsewhere.sharded(name).shards == 8  # no count asked: none imposed
    assert kit.sharded(name, shards=12).shards == 12
    assert votes.shards == 12  # the same counter, seen through the store
    assert votes.value(fresh=True) == 210


def test_shard_rows_are_created_lazily_within_the_shard_count(kit: shardkit.Kit, name: str) -> None:
    votes = kit.sharded(name, shards=50)
    votes.incr(1)
    rows = shard_values(kit, "shards", name)
    assert len(rows) == 1
    assert all(0 <= shard < 50 for shard in rows)


def test_concurrent_writers_write_their_own_shards(kit: shardkit.Kit, name: str) -> None:
    votes = kit.sharded(name, shards=20)

    def work(_: int) -> None:
        for _ in range(25):
            votes.incr()

    run_together(8, work)
    rows = shard_values(kit, "shards", name)
    # Each combined statement goes to its leader's home shard: eight writers, at most
    # eight rows (one, if a single thread led every batch).
    assert 1 <= len(rows) <= 8
    assert sum(rows.values()) == votes.value(fresh=True) == 200


def test_idempotency_key_applies_once(kit: shardkit.Kit, name: str) -> None:
    votes = kit.sharded(name)
    assert votes.incr(5, key="request-8f2c")
    assert not votes.incr(5, key="request-8f2c")
    assert not votes.decr(5, key="request-8f2c")
    assert votes.decr(2, key="request-8f2d")
    assert votes.value(fresh=True) == 3
    assert votes.value() == 3


def test_expired_keys_are_purged(store_url: str, name: str) -> None:
    with shardkit.connect(store_url, prefix=PREFIX, key_retention=0) as kit:
        votes = kit.sharded(name)
        assert votes.incr(1, key="k")
        # Older than now by the wall clock, which a step back of the machine's clock can
        # hold still: poll, with a deadline.
        deadline = time.monotonic() + 10
        while (purged := kit.purge_keys()) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert purged >= 1
        assert votes.incr(1, key="k")
        assert votes.value(fresh=True) == 2


def test_values_reads_many_counters(kit: shardkit.Kit, name: str) -> None:
    names = [f"{name}:{i}" for i in range(5)]
    for i, each in enumerate(names):
        kit.sharded(each).incr(i * 10)
    kit.sharded(names[0]).value()  # one cached, the others not
    assert kit.values([*names, f"{name}:never"]) == {
        **{each: i * 10 for i, each in enumerate(names)},
        f"{name}:never": 0,
    }
    kit.store.add(names[1], 0, 1)
    assert kit.values(names)[names[1]] == 10  # now cached
    assert kit.values(names, fresh=True)[names[1]] == 11


def test_get_finds_only_existing_counters(kit: shardkit.Kit, name: str) -> None:
    with pytest.raises(CounterNotFound):
        kit.get(name)
    kit.sharded(name, shards=3).incr(2)
    assert kit.get(name).value(fresh=True) == 2
    assert [c.shards for c in kit.counters() if c.name == name] == [3]


def test_a_name_of_another_kind_is_refused(kit: shardkit.Kit, name: str) -> None:
    kit.store.open_counter(name, "buffered", 1)
    with pytest.raises(CounterKindMismatch):
        kit.sharded(name)


def test_a_grow_made_elsewhere_is_seen(kit: shardkit.Kit, name: str) -> None:
    votes = kit.sharded(name, shards=2)
    kit.store.open_counter(name, "sharded", 30)
    assert votes.shards == 30
