"""Sharded writes move cached values off their callers' path: gathered per process,
sent within ``adjust_delay``, at once for a reader in the writing process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import shardkit
from backends import PREFIX, wait_for
from shardkit.cache.memory import MemoryCache
from shardkit.errors import BackendError
from shardkit.store import open_store


@pytest.fixture
def kits(sqlite_url: str, shared_cache_url: str) -> Iterator[tuple[shardkit.Kit, shardkit.Kit]]:
    """Two kits on one store and one shared cache, as two processes would have: a
    writer whose adjustments wait a minute unless something sends them, and a reader."""
    writer = shardkit.connect(sqlite_url, shared_cache_url, prefix=PREFIX, adjust_delay=60)
    reader = shardkit.connect(sqlite_url, shared_cache_url, prefix=PREFIX)
    yield writer, reader
    writer.close()
    reader.close()


def test_a_write_costs_no_cache_call_and_its_adjustment_is_sent_later(
    kits: tuple[shardkit.Kit, shardkit.Kit], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = kits
    assert reader.sharded(name).value() == 0  # cached
    calls: list[dict[str, int]] = []
    real = writer.cache.incr_many
    monkeypatch.setattr(writer.cache, "incr_many", lambda d: (calls.append(dict(d)), real(d)))
    votes = writer.sharded(name)
    for _ in range(100):
        votes.incr()
    votes.decr(30)
    assert calls == []  # the writes made no cache call
    assert reader.sharded(name).value() == 0  # not adjusted yet: the cached value
    assert votes.value() == 70  # the writer reads its own writes: it sends them first
    assert calls == [{reader.settings.cache_key(name, "sharded:value"): 70}]  # all, in one call
    assert reader.sharded(name).value() == 70


def test_many_counters_adjusted_in_one_call(
    kits: tuple[shardkit.Kit, shardkit.Kit], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = kits
    names = [f"{name}:{i}" for i in range(3)]
    assert reader.values(names) == dict.fromkeys(names, 0)
    calls: list[int] = []
    real = writer.cache.incr_many
    monkeypatch.setattr(writer.cache, "incr_many", lambda d: (calls.append(len(d)), real(d)))
    for i, counter in enumerate(names):
        for _ in range(i + 1):
            writer.sharded(counter).incr()
    assert writer.values(names) == {names[0]: 1, names[1]: 2, names[2]: 3}
    assert calls == [3]
    assert reader.values(names) == {names[0]: 1, names[1]: 2, names[2]: 3}


def test_closing_a_kit_sends_what_it_gathered(
    kits: tuple[shardkit.Kit, shardkit.Kit], name: str
) -> None:
    writer, reader = kits
    assert reader.sharded(name).value() == 0
    writer.sharded(name).incr(7)
    writer.close()
    assert reader.sharded(name).value() == 7


def test_adjustments_arrive_within_the_delay_by_themselves(
    sqlite_url: str, shared_cache_url: str, name: str
) -> None:
    with (
        shardkit.connect(sqlite_url, shared_cache_url, prefix=PREFIX, adjust_delay=0.05) as writer,
        shardkit.connect(sqlite_url, shared_cache_url, prefix=PREFIX) as reader,
    ):
        assert reader.sharded(name).value() == 0
        writer.sharded(name).incr(3)
        wait_for(lambda: reader.sharded(name).value() == 3, "the adjustment to arrive")


class SharedMemory(MemoryCache):
    """The in-memory cache standing in for one that several processes share (two kits in
    this process share one instance), whose increments fail while ``failing``."""

    shared = True
    failing = False

    def incr_many(self, deltas: Any) -> None:
        if self.failing:
            raise BackendError(f"cache {self.url} failed while incrementing: timeout")
        super().incr_many(deltas)


def test_a_failed_adjustment_fails_no_write_and_drops_the_cached_value(
    sqlite_url: str, name: str
) -> None:
    cache = SharedMemory()
    store = open_store(sqlite_url, prefix=PREFIX)
    reader = shardkit.connect(store, cache, prefix=PREFIX)
    writer = shardkit.connect(store, cache, prefix=PREFIX, adjust_delay=60)
    try:
        assert reader.sharded(name).value() == 0
        cache.failing = True
        assert writer.sharded(name).incr(4) is True  # the write stands
        writer.values([name])  # sends: fails, and drops the value
        cache.failing = False
        assert reader.sharded(name).value() == 4  # from the store, not a stale 0
    finally:
        writer.close()
        reader.close()


def test_bad_adjust_delays_are_refused(sqlite_url: str) -> None:
    for bad in (-1, 61, float("nan"), float("inf"), True, "0.1"):
        with pytest.raises(shardkit.errors.ConfigurationError, match="adjust_delay"):
            shardkit.connect(sqlite_url, prefix=PREFIX, adjust_delay=bad)  # type: ignore[arg-type]
