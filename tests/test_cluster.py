"""Redis Cluster: one hot buffered counter spread over every primary by its stripes, and
a primary SIGKILLed under load (its replica promoted): sharded counts exact, buffered
counts losing at most what was pending, ids never handed out twice.

The guarantee suites themselves (cache conformance, every counter kind, the executor's
marks, processes sharing the cache) run on the session's cluster through the
``redis-cluster`` cache parameter (``conftest.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import shardkit
from conftest import PREFIX, free_port, store_url_for, wait_for
from servers import ClusterNode, RedisClusterServers
from shardkit.cache import open_cache
from shardkit.cache.cluster import RedisClusterCache
from shardkit.errors import BackendError

pytestmark = pytest.mark.slow


def incrbys(nodes: list[ClusterNode]) -> dict[int, int]:
    """``INCRBY`` commands each node has run, from ``INFO commandstats``."""
    counts = {}
    for node in nodes:
        counts[node.port] = node.info("INFO commandstats").get("cmdstat_incrby", {"calls": 0})[
            "calls"
        ]
    return counts


def test_stripes_spread_one_hot_counter_over_every_primary(
    redis_cluster: RedisClusterServers, sqlite_url: str, name: str
) -> None:
    primaries = redis_cluster.primaries()
    with shardkit.connect(sqlite_url, redis_cluster.url, prefix=PREFIX) as kit:
        assert isinstance(kit.cache, RedisClusterCache)
        striped = kit.buffered(name, interval=3600)
        assert striped.stripes == len(primaries) == 3  # the cache's default: one each
        single = kit.buffered(f"{name}:single", interval=3600, stripes=1)
        spread = {}
        for counter in (striped, single):
            before = incrbys(primaries)
            for _ in range(3000):
                counter.incr()
            after = incrbys(primaries)
            spread[counter.stripes] = [after[port] - before[port] for port in sorted(after)]
        assert striped.value() == single.value() == 3000
        kit.flush_all()
        assert striped.parts() == single.parts() == (3000, 0)
    mean = sum(spread[3]) / 3
    assert all(abs(count - mean) <= 0.15 * mean for count in spread[3]), spread
    assert sorted(spread[1]) == [0, 0, 3000], spread  # one primary takes them all


class Load:
    """Writer threads on one kit: a sharded and a (striped) buffered counter, and ids.
    A call that raises (the cluster failing over) is not counted; every one that
    returns is."""

    def __init__(self, kit: shardkit.Kit, name: str, threads: int = 6) -> None:
        self.sharded = kit.sharded(name, shards=8)
        self.buffered = kit.buffered(f"{name}:buffered", interval=3600)
        self.ids = kit.ids(f"{name}:ids", block=50)
        self.acked = {"sharded": 0, "buffered": 0}
        self.taken: list[int] = []
        self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._write, args=(i,)) for i in range(threads)]

    def _write(self, index: int) -> None:
        kind = ("sharded", "buffered", "ids")[index % 3]
        while not self._stop.is_set():
            try:
                if kind == "sharded":
                    self.sharded.incr()
                elif kind == "buffered":
                    self.buffered.incr()
                else:
                    taken = self.ids.next()
            except BackendError:
                with self._lock:
                    self.failed += 1
                time.sleep(0.01)
                continue
            with self._lock:
                if kind == "ids":
                    self.taken.append(taken)
                else:
                    self.acked[kind] += 1

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {**self.acked, "ids": len(self.taken)}


@pytest.fixture
def own_cluster() -> Iterator[RedisClusterServers]:
    """A cluster of the test's own, which it may break."""
    cluster = RedisClusterServers()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


def test_a_primary_killed_under_load_loses_only_pending_and_repeats_no_id(
    own_cluster: RedisClusterServers, sqlite_url: str, name: str, capsys: Any
) -> None:
    store = store_url_for("postgres", sqlite_url)
    with shardkit.connect(store, own_cluster.url, prefix=PREFIX) as kit, Load(kit, name) as load:
        wait_for(lambda: min(load.snapshot().values()) >= 200, "writers under way", 30)
        flushed = load.snapshot()  # all of this reaches the store before the kill
        kit.flush_all()
        victim = own_cluster.primaries()[0]
        own_cluster.kill(victim)
        killed_at = time.monotonic()
        own_cluster.wait_healthy()
        promoted = time.monotonic() - killed_at
        written = load.snapshot()
        wait_for(
            lambda: all(load.snapshot()[k] >= written[k] + 200 for k in written),
            "writers to go on after the failover",
            30,
        )
    acked = load.snapshot()
    kit = shardkit.connect(store, own_cluster.url, prefix=PREFIX)
    try:
        kit.flush_all()
        sharded = kit.sharded(name).value(fresh=True)
        buffered = kit.buffered(f"{name}:buffered", interval=3600).parts()
    finally:
        kit.close()
    assert sharded == acked["sharded"]  # the store is the truth: exact
    assert buffered.pending == 0
    lost = acked["buffered"] - buffered.stored
    # Never doubled; lost at most what had not been flushed when the primary died.
    assert 0 <= lost <= written["buffered"] - flushed["buffered"]
    assert len(set(load.taken)) == len(load.taken)  # no id handed out twice
    with capsys.disabled():
        print(
            f"\nfailover: replica promoted {promoted:.1f} s after the kill; "
            f"{load.failed} calls raised meanwhile; buffered lost {lost} of "
            f"{written['buffered'] - flushed['buffered']} pending at most; "
            f"{len(load.taken)} ids, none twice; sharded exact ({sharded})"
        )


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
