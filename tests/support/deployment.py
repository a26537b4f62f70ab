"""A deployment over hosts, as the multi-host tests lay it out: four network namespaces
on a bridge of the test's own. Host 0 runs the store (a PostgreSQL cluster of the test's
own) and the Celery broker (a redis-server); hosts 1 to 3 run the writers and workers,
and a Redis Cluster of three primaries, each with its replica on another of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends import PREFIX, SUPPORT, wait_for
from host_work import acknowledged
from hosts import Host, Hosts
from servers import PostgresServer, RedisClusterServers, RedisServer


class Deployment:
    """What a deployment over hosts runs: ``store`` and ``broker`` on ``hosts[0]``, the
    ``cluster`` (the kits' cache) over ``workers`` (hosts 1 to 3)."""

    def __init__(self, hosts: Hosts, store: PostgresServer, broker: RedisServer) -> None:
        self.hosts, self.store, self.broker = hosts, store, broker
        self.workers = list(hosts)[1:]
        self.cluster = RedisClusterServers(3, 1, self.workers)

    @property
    def store_url(self) -> str:
        return self.store.url

    @property
    def cache_url(self) -> str:
        return self.cluster.url

    def revive(self, host: Host) -> None:
        """Bring a killed worker host back: its link, then its cache nodes (they rejoin
        as replicas); return once the cluster is whole again."""
        host.heal()
        for node in self.cluster.on(host):
            node.start()
        self.cluster.wait_healthy()

    def primaries_on(self, host: Host) -> int:
        """How many of the cache's primaries ``host`` holds now."""
        return sum(node.host is host for node in self.cluster.primaries())

    def writers(self, kind: str, name: str, directory: Path, threads: int = 4) -> None:
        """Start ``host_work.py`` on each worker host, writing the counter ``name``
        (``kind``) with ``threads`` threads and recording in ``directory``; return once
        every one is writing. ``stop_writers`` ends them."""
        self.directory = directory
        self.started: list[tuple[Host, subprocess.Popen[bytes], Path]] = []
        for host in self.workers:
            log = directory / f"{host.name}.log"
            argv = [sys.executable, str(SUPPORT / "host_work.py"), kind]
            argv += [self.store_url, self.cache_url, PREFIX, name, str(directory), str(threads)]
            with open(log, "wb") as out:
                process = subprocess.Popen(
                    host.command(argv),
                    env={**os.environ, "PYTHONPATH": str(SUPPORT)},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            self.started.append((host, process, log))
        for host, _, log in self.started:
            wait_for(lambda log=log: b"ready" in log.read_bytes(), f"writers on {host}", 60)

    def acked(self, host: Host | None = None) -> int:
        """The writes acknowledged so far (on ``host``'s writers)."""
        pids = [process.pid for each, process, _ in self.started if host in (None, each)]
        return sum(len(acknowledged(self.directory, pid)) for pid in pids)

    def goes_on(self, host: Host | None, more: int) -> None:
        """Wait until ``more`` writes were acknowledged (on ``host``) from now."""
        start = self.acked(host)
        where = f"on {host}" if host else "anywhere"
        wait_for(lambda: self.acked(host) >= start + more, f"{more} writes {where}", 60)

    def stop_writers(self) -> None:
        """Stop the writers (each finishes its write) and wait until they have exited."""
        (self.directory / "stop").touch()
        for host, process, log in self.started:
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()
            if process.returncode not in (0, -9):
                pytest.fail(
                    f"writers on {host} exited with {process.returncode}\n"
                    + log.read_text(errors="replace")[-3000:]
                )
