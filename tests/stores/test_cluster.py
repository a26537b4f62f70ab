"""Redis Cluster: one hot buffered counter spread over every primary by its stripes, and
a primary SIGKILLed under load (its replica promoted): sharded counts exact, buffered
counts losing at most what was pending, ids never handed out twice. A command is tried
twice at most: a node gone silent fails it, a failover missed is followed. Nodes stopped
(SIGSTOP): a node that sees too few primaries is down; a primary whose replica is
silent hands out no id until it drops the replica.

The guarantee suites themselves (cache conformance, every counter kind, the executor's
marks, processes sharing the cache) run on the session's cluster through the
``redis-cluster`` cache parameter (``conftest.py``)."""

from __future__ import annotations

import asyncio
import gc
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import ClusterNode as AsyncRedisNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.cluster import ClusterNode as RedisNode
from redis.cluster import RedisCluster
from redis.retry import Retry

import shardkit
from backends import NEVER, PREFIX, free_port, store_url_for, wait_for
from received import pending_on
from servers import DEADLINE, ClusterNode, Cutter, RedisClusterServers, Writers, running
from shardkit.aio.cluster import AsyncRedisClusterCache
from shardkit.cache import open_cache
from shardkit.cache.cluster import RedisClusterCache, parse
from shardkit.errors import BackendError, BackendUnavailable

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _failed_nodes_connections_collected() -> Iterator[None]:
    """redis-py's asyncio cluster client leaves open the connections of a node that failed
    under a command (closed only when collected, with a ResourceWarning): each test's are
    collected at its end, so that none lands in whichever test the worker runs next."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def calls(nodes: list[ClusterNode], command: str) -> dict[int, int]:
    """The ``command`` commands each node has run, from ``INFO commandstats``."""
    counts = {}
    for node in nodes:
        stats = node.info("INFO commandstats").get(f"cmdstat_{command}", {"calls": 0})
        counts[node.port] = stats["calls"]
    return counts


def node_named(cluster: RedisClusterServers, name: str) -> ClusterNode:
    """The node of ``cluster`` that redis-py calls ``name`` (``host:port``)."""
    [node] = [node for node in cluster.nodes if f"{node.address}:{node.port}" == name]
    return node


def test_stripes_spread_one_hot_counter_over_every_primary(
    redis_cluster: RedisClusterServers, sqlite_url: str, name: str
) -> None:
    primaries = redis_cluster.primaries()
    with shardkit.connect(sqlite_url, redis_cluster.url, prefix=PREFIX) as kit:
        assert isinstance(kit.cache, RedisClusterCache)
        striped = kit.buffered(name, interval=NEVER)
        assert striped.stripes == len(primaries) == 3  # the cache's default: one each
        single = kit.buffered(f"{name}:single", interval=NEVER, stripes=1)
        spread = {}
        for counter in (striped, single):
            before = calls(primaries, "incrby")
            for _ in range(3000):
                counter.incr()
            after = calls(primaries, "incrby")
            spread[counter.stripes] = [after[port] - before[port] for port in sorted(after)]
        assert striped.value() == single.value() == 3000
        kit.flush_all()
        assert striped.parts() == single.parts() == (3000, 0)
    mean = sum(spread[3]) / 3
    assert all(abs(count - mean) <= 0.15 * mean for count in spread[3]), spread
    assert sorted(spread[1]) == [0, 0, 3000], spread  # one primary takes them all


def test_a_primary_killed_under_load_loses_only_pending_and_repeats_no_id(
    sqlite_url: str, name: str, capsys: Any
) -> None:
    store = store_url_for("postgres", sqlite_url)
    with running(RedisClusterServers) as cluster:  # its own: it breaks it
        kit = shardkit.connect(store, cluster.url, prefix=PREFIX)
        sharded = kit.sharded(name, shards=8)
        buffered = kit.buffered(f"{name}:buffered", interval=NEVER)
        ids = kit.ids(f"{name}:ids", block=50)
        taken: list[int] = []
        kinds = ("sharded", "buffered", "ids")
        calls = (sharded.incr, buffered.incr, lambda: taken.append(ids.next()))

        def acked(writers: Writers) -> dict[str, int]:
            """Calls that returned, by kind (writer ``slot`` writes ``kinds[slot % 3]``)."""
            return {kind: sum(writers.acked[k::3]) for k, kind in enumerate(kinds)}

        with Writers(lambda slot: calls[slot % 3](), count=6, pause=0.01) as writers:
            writers.wait_acked(200)
            kit.flush_all()
            victim = cluster.primaries()[0]
            # What may be lost: the victim's stripes' pending sums, and what is counted
            # between this reading and the kill.
            before = acked(writers)["buffered"]
            on_victim = pending_on(kit, buffered, f"127.0.0.1:{victim.port}")
            cluster.kill(victim)
            exposed = on_victim + acked(writers)["buffered"] - before
            killed_at = time.monotonic()
            cluster.wait_healthy()
            promoted = time.monotonic() - killed_at
            writers.wait_acked(200)  # and on after the failover
        done = acked(writers)
        kit.flush_all()
        counted = sharded.value(fresh=True), buffered.parts()
        kit.close()
    assert counted[0] == done["sharded"]  # the store is the truth: exact
    assert counted[1].pending == 0
    lost = done["buffered"] - counted[1].stored
    # Lost at most what was pending on the primary that died. Never doubled: what counts
    # beyond the calls that returned is calls that raised though their increment was
    # applied, its reply never coming: those in flight when the primary died (its replica
    # may have had it), or any that a live node left unanswered past the client's
    # timeout. A call that found no connection sent nothing.
    in_doubt = 0
    for slot in range(1, len(writers.calls), 3):  # the buffered writers'
        failed = [began for began, ok in writers.calls[slot] if not ok]
        for began, exc in zip(failed, writers.errors[slot], strict=True):
            in_doubt += began < killed_at or isinstance(exc.__cause__, redis.TimeoutError)
    assert -in_doubt <= lost <= exposed
    assert len(set(taken)) == len(taken) == done["ids"]  # no id handed out twice
    raised = writers.raised()
    assert all(isinstance(exc, BackendError) for exc in raised)
    with capsys.disabled():
        print(
            f"\nfailover: replica promoted {promoted:.1f} s after the kill; {len(raised)} "
            f"calls raised meanwhile; buffered lost {lost} of {exposed} pending on the "
            f"killed primary at most ({in_doubt} raised in doubt); "
            f"{len(taken)} ids, none twice; sharded exact ({counted[0]})"
        )


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_increment_whose_reply_is_lost_raises_and_is_counted_once(
    redis_cluster: RedisClusterServers, name: str, kind: str
) -> None:
    """A cluster client made by its constructor sends a command whose connection failed
    again (after reading the map again): an increment the server applied would count
    twice. Through proxies that can cut a node's connection before its reply."""
    proxies = {node.port: Cutter("127.0.0.1", node.port) for node in redis_cluster.nodes}

    def remap(address: tuple[str, int]) -> tuple[str, int]:
        return "127.0.0.1", proxies[address[1]].port

    key = f"{{{name}}}:bumped"
    start = {"host": "127.0.0.1", "port": redis_cluster.primaries()[0].port}

    async def bumps(cache: Any) -> tuple[int, int, int]:
        first = await cache.bump(key, 1)
        for proxy in proxies.values():
            proxy.arm(b"INCRBY")
        with pytest.raises(BackendUnavailable):
            await cache.bump(key, 1)
        return first, await cache.get(key), await cache.bump(key, 1)

    try:
        if kind == "sync":
            cache = RedisClusterCache(RedisCluster(**start, address_remap=remap))
            counted = asyncio.run(bumps(Awaited(cache)))
            cache.close()
            cache._client.close()
        else:

            async def main() -> tuple[int, int, int]:
                client = AsyncRedisCluster(**start, address_remap=remap)
                cache = AsyncRedisClusterCache(client)
                try:
                    return await bumps(cache)
                finally:
                    await cache.close()
                    await client.aclose()

            counted = asyncio.run(main())
    finally:
        for proxy in proxies.values():
            proxy.close()
    assert counted == (1, 2, 3)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_command_to_a_silent_node_is_tried_twice_then_raises(
    redis_cluster: RedisClusterServers, name: str, kind: str
) -> None:
    """A command whose node sends no reply within the client's timeout is tried once
    more, on the cluster's map read again, then raises ``BackendUnavailable``: a cluster
    client with the options of one made by URL. redis-py's cluster client would try it
    ten more times, each waiting the timeout, and so wait out a partition of up to a
    minute where the call should fail. Through proxies, the key's node's going silent:
    the second try is the one connection made to it since."""
    proxies = {node.port: Cutter("127.0.0.1", node.port) for node in redis_cluster.nodes}

    def remap(address: tuple[str, int]) -> tuple[str, int]:
        return "127.0.0.1", proxies[address[1]].port

    startup = parse(f"redis+cluster://127.0.0.1:{redis_cluster.primaries()[0].port}")
    key = f"{{{name}}}:silent"

    async def tried(cache: Any, owner: Callable[[str], str], refresh: Any) -> int:
        await cache.add(key, 7, None)
        silent: list[Cutter] = []
        deadline = time.monotonic() + DEADLINE
        while not silent:  # redis-py takes a MOVED answer's node as named, past the proxies
            assert time.monotonic() < deadline, "the key's node is not behind its proxy"
            await refresh()  # the map read again (the cluster's nodes agree on it soon)
            assert await cache.get(key) == 7  # a connection to the key's node
            silent = [proxy for proxy in proxies.values() if owner(key).endswith(f":{proxy.port}")]
        silent[0].hold()
        with pytest.raises(BackendUnavailable) as raised:
            await cache.get(key)
        assert isinstance(raised.value.__cause__, redis.TimeoutError)
        return silent[0].held

    try:
        if kind == "sync":
            options = startup.client_options(RedisNode, Retry)
            cache = RedisClusterCache(RedisCluster(**options, address_remap=remap))
            held = asyncio.run(tried(Awaited(cache), cache.owner, Awaited(cache._pipes).refresh))
            cache.close()
            cache._client.close()
        else:

            async def main() -> int:
                options = startup.client_options(AsyncRedisNode, AsyncRetry)
                client = AsyncRedisCluster(**options, address_remap=remap)
                cache = AsyncRedisClusterCache(client)
                try:
                    return await tried(cache, cache.owner, cache._pipes.refresh)
                finally:
                    await cache.close()
                    await client.aclose()

            held = asyncio.run(main())
    finally:
        for proxy in proxies.values():
            proxy.close()
    assert held == 1


