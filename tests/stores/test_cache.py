"""The cache conformance suite: every cache backend passes the same tests."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from pymemcache.exceptions import MemcacheClientError

from backends import CACHE_URLS, REDIS, require, run_together, wait_for
from servers import Cutter
from shardkit.cache import Cache, MemoryCache, memory, open_cache
from shardkit.cache.base import Recording
from shardkit.errors import BackendError, BackendUnavailable
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
    wait_for(lambda: cache.get(key) is None, "the key to expire after its TTL of 1 s", 60)
    assert cache.add(key, 2, 60)
    assert cache.get(f"{key}:kept") == 7


def test_add_many_sets_the_absent_keys_only(cache: Cache, key: str) -> None:
    keys = [f"{{{key}:{i}}}" for i in range(5)]  # hash tags: on a cluster, several slots
    assert cache.add(keys[0], 100, 60)
    cache.add_many({each: i for i, each in enumerate(keys)}, 60)
    assert cache.get_many(keys) == {**{each: i for i, each in enumerate(keys)}, keys[0]: 100}
    cache.add_many({}, 60)
    cache.add_many({f"{key}:short": 1}, 1)
    cache.add_many({f"{key}:kept": 2}, None)
    wait_for(lambda: cache.get(f"{key}:short") is None, "the key to expire after 1 s", 60)
    assert cache.get(f"{key}:kept") == 2


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


def test_incr_once_applies_each_record_once_and_only_onto_present_sums(
    cache: Cache, key: str
) -> None:
    """``Recording.incr_once``, on every cache but memcached (which has no atomic command
    over several keys, and does not claim it)."""
    if not isinstance(cache, Recording):
        assert cache.url.startswith("memcached://")
        return
    up, down, first, second = (f"{{{key}}}:{part}" for part in ("up", "down", "a", "b"))
    assert cache.incr_once([up, down], [(first, 0, 5)], 60) is None  # no sums: no change
    assert cache.get_many([up, first]) == {}
    cache.add(up, 2**62, None)
    cache.add(down, 10, None)
    writes = [(first, 0, 5), (second, 1, 2), (first, 1, 7)]  # a record repeated: left out
    assert cache.incr_once([up, down], writes, 60) == ([2**62 + 5, 12], [True, True, False])
    assert cache.incr_once([up, down], [(second, 0, 1)], 60) == ([2**62 + 5, 12], [False])
    short = f"{{{key}}}:short"
    cache.incr_once([up, down], [(short, 0, 1)], 1)
    wait_for(lambda: cache.get(short) is None, "the record to expire after 1 s", 60)
    assert cache.get_many([first, second]) == {first: 1, second: 1}
    cache.delete(down)
    assert cache.incr_once([up, down], [(f"{{{key}}}:c", 0, 1)], 60) is None
    assert cache.get_many([up, f"{{{key}}}:c"]) == {up: 2**62 + 6}


def test_concurrent_incr_once_of_one_record_applies_once(cache: Cache, key: str) -> None:
    if not isinstance(cache, Recording):
        return
    up, down = f"{{{key}}}:up", f"{{{key}}}:down"
    cache.add(up, 0, None)
    cache.add(down, 0, None)
    applied: list[bool] = []

    def work(_: int) -> None:
        for n in range(50):
            applied.extend(cache.incr_once([up, down], [(f"{{{key}}}:{n}", 0, 3)], 60)[1])  # type: ignore[index]

    run_together(8, work)
    assert sum(applied) == 50
    assert cache.get(up) == 50 * 3


@pytest.fixture(params=["one server", "hashed"])
def memcached(request: pytest.FixtureRequest) -> Iterator[tuple[Cache, Any]]:
    """The memcached cache, by URL of one server or of two (the same server twice, so that
    a HashClient routes the keys), and a raw client to the same server."""
    from pymemcache.client.base import Client

    url = CACHE_URLS["memcached"]
    require(url)
    server = url.removeprefix("memcached://")
    cache = open_cache(url if request.param == "one server" else f"{url},{server}")
    raw = Client(server)
    yield cache, raw
    raw.close()
    cache.close()


def _refused(raw: Any, key: str, value: int, ttl: int) -> None:
    """Store ``value`` (biased, as the cache stores it) with digit separators: memcached
    refuses to increment it, as 1.6.18 now and then does a key holding plain digits."""
    raw.set(key, f"{value + 2**63:_}".encode(), ttl, noreply=False)
    with pytest.raises(MemcacheClientError, match="non-numeric"):
        raw.incr(key, 1)


def test_memcached_rewrites_a_key_it_refuses_to_increment_keeping_its_ttl(
    memcached: tuple[Cache, Any], key: str
) -> None:
    cache, raw = memcached
    _refused(raw, key, 10, ttl=600)
    assert cache.get(key) == 10
    assert cache.incr(key, 5) == 15
    assert raw.incr(key, 0) == 15 + 2**63  # plain digits again: the server increments it
    ttl = int(raw.raw_command(f"mg {key} t").split()[1][1:])
    assert 590 <= ttl <= 600
    _refused(raw, key, 10, ttl=0)
    assert cache.incr(key, -30) == -20
    assert raw.raw_command(f"mg {key} t").split()[1] == b"t-1"  # still without expiry
    assert cache.bump(key, 1) == -19


def test_memcached_rewrites_a_refused_key_exactly_under_concurrent_increments(
    memcached: tuple[Cache, Any], key: str
) -> None:
    cache, raw = memcached
    for round_ in range(20):
        _refused(raw, key, round_, ttl=600)
        run_together(8, lambda _: [cache.incr(key, 1) for _ in range(5)])
        assert cache.get(key) == round_ + 8 * 5


@pytest.mark.parametrize("kind", ["redis", "memcached"])
def test_a_value_that_is_not_a_number_is_a_backend_error(kind: str, key: str) -> None:
    url = CACHE_URLS[kind]
    require(url)
    foreign = b"another program's value"
    if kind == "redis":
        import redis

        with redis.Redis.from_url(url) as raw:
            raw.set(key, foreign, ex=600)
    else:
        from pymemcache.client.base import Client

        raw = Client(url.removeprefix("memcached://"))
        raw.set(key, foreign, 600, noreply=False)
        raw.close()
    cache = open_cache(url)
    for call in (cache.get, lambda key: cache.get_many([key]), lambda key: cache.incr(key, 1)):
        with pytest.raises(BackendError):
            call(key)
    cache.close()


# -- the Redis cache's increments: sent once ----------------------------------------------


REDIS_DB = int(urlsplit(REDIS).path.strip("/") or 0)


@pytest.mark.parametrize("given", ["url", "client"])
def test_an_increment_whose_reply_is_lost_raises_and_counted_once(
    cutter: tuple[Cutter, str], key: str, given: str
) -> None:
    import redis

    proxy, url = cutter
    # A client made as its constructor makes one retries a command whose connection
    # failed (ten times); one made from a URL does not.
    cache = open_cache(url if given == "url" else redis.Redis(port=proxy.port, db=REDIS_DB))
    try:
        assert cache.bump(key, 1) == 1
        proxy.arm(b"INCRBY")
        # The server applied it: a client that sent it again (redis-py retries a command
        # whose connection failed) would count it twice.
        with pytest.raises(BackendUnavailable):
            cache.bump(key, 1)
        assert cache.get(key) == 2
        assert cache.bump(key, 1) == 3  # on a new connection
    finally:
        cache.close()


@pytest.mark.parametrize("given", ["url", "client"])
def test_an_async_increment_whose_reply_is_lost_raises_and_counted_once(
    cutter: tuple[Cutter, str], key: str, given: str
) -> None:
    import redis.asyncio

    from shardkit.aio.redis import AsyncRedisCache

    proxy, url = cutter

    async def main() -> tuple[int, int]:
        if given == "url":
            cache = AsyncRedisCache.from_url(url)
        else:  # retries ten times, as the constructor makes it
            cache = AsyncRedisCache(redis.asyncio.Redis(port=proxy.port, db=REDIS_DB))
        try:
            assert await cache.bump(key, 1) == 1
            proxy.arm(b"INCRBY")
            with pytest.raises(BackendUnavailable):
                await cache.bump(key, 1)
            counted = await cache.get(key)
            return counted or 0, await cache.bump(key, 1)
        finally:
            await cache.close()
            if given == "client":
                await cache._client.aclose()

    assert asyncio.run(main()) == (2, 3)


def test_increments_go_on_after_the_server_closed_their_connections(
    cutter: tuple[Cutter, str], key: str
) -> None:
    proxy, url = cutter
    cache = open_cache(url)
    try:
        assert cache.add(key, 10, 60)
        run_together(4, lambda _: cache.bump(key, 1))  # four connections held
        proxy.drop()  # as a restart would: each held connection is closed
        # Each is found closed before it is used, and opened again: nothing fails.
        run_together(4, lambda _: [cache.bump(key, 1) for _ in range(5)])
        assert cache.incr(key, 1) == 10 + 4 + 20 + 1
    finally:
        cache.close()


# -- the in-process cache in a long-running process ----------------------------------------


class Clock:
    """A stand-in for the ``time`` module: ``monotonic`` is what the test sets."""

    now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_the_memory_cache_drops_expired_keys_nobody_reads_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(memory, "time", clock)  # the cache's clock, and only its
    cache = MemoryCache()
    for i in range(1000):  # such as one flush mark per buffered counter per interval
        cache.add(f"mark:{i}", 1, 0.01)
    cache.bump("generation", 1)  # no TTL: stays
    assert cache.size() == 1001
    clock.now += 0.02  # the marks have expired

    def swept() -> bool:
        cache.add("tick", 1, None)  # adds sweep what has expired
        return cache.size() == 2

    wait_for(swept, "the expired marks to be dropped", status=lambda: cache.size())
    assert cache.get("generation") == 1


def test_the_memory_cache_evicts_the_least_recently_used_past_its_bound() -> None:
    cache = MemoryCache(max_keys=100)
    for i in range(100):
        cache.add(f"k{i}", i, None)
    assert cache.get("k0") == 0  # used lately: kept
    for i in range(100, 150):
        cache.bump(f"k{i}", i)
    assert cache.size() == 100
    assert cache.get("k0") == 0
    assert cache.get_many([f"k{i}" for i in range(1, 51)]) == {}  # the least recently used
    assert cache.get("k51") == 51
    assert cache.get("k149") == 149
