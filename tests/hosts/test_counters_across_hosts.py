"""The counters' guarantees with writers on three hosts, while hosts are cut off and
killed: every count is checked against what the writers recorded as acknowledged."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

import shardkit
from backends import PREFIX, sample, wait_for
from deployment import Deployment
from host_work import acknowledged, failures
from hosts import Host
from received import pending_on

pytestmark = pytest.mark.slow

PARTITION = 10.0  # seconds a host stays cut off
WRITES = "shardkit_write_seconds_count"
FELL_BACK = "shardkit_failures_ridden_out_total"
READING = "reading a cached value"
PROGRESS = 100  # acknowledged writes that show a host's writers going on


def test_acknowledged_sharded_increments_count_once_across_partitions(
    deployment: Deployment, tmp_path: Path
) -> None:
    """Writers retry a failed increment with its key: a host cut off mid-write, or the
    host of a cache primary, loses and doubles nothing. The store drops the cut-off
    host's connections meanwhile, so each of its writes in flight fails when it comes
    back (and is retried), and its reads of the counter's cached value (from a primary
    on another host) fail over to the store, which it cannot reach either: its metrics
    count both."""
    name = f"test:hosts:sharded:{uuid.uuid4().hex}"
    deployment.writers("sharded", name, tmp_path)
    with shardkit.connect(deployment.store_url, deployment.cache_url, prefix=PREFIX) as kit:
        owner = kit.cache.owner(kit.sharded(name)._value_key)  # type: ignore[attr-defined]
    # The hosts cut off in turn: first one whose cached value lives on another host.
    hosts = sorted(deployment.workers, key=lambda h: owner.startswith(f"{h.address}:"))
    pids = {host: process.pid for host, process, _ in deployment.started}

    def read_failed() -> bool:
        """The first host cut off counted a read of the cached value that failed, read
        from inside it (its cluster client gives up once no node answers, retries and
        reading the cluster's map again included)."""
        metrics = deployment.metrics(hosts[0], within=True)
        return sample(metrics, FELL_BACK, action=READING) >= 1

    for host in hosts:
        deployment.goes_on(host, PROGRESS)
    for victim in hosts[:2]:  # each holds a cache primary and a replica, and writers
        victim.partition()
        cut_at, cut = time.monotonic(), deployment.acked(victim)
        for host in hosts:
            if host is not victim:
                deployment.goes_on(host, PROGRESS)
        time.sleep(max(0.0, PARTITION - (time.monotonic() - cut_at)))
        if victim is hosts[0]:  # cut off until a read of the cached value has failed
            wait_for(read_failed, "the cut-off host's failed read in its metrics", 120)
        assert deployment.acked(victim) <= cut + 4  # at most the replies in flight at the cut
        victim.heal()
        deployment.goes_on(victim, PROGRESS)
        failed = failures(tmp_path, pids[victim])
        assert failed >= 1
        metrics = deployment.metrics(victim)
        assert sample(metrics, WRITES, kind="sharded", outcome="failed") == failed
    deployment.stop_writers()
    with shardkit.connect(deployment.store_url, deployment.cache_url, prefix=PREFIX) as kit:
        assert kit.sharded(name).value(fresh=True) == len(acknowledged(tmp_path))
    print(f"acknowledged {len(acknowledged(tmp_path))}, failures {failures(tmp_path)}")


def _taking_ids(deployment: Deployment, directory: Path) -> Host:
    """Start id takers on every worker host, recording in ``directory``; once each host
    has taken ids, the host of the cache primary that holds the allocator's keys."""
    name = f"test:hosts:ids:{uuid.uuid4().hex}"
    deployment.writers("ids", name, directory)
    for host in deployment.workers:
        deployment.goes_on(host, PROGRESS)
    with shardkit.connect(deployment.store_url, deployment.cache_url, prefix=PREFIX) as kit:
        owner = kit.cache.owner(kit.ids(name)._pointer_key)  # type: ignore[attr-defined]
    [holder] = [host for host in deployment.workers if owner.startswith(f"{host.address}:")]
    return holder


def _handed_out_once(deployment: Deployment, directory: Path) -> None:
    deployment.stop_writers()
    ids = acknowledged(directory)
    assert len(set(ids)) == len(ids), "an id was handed out twice"


def test_ids_never_repeat_across_a_dead_primary_host(
    deployment: Deployment, tmp_path: Path
) -> None:
    """The host of the allocator's cache primary dies, with writers (the primary's
    replica, on another host, takes over). No id is handed out twice, before or after."""
    dead = _taking_ids(deployment, tmp_path)
    dead.kill()
    deployment.cluster.wait_healthy()
    assert deployment.primaries_on(dead) == 0
    for host in deployment.workers:
        if host is not dead:
            deployment.goes_on(host, PROGRESS)
    _handed_out_once(deployment, tmp_path)


def test_ids_never_repeat_across_a_cut_off_host_rejoining(
    deployment: Deployment, tmp_path: Path
) -> None:
    """The host of the allocator's cache primary is cut off with its writers (the
    primary's replica, on another host, takes over) and rejoins: its writers go on from
    where the others are. No id is handed out twice, before, during or after: the cut-off
    primary hands out nothing its replica did not acknowledge."""
    cut = _taking_ids(deployment, tmp_path)
    cut.partition()
    cut_at = time.monotonic()
    for host in deployment.workers:
        if host is not cut:
            deployment.goes_on(host, PROGRESS)
    time.sleep(max(0.0, PARTITION - (time.monotonic() - cut_at)))
    cut.heal()
    deployment.goes_on(cut, PROGRESS)
    _handed_out_once(deployment, tmp_path)


def test_buffered_counts_lose_at_most_the_dead_hosts_pending_and_double_nothing(
    deployment: Deployment, tmp_path: Path
) -> None:
    """A host dies with a cache primary and with writers. What can be lost is what its
    primary held beyond the store at that moment (its replica may not have it yet),
    and what was counted between that reading and the death; nothing counts twice. The
    surviving hosts' scheduled flushes go on (their metrics show them)."""
    name = f"test:hosts:buffered:{uuid.uuid4().hex}"
    deployment.writers("buffered", name, tmp_path)
    dead = deployment.workers[0]
    for host in deployment.workers:
        deployment.goes_on(host, PROGRESS)
    with shardkit.connect(deployment.store_url, deployment.cache_url, prefix=PREFIX) as kit:
        counter = kit.buffered(name)
        [primary] = [node for node in deployment.cluster.primaries() if node.host is dead]
        before = deployment.acked()
        on_victim = pending_on(kit, counter, f"{primary.address}:{primary.port}")
        dead.kill()
        exposed = on_victim + deployment.acked() - before
        deployment.cluster.wait_healthy()
        survivors = [host for host in deployment.workers if host is not dead]

        def flushes() -> float:
            """Scheduled flushes the surviving hosts ran (their lag's observations)."""
            return sum(
                value
                for host in survivors
                for (sample, _), value in deployment.metrics(host).items()
                if sample == "shardkit_flush_lag_seconds_count"
            )

        flushed = flushes()
        wait_for(lambda: flushes() > flushed, "a surviving host's scheduled flush", 60)
        deployment.goes_on(None, PROGRESS)
        deployment.stop_writers()  # the survivors' kits close: their flushes run
        acked, failed = len(acknowledged(tmp_path)), failures(tmp_path)
        total = counter.value()
        # A failed increment may have counted (its reply was lost), an unanswered one too.
        assert acked - exposed <= total <= acked + failed + 4 * len(deployment.workers)
        print(f"acked {acked}, counted {total}, exposed {exposed}, failed {failed}")
