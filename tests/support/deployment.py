"""A deployment over hosts, as the multi-host tests lay it out: four network namespaces
on a bridge of the test's own. Host 0 runs the store (a PostgreSQL cluster of the test's
own) and the Celery broker (a redis-server); hosts 1 to 3 run the writers and workers,
and a Redis Cluster of three primaries, each with its replica on another of them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from backends import PREFIX, SUPPORT, Samples, parse_samples, sample, scrape, wait_for
from celery_app import Config
from host_work import Call, acknowledged_count, calls
from hosts import Host, Hosts
from servers import PostgresServer, RedisClusterServers, RedisServer, running

METRICS_PORT = 9464  # where writers serve their metrics, on their host's address


@dataclass(frozen=True)
class Cut:
    """When a host was cut off and joined again, by ``time.monotonic()`` (one clock for
    every process of the machine): the link went down between ``cutting`` and ``cut``,
    and up between ``healing`` and ``healed``."""

    cutting: float
    cut: float
    healing: float
    healed: float

    def phase(self, call: Call) -> str:
        """Where ``call`` lies: ``before`` the cut (it returned before it), ``during`` it
        (begun once the host was cut off, returned before it joined again), ``after``
        (begun once it had joined again), or ``across`` the cut or the heal."""
        if call.ended < self.cutting:
            return "before"
        if self.cut < call.began and call.ended < self.healing:
            return "during"
        if self.healed < call.began:
            return "after"
        return "across"


class Deployment:
    """What a deployment over hosts runs: ``store`` and ``broker`` on ``hosts[0]``, the
    ``cluster`` (the kits' cache) over ``workers`` (hosts 1 to 3). ``close()`` ends the
    processes it started on the hosts (writers, dashboards) and the cluster."""

    def __init__(self, hosts: Hosts, store: PostgresServer, broker: RedisServer) -> None:
        self.hosts, self.store, self.broker = hosts, store, broker
        self.workers = list(hosts)[1:]
        self.cluster = RedisClusterServers(3, 1, self.workers)
        self.directory = Path()
        self.started: list[tuple[Host, subprocess.Popen[bytes], Path]] = []  # writers
        self.processes: list[subprocess.Popen[bytes]] = []  # every one it started

    def start(self) -> None:
        self.cluster.start()

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        self.cluster.close()

    def run(
        self, host: Host, argv: list[str], log: Path, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (with ``env`` added to its environment, and this
        directory importable ahead of this process's ``PYTHONPATH``), its output in
        ``log``."""
        path = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))
        with open(log, "wb") as out:
            process = subprocess.Popen(
                host.command(argv),
                env={**os.environ, "PYTHONPATH": path, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.processes.append(process)
        return process

    @property
    def store_url(self) -> str:
        return self.store.url

    def celery_config(self, tag: str) -> Config:
        """The configuration of Celery workers and kits on this deployment: the broker's
        database 0, the kits' cache and the workers' records in its database 1 (a queue
        and records of their own, named after ``tag``)."""
        broker, run = self.broker.url, uuid.uuid4().hex[:12]
        return Config(
            store=self.store_url,
            cache=broker.removesuffix("/0") + "/1",
            prefix=PREFIX,
            broker=broker,
            queue=f"shardkit-{tag}-{run}",
            record=f"shardkit-test:{tag}:{run}",
        )

    def job_table(self, rows: int) -> sa.Table:
        """A source table for ``host_work:add_ten``, on the store: keys ``k`` 1 … ``rows``,
        ``balance`` 0, and its ``_pages`` record."""
        metadata = sa.MetaData()
        name = f"{PREFIX}hosts_{uuid.uuid4().hex[:8]}"
        source = sa.Table(
            name,
            metadata,
            sa.Column("k", sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("balance", sa.Integer, nullable=False),
        )
        sa.Table(
            f"{name}_pages",
            metadata,
            sa.Column("host", sa.Text, nullable=False),
            sa.Column("first", sa.BigInteger, nullable=False),
            sa.Column("size", sa.Integer, nullable=False),
        )
        engine = sa.create_engine(self.store_url)
        metadata.create_all(engine)
        insert = f"INSERT INTO {name} (k, balance) SELECT g, 0 FROM generate_series(1, :n) g"
        with engine.begin() as conn:
            conn.execute(sa.text(insert), {"n": rows})
        engine.dispose()
        return source

    @property
    def cache_url(self) -> str:
        return self.cluster.url

    def primaries_on(self, host: Host) -> int:
        """How many of the cache's primaries ``host`` holds now."""
        return sum(node.host is host for node in self.cluster.primaries())

    def writers(
        self,
        kind: str,
        name: str,
        directory: Path,
        threads: int = 4,
        on: Sequence[Host] | None = None,
    ) -> None:
        """Start ``host_work.py`` on each worker host (or each of ``on``), writing the
        counter ``name`` (``kind``) with ``threads`` threads and recording in
        ``directory``; return once every one is writing. ``stop_writers`` ends them."""
        self.directory = directory
        self.started = []
        for host in self.workers if on is None else on:
            log = directory / f"{host.name}.log"
            argv = [sys.executable, str(SUPPORT / "host_work.py"), kind]
            argv += [self.store_url, self.cache_url, PREFIX, name, str(directory), str(threads)]
            metrics = {"SHARDKIT_HOSTS_METRICS": f"{host.address}:{METRICS_PORT}"}
            self.started.append((host, self.run(host, argv, log, metrics), log))
        for host, _, log in self.started:
            wait_for(lambda log=log: b"ready" in log.read_bytes(), f"writers on {host}", 60)

    def acked(self, host: Host | None = None) -> int:
        """The writes acknowledged so far (on ``host``'s writers)."""
        pids = [process.pid for each, process, _ in self.started if host in (None, each)]
        return sum(acknowledged_count(self.directory, pid) for pid in pids)

    def pid(self, host: Host) -> int:
        """The process id of ``host``'s writers."""
        [pid] = [process.pid for each, process, _ in self.started if each is host]
        return pid

    def calls(self, host: Host) -> list[Call]:
        """The acknowledged calls of ``host``'s writers."""
        return [call for made in calls(self.directory, self.pid(host)).values() for call in made]

    def cut_off(self, victim: Host, seconds: float, progress: int) -> Cut:
        """Cut ``victim`` off for ``seconds``, and at least until the writers of each
        other host have had ``progress`` more writes acknowledged; then join it again."""
        cutting = time.monotonic()
        victim.partition()
        cut = time.monotonic()
        for host, _, _ in self.started:
            if host is not victim:
                self.goes_on(host, progress)
        time.sleep(max(0.0, seconds - (time.monotonic() - cut)))
        healing = time.monotonic()
        victim.heal()
        return Cut(cutting, cut, healing, time.monotonic())

    def goes_on(self, host: Host | None, more: int) -> None:
        """Wait until ``more`` writes were acknowledged (on ``host``) from now."""
        start = self.acked(host)
        where = f"on {host}" if host else "anywhere"
        wait_for(lambda: self.acked(host) >= start + more, f"{more} writes {where}", 60)

    def metrics(self, host: Host, *, within: bool = False) -> Samples:
        """The metrics the writers on ``host`` serve now: read from the test's process,
        or from inside ``host`` (``within``: while it is cut off)."""
        url = f"http://{host.address}:{METRICS_PORT}/metrics"
        if not within:
            return scrape(url)
        read = f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
        done = subprocess.run(
            host.command([sys.executable, "-c", read]), capture_output=True, timeout=60, check=True
        )
        return parse_samples(done.stdout.decode())

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


class Dashboard:
    """``shardkit dashboard`` run on ``host`` against the deployment's store and cache
    (ended with the deployment)."""

    PORT = 8050

    def __init__(self, deployment: Deployment, host: Host, logs: Path) -> None:
        self.url = f"http://{host.address}:{self.PORT}"
        argv = [sys.executable, "-m", "shardkit", "--store", deployment.store_url]
        argv += ["--cache", deployment.cache_url, "--prefix", PREFIX, "dashboard"]
        argv += ["--host", host.address, "--port", str(self.PORT)]
        self.process = deployment.run(host, argv, logs / f"dashboard-{host.name}.log")
        wait_for(self._answers, f"the dashboard on {host}", 60)

    def _answers(self) -> bool:
        if self.process.poll() is not None:
            pytest.fail(f"the dashboard exited with {self.process.returncode}")
        try:
            self.get("/api/info")
        except OSError:
            return False
        return True

    def get(self, path: str) -> Any:
        """The JSON the dashboard answers at ``path``."""
        with urllib.request.urlopen(self.url + path, timeout=60) as response:
            return json.load(response)

    def metric(self, name: str, **labels: str) -> float:
        """The value of the sample ``name`` with ``labels`` on the dashboard's /metrics."""
        return sample(scrape(self.url + "/metrics"), name, **labels)


@contextlib.contextmanager
def deployed() -> Iterator[Deployment]:
    """Four hosts, the store and the broker on the first, the cache cluster over the
    others: removed when the block exits, however."""
    with running(Hosts, 4) as hosts:
        store = PostgresServer().placed(hosts[0], 5432)
        broker = RedisServer().placed(hosts[0], 6379)
        with (
            running(lambda: store),
            running(lambda: broker),
            running(Deployment, hosts, store, broker) as deployment,
        ):
            yield deployment
