"""Idempotency keys of buffered counters: a keyed increment counts once, whatever
generation takes it and however often it is retried, on every cache that records a key
in one atomic step with its increment; memcached, which cannot, refuses keys."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis

import shardkit
import shardkit.aio
from backends import CACHE_URLS, CLUSTER, NEVER, PREFIX, Target, cache_url_of, require
from servers import Cutter
from shardkit._redis import INCR_ONCE
from shardkit.counters.buffered import _FULL, pointer_keys
from shardkit.counters.generations import Parts, sum_keys
from shardkit.errors import BackendUnavailable, KeysUnsupported

WRITERS = 8
KEYS = 150


@pytest.fixture(params=["memory", "redis", CLUSTER])
def cache_url(request: pytest.FixtureRequest) -> str:
    """Each cache that records keys (the ``kit`` and ``big`` fixtures are on it)."""
    return cache_url_of(request, request.param)


def _keyed_generations(kit: shardkit.Kit, name: str) -> list[int]:
    """The keyed generations (negative ids) the store recorded for counter ``name``."""
    return sorted(g for g in kit.store.generations([name]).get(name, {}) if g < 0)


def test_a_repeated_key_counts_once_before_and_after_its_flush(
    kit: shardkit.Kit, name: str
) -> None:
    hits = kit.buffered(name, interval=NEVER, stripes=3)
    assert hits.incr(5, key="a") is True
    assert hits.incr(5, key="a") is False
    assert hits.decr(5, key="a") is False  # the key is the counter's, whatever the call
    assert hits.parts() == Parts(0, 5)
    assert hits.flush() == 5
    assert hits.incr(5, key="a") is False
    assert hits.decr(2, key="b") is True
    assert hits.incr(1) is True  # increments without a key go on beside them
    assert hits.parts() == Parts(5, -1)
    assert hits.flush() == -1
    assert hits.decr(2, key="b") is False
    assert hits.parts() == Parts(4, 0)
    assert len(_keyed_generations(kit, name)) == 1  # one keyed generation for every stripe


def test_a_retry_after_the_keyed_generation_moved_counts_once(big: shardkit.Kit, name: str) -> None:
    """The keyed generation fills and hands over to a new one: a retry of a key counted
    in the old one is still recognised, before and after a flush."""
    counter = big.buffered(name, interval=NEVER)
    assert counter.incr(1, key="first")
    [first] = _keyed_generations(big, name)
    up, _ = sum_keys(big.settings, name, first)
    big.cache.bump(up, _FULL)  # as if 2**61 more had been counted
    assert counter.incr(1, key="second")  # past 2**61: counted, and the generation is left
    assert counter.incr(1, key="third")
    assert len(_keyed_generations(big, name)) == 2
    assert counter.incr(1, key="first") is False
    assert counter.incr(1, key="second") is False
    assert counter.parts() == Parts(0, _FULL + 3)
    assert counter.flush() == _FULL + 3
    assert counter.decr(1, key="first") is False
    assert counter.decr(1, key="third") is False
    assert counter.parts() == Parts(_FULL + 3, 0)


def test_a_delete_removes_the_keyed_generation_and_a_new_incarnation_has_keys_of_its_own(
    kit: shardkit.Kit, name: str
) -> None:
    hits = kit.buffered(name, interval=NEVER)
    assert hits.incr(3, key="k")
    [keyed] = _keyed_generations(kit, name)
    keys = [*sum_keys(kit.settings, name, keyed), pointer_keys(kit.settings, hits.info, 1)[-1]]
    assert None not in [kit.cache.get(key) for key in keys]
    kit.delete(name)
    assert [kit.cache.get(key) for key in keys] == [None] * 3
    assert hits.incr(3, key="k") is True  # the key of the counter the name holds now
    assert hits.incr(3, key="k") is False
    assert hits.parts() == Parts(0, 3)


def test_writers_repeating_every_key_count_each_once(
    kit: shardkit.Kit, store_url: str, cache_url: str, name: str
) -> None:
    """Writers (with a shared cache, each on a kit of its own: its own connections and
    combiner) all send the same keyed increments and decrements at once while another
    thread flushes: each key counts once, exactly."""
    shared = cache_url != "memory://"
    kits = [Target(store_url, cache_url).connect() if shared else kit for _ in range(WRITERS)]
    deltas = {f"key-{n}": (n + 1) * (-1 if n % 3 == 0 else 1) for n in range(KEYS)}
    applied = [0] * WRITERS
    done = threading.Event()

    def flushing() -> None:
        counter = kit.buffered(name, interval=NEVER)
        while not done.is_set():
            counter.flush()

    flusher = threading.Thread(target=flushing)
    start = threading.Barrier(WRITERS)

    def write(index: int) -> None:
        counter = kits[index].buffered(name, interval=NEVER)
        start.wait()
        for key, delta in deltas.items():
            applied[index] += counter.incr(delta, key=key)

    writers = [threading.Thread(target=write, args=(index,)) for index in range(WRITERS)]
    flusher.start()
    try:
        for thread in writers:
            thread.start()
        for thread in writers:
            thread.join()
    finally:
        done.set()
        flusher.join()
        for each in kits:
            if each is not kit:
                each.close()
    assert sum(applied) == KEYS
    hits = kit.buffered(name, interval=NEVER)
    assert hits.parts().total == sum(deltas.values())
    hits.flush()
    assert hits.parts() == Parts(sum(deltas.values()), 0)


def test_memcached_refuses_a_keyed_increment_before_writing_anything(
    store_url: str, name: str
) -> None:
    """memcached cannot record a key in one atomic step with its increment: a keyed
    increment raises ``KeysUnsupported`` (a ``ValidationError``) and leaves no
    generation, in the sync and the async kit; increments without a key go on."""
    url = CACHE_URLS["memcached"]
    require(url)
    with Target(store_url, url).connect() as kit:
        hits = kit.buffered(name, interval=NEVER)
        with pytest.raises(KeysUnsupported, match="memcached://"):
            hits.incr(1, key="k")
        with pytest.raises(shardkit.ValidationError):
            hits.decr(1, key="k")
        assert kit.store.generations([name]) == {}
        assert hits.incr(2) is True

        async def main() -> None:
            async with shardkit.aio.connect(store_url, url, prefix=PREFIX) as aio:
                counter = await aio.buffered(name, interval=NEVER)
                with pytest.raises(KeysUnsupported):
                    await counter.incr(1, key="k")

        asyncio.run(main())
        assert hits.parts() == Parts(0, 2)
        assert len(kit.store.generations([name])[name]) == 1  # the unkeyed increment's


def test_a_keyed_increment_whose_reply_was_lost_counts_once_when_retried(
    cutter: tuple[Cutter, str], sqlite_url: str, name: str
) -> None:
    """The cache applied the increment and its reply was lost: the call raises, and its
    retry with the key finds it counted (sync and async kits alike)."""
    proxy, url = cutter
    with shardkit.connect(sqlite_url, url, prefix=PREFIX) as kit:
        hits = kit.buffered(name, interval=NEVER)
        assert hits.incr(1, key="seen")
        proxy.arm(INCR_ONCE.sha.encode())
        with pytest.raises(BackendUnavailable):
            hits.incr(2, key="lost")
        assert hits.parts() == Parts(0, 3)  # the cache counted it
        assert hits.incr(2, key="lost") is False

        async def main() -> bool:
            async with shardkit.aio.connect(sqlite_url, url, prefix=PREFIX) as aio:
                counter = await aio.buffered(name, interval=NEVER)
                proxy.arm(INCR_ONCE.sha.encode())
                with pytest.raises(BackendUnavailable):
                    await counter.decr(4, key="lost-async")
                return await counter.decr(4, key="lost-async")

        assert asyncio.run(main()) is False
        assert hits.parts() == Parts(0, -1)


def test_a_key_is_remembered_with_its_increment_while_the_cache_keeps_it(
    own_redis: str, store_url: str, name: str
) -> None:
    """The stated limit: a key's record lives ``key_retention`` seconds in the cache,
    beside its increment. A cache that loses it (here: wiped) lost a pending increment
    with it, and the retry counts it once; once a flush had moved the increment to the
    store, the retry counts it again."""
    server = redis.Redis.from_url(own_redis)
    with shardkit.connect(store_url, own_redis, prefix=PREFIX, key_retention=3600) as kit:
        hits = kit.buffered(name, interval=NEVER)
        assert hits.incr(1, key="k")
        assert 3_500_000 < server.pttl(hits._record_key("k")) <= 3_600_000
        server.flushdb()
        assert hits.incr(1, key="k") is True  # what was pending went with the cache
        assert hits.parts() == Parts(0, 1)
        assert hits.flush() == 1
        server.flushdb()
        assert hits.incr(1, key="k") is True  # flushed, then forgotten: counted again
        assert hits.parts() == Parts(1, 1)
    server.close()
