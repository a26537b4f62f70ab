"""The counters' guarantees with writers on three hosts, while hosts are cut off and
killed: every count is checked against what the writers recorded as acknowledged."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

import shardkit
from backends import PREFIX, wait_for
from deployment import Deployment
from host_work import acknowledged, failures
from hosts import Host

pytestmark = pytest.mark.slow

PARTITION = 10.0  # seconds a host stays cut off
PROGRESS = 100  # acknowledged writes that show a host's writers going on


def test_acknowledged_sharded_increments_count_once_across_partitions(
    deployment: Deployment, tmp_path: Path
) -> None:
    """Writers retry a failed increment with its key: a host cut off mid-write, or the
    host of a cache primary, loses and doubles nothing."""
    name = f"test:hosts:sharded:{uuid.uuid4().hex}"
    deployment.writers("sharded", name, tmp_path)
    pids = {host: process.pid for host, process, _ in deployment.started}

    def acked(host: Host) -> int:
        return len(acknowledged(tmp_path, pids[host]))

    hosts = deployment.workers
    for host in hosts:
        wait_for(lambda h=host: acked(h) >= PROGRESS, f"writes from {host}", 60)
    for victim in hosts[:2]:  # each holds a cache primary and a replica, and writers
        others = [host for host in hosts if host is not victim]
        victim.partition()
        cut_at, cut = time.monotonic(), acked(victim)
        for host in others:
            start = acked(host)
            wait_for(lambda h=host, s=start: acked(h) >= s + PROGRESS, f"writes from {host}", 60)
        time.sleep(max(0.0, PARTITION - (time.monotonic() - cut_at)))
        assert acked(victim) <= cut + 4  # at most the replies in flight at the cut
        victim.heal()
        wait_for(lambda v=victim, c=cut: acked(v) >= c + PROGRESS, f"{victim} to write again", 120)
    deployment.stop_writers()
    with shardkit.connect(deployment.store_url, deployment.cache_url, prefix=PREFIX) as kit:
        assert kit.sharded(name).value(fresh=True) == len(acknowledged(tmp_path))
    print(f"acknowledged {len(acknowledged(tmp_path))}, failures {failures(tmp_path)}")


def test_ids_never_repeat_across_a_dead_primary_host_and_a_rejoining_one(
    deployment: Deployment, tmp_path: Path
) -> None:
    """A host dies with a cache primary (its replica on another host takes over) and with
    its writers, and comes back; then another host is cut off and rejoins. No id is
    handed out twice, before, during or after."""
    name = f"test:hosts:ids:{uuid.uuid4().hex}"
    deployment.writers("ids", name, tmp_path)
    pids = {host: process.pid for host, process, _ in deployment.started}

    def taken(host: Host) -> int:
        return len(acknowledged(tmp_path, pids[host]))

    def goes_on(host: Host) -> None:
        start = taken(host)
        wait_for(lambda: taken(host) >= start + PROGRESS, f"ids taken on {host}", 60)

    for host in deployment.workers:
        goes_on(host)
    dead = deployment.workers[0]
    dead.kill()
    deployment.cluster.wait_healthy()  # its primary's replica, on another host, took over
    assert deployment.primaries_on(dead) == 0
    living = deployment.workers[1:]
    for host in living:
        goes_on(host)
    deployment.revive(dead)
    # A failover needs most primaries reachable: the host cut off holds one of three.
    [cut] = [host for host in living if deployment.primaries_on(host) == 1]
    [survivor] = [host for host in living if host is not cut]
    cut.partition()
    cut_at, before = time.monotonic(), taken(cut)
    goes_on(survivor)
    time.sleep(max(0.0, PARTITION - (time.monotonic() - cut_at)))
    cut.heal()
    wait_for(lambda: taken(cut) >= before + PROGRESS, f"{cut} to take ids again", 120)
    deployment.stop_writers()
    ids = acknowledged(tmp_path)
    assert len(set(ids)) == len(ids), "an id was handed out twice"
    print(f"ids {len(ids)}, failures {failures(tmp_path)}")
