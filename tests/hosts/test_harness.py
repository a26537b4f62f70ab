"""The multi-host harness itself: hosts reach each other until one is partitioned or
killed, a killed host keeps no process, and the Redis Cluster spreads over the hosts
with every replica on another host than its primary."""

from __future__ import annotations

import signal

import pytest
import redis

from backends import wait_for
from deployment import Deployment

pytestmark = pytest.mark.slow


def test_a_partitioned_host_is_cut_off_until_healed(deployment: Deployment) -> None:
    one, two, _ = deployment.workers
    store = deployment.store
    assert one.reaches(store.address, store.port)
    one.partition()
    assert not one.reaches(store.address, store.port)
    assert two.reaches(store.address, store.port)
    one.heal()  # the first connection after it may take a moment on a loaded machine
    wait_for(lambda: one.reaches(store.address, store.port), "the healed host's link", 30)


def test_the_cluster_keeps_each_replica_on_another_host(deployment: Deployment) -> None:
    cluster = deployment.cluster
    primaries = cluster.primaries()
    assert sorted(node.address for node in primaries) == sorted(
        h.address for h in deployment.workers
    )
    for primary in primaries:
        client = redis.Redis(primary.address, primary.port)
        replicas = client.info("replication")
        client.close()
        assert replicas["connected_slaves"] == 1
        assert replicas["slave0"]["ip"] != primary.address


def test_a_killed_host_keeps_no_process_and_its_primary_fails_over(
    deployment: Deployment,
) -> None:
    cluster = deployment.cluster
    victim = deployment.workers[0]
    nodes = cluster.on(victim)
    assert len(nodes) == 2
    victim.kill()
    for node in nodes:  # gone from the host at once, each ends (exiting may take a moment)
        assert node.process is not None
        assert node.process.wait(timeout=30) == -signal.SIGKILL
    cluster.wait_healthy()
    assert victim.address not in {node.address for node in cluster.primaries()}