def test_a_client_that_missed_a_failover_follows_it_at_its_next_command(name: str) -> None:
    """A client whose map names a primary that died since, its replica promoted, reads
    the key at its next command, from either form made by URL: the command whose
    connection failed is tried again on the map read anew."""
    key = f"{{{name}}}:moved"
    with running(RedisClusterServers) as cluster:  # its own: it kills a primary
        sync = RedisClusterCache.from_url(cluster.url)

        async def main() -> None:
            aio = AsyncRedisClusterCache.from_url(cluster.url)
            try:
                caches = [Awaited(sync), aio]
                await aio.add(key, 7, None)
                cluster.wait_replicating()  # the key on the replica too
                for cache in caches:
                    assert await cache.get(key) == 7  # each has read the map: the primary
                cluster.kill(node_named(cluster, sync.owner(key)))
                cluster.wait_healthy()  # its replica promoted
                for cache in caches:
                    assert await cache.get(key) == 7
            finally:
                await aio.close()

        try:
            asyncio.run(main())
        finally:
            sync.close()


def test_a_node_out_of_sight_of_most_primaries_is_unavailable(name: str) -> None:
    """A node that sees too few primaries answers CLUSTERDOWN: the call raises
    ``BackendUnavailable``, as any call the cluster cannot serve now. Two of the three
    primaries are stopped (SIGSTOP); no replica can be promoted without them."""
    key = f"{{{name}}}:down"
    with running(RedisClusterServers) as cluster:  # its own: it stops two primaries
        cache = RedisClusterCache.from_url(cluster.url)
        try:
            cache.add(key, 7, None)
            live = node_named(cluster, cache.owner(key))
            first, second = [node for node in cluster.primaries() if node is not live]
            with first.silent(), second.silent():
                wait_for(
                    lambda: live.info("CLUSTER INFO").get("cluster_state") == "fail",
                    "the live primary to see the cluster down",
                    DEADLINE,
                )
                with pytest.raises(BackendUnavailable) as raised:
                    cache.get(key)
            assert isinstance(raised.value.__cause__, redis.exceptions.ClusterDownError)
        finally:
            cache.close()


