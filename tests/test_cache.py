"""The cache conformance suite: every cache backend passes the same tests."""

from __future__ import annotations

import time
import uuid

import pytest

from conftest import run_together
from shardkit.cache import Cache
from shardkit.validation import INT64_MAX, INT64_MIN


@pytest.fixture
def key() -> str:
    return f"shardkit-test:{uuid.uuid4().hex}"


def test_absent_keys_read_none(cache: Cache, key: str) -> None:
    assert cache.get(key) is None
    assert cache.get_many([key, f"{key}:2"]) == {}
    assert cache.get_many([]) == {}


def test_add_sets_only_if_absent(cache: Cache, key: str) -> None:
    assert cache.add(key, 5, 60)
    assert not cache.add(key, 9, 60)
    assert cache.get(key) == 5


def test_incr_adjusts_present_keys_and_never_creates_one(cache: Cache, key: str) -> None:
    assert cache.incr(key, 3) is None
    assert cache.get(key) is None
    cache.add(key, 10, 60)
    assert cache.incr(key, 3) == 13
    assert cache.incr(key, -20) == -7  # below zero, memcached included
    assert cache.incr(key, -1) == -8
    assert cache.get(key) == -8


def test_values_span_signed_64_bit(cache: Cache, key: str) -> None:
    cache.add(f"{key}:min", INT64_MIN + 5, 60)
    cache.add(f"{key}:max", INT64_MAX - 5, 60)
    assert cache.incr(f"{key}:min", -5) == INT64_MIN
    assert cache.incr(f"{key}:max", 5) == INT64_MAX
    assert cache.get_many([f"{key}:min", f"{key}:max"]) == {
        f"{key}:min": INT64_MIN,
        f"{key}:max": INT64_MAX,
    }


def test_get_many_and_delete(cache: Cache, key: str) -> None:
    cache.add(f"{key}:a", 1, 60)
    cache.add(f"{key}:b", -2, 60)
    assert cache.get_many([f"{key}:a", f"{key}:b", f"{key}:c"]) == {f"{key}:a": 1, f"{key}:b": -2}
    cache.delete(f"{key}:a")
    cache.delete(f"{key}:never")
    assert cache.get(f"{key}:a") is None


def test_keys_of_any_text(cache: Cache, key: str) -> None:
    odd = [f"{key} with spaces", f"{key}:ünï😀", f"{key}:" + "x" * 300]
    for index, each in enumerate(odd):
        assert cache.add(each, index, 60)
    assert cache.get_many(odd) == {each: index for index, each in enumerate(odd)}


def test_added_keys_expire_unless_added_without_ttl(cache: Cache, key: str) -> None:
    cache.add(key, 1, 1)
    cache.add(f"{key}:kept", 7, None)
    deadline = time.monotonic() + 5
    while cache.get(key) is not None:
        assert time.monotonic() < deadline, "key outlived its TTL"
        time.sleep(0.05)
    assert cache.add(key, 2, 60)
    assert cache.get(f"{key}:kept") == 7


def test_concurrent_increments_are_exact(cache: Cache, key: str) -> None:
    cache.add(key, 0, 60)

    def work(_: int) -> None:
        for _ in range(250):
            cache.incr(key, 3)
            cache.incr(key, -1)

    run_together(8, work)
    assert cache.get(key) == 8 * 250 * 2


def test_concurrent_adds_have_one_winner(cache: Cache, key: str) -> None:
    winners: list[int] = []

    def work(value: int) -> None:
        if cache.add(key, value, 60):
            winners.append(value)

    run_together(8, work)
    assert len(winners) == 1
    assert cache.get(key) == winners[0]


def test_bump_creates_an_absent_key_at_zero(cache: Cache, key: str) -> None:
    assert cache.bump(key, 5) == 5
    assert cache.bump(key, -7) == -2
    cache.add(f"{key}:big", 2**62, None)
    assert cache.bump(f"{key}:big", 3) == 2**62 + 3
    assert cache.get_many([key, f"{key}:big"]) == {key: -2, f"{key}:big": 2**62 + 3}


def test_concurrent_bumps_of_an_absent_key_are_exact(cache: Cache, key: str) -> None:
    run_together(8, lambda _: [cache.bump(key, 2) for _ in range(100)])
    assert cache.get(key) == 8 * 100 * 2