def test_a_primary_listing_a_silent_replica_hands_out_no_id_until_it_drops_it(
    sqlite_url: str, name: str
) -> None:
    """The limit stated in docs/deploying.md: a replica gone silent stays in its primary's
    ``ROLE`` until the primary's ``repl-timeout``, and meanwhile that primary hands out no
    value: an increment no replica acknowledges is skipped and made again, and raises
    ``BackendUnavailable`` after 15 s. Once the primary has dropped the replica, ids come
    again, above every id before. The replica is stopped (SIGSTOP); the primary's
    ``repl-timeout`` is an hour until an id is seen refused, then 1 s."""
    with (
        running(RedisClusterServers) as cluster,  # its own: it stops a replica
        shardkit.connect(sqlite_url, cluster.url, prefix=PREFIX) as kit,
        ThreadPoolExecutor(1) as pool,
    ):
        cache = kit.cache
        assert isinstance(cache, RedisClusterCache)
        ids = kit.ids(name, block=1000, sub_block=1)  # each id an increment
        before = ids.take(3)
        primary = node_named(cluster, cache.owner(ids._key))
        [replica] = [
            node
            for node in cluster.nodes
            if str(node.info("INFO replication").get("master_port")) == str(primary.port)
        ]
        client = primary.client()

        def listed() -> bool:
            return bool(client.execute_command("ROLE")[2])  # a primary's replicas

        def made() -> int:
            return calls([primary], "evalsha")[primary.port]

        client.config_set("repl-timeout", 3600)
        try:
            with replica.silent():
                start = made()
                with pytest.raises(BackendUnavailable):
                    cache.incr(ids._key, 1)
                assert made() >= start + 2  # made again, each value skipped
                start = made()
                taking = pool.submit(lambda: (ids.next(), time.monotonic()))
                wait_for(lambda: made() >= start + 2, "an id made again", DEADLINE)
                assert not taking.done()
                asked = time.monotonic()
                assert listed()
                last_listed = [asked]

                def dropped() -> bool:
                    asked = time.monotonic()
                    if listed():
                        last_listed[0] = asked
                        return False
                    return True

                client.config_set("repl-timeout", 1)
                wait_for(dropped, "the primary to drop its silent replica", DEADLINE)
                taken, returned = taking.result(DEADLINE)
        finally:
            client.config_set("repl-timeout", 5)
            client.close()
    assert returned > last_listed[0]  # handed out once the replica was dropped, not before
    assert taken > max(before)


class Awaited:
    """A sync cache's calls, awaitable (one test body for both forms)."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._cache, name)

        async def call(*args: Any) -> Any:
            return method(*args)

        return call


@pytest.mark.parametrize(
    "url",
    ["redis+cluster://", "redis+cluster://127.0.0.1:7000/3", "redis+cluster://h:99999"],
)
def test_a_bad_cluster_url_is_a_configuration_error(url: str) -> None:
    with pytest.raises(shardkit.ConfigurationError):
        open_cache(url)


def test_an_unreachable_cluster_is_named_without_its_password() -> None:
    with pytest.raises(shardkit.BackendUnavailable) as raised:
        open_cache(f"redis+cluster://app:s3cret-pw@127.0.0.1:{free_port()}")
    assert "s3cret-pw" not in str(raised.value)
    assert "redis+cluster://app:***@127.0.0.1" in str(raised.value)


def test_names_with_braces_keep_their_stripes_apart(
    redis_cluster: RedisClusterServers, sqlite_url: str, name: str
) -> None:
    """A hash tag ends at the first ``}``: the tags are digests, so any name spreads."""
    with shardkit.connect(sqlite_url, redis_cluster.url, prefix=PREFIX) as kit:
        cache = kit.cache
        assert isinstance(cache, RedisClusterCache)
        counter = kit.buffered(f"}}{name}{{x}}", interval=NEVER)
        for _ in range(300):
            counter.incr()
        generations = kit.store.generations([counter.name])[counter.name]
        assert {cache.owner(counter._keys(g)[0]) for g in generations} == set(cache.owners())
        for generation in generations:  # a generation's two sums on one primary
            up, down = counter._keys(generation)
            assert cache.owner(up) == cache.owner(down)
        counter.flush()
        assert counter.parts() == (300, 0)
