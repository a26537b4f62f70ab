"""Writes and a mapping job spread over 1, 2 and 3 hosts (network namespaces of this
machine, as the tests across hosts make them): the shape and the exactness, not absolute
speed (every host shares this machine's cores).

The deployment is the tests' (``tests/support/deployment.py``): PostgreSQL and a Redis
broker on one host, a Redis Cluster of three primaries (each with its replica on another
host) over three worker hosts. For each count of worker hosts, each round:

* sharded  - ``kit.sharded(name, shards=8).incr(1, key=…)`` from ``--threads`` threads
             of one process per host, for ``--seconds``; the stored value must equal the
             acknowledged writes;
* buffered - ``kit.buffered(name).incr()`` the same way; once flushed, the stored part
             must equal the acknowledged writes. With 3 hosts, the commands each cache
             primary ran (``INFO commandstats``) and their spread about the mean;
* map      - a transactional ``kit.map`` over ``--rows`` rows by Celery workers (one per
             host, one process each); every row must end +10 exactly once.

Rounds rotate the order of the host counts; the table gives medians and each round's
figure. Needs root, ``ip``, PostgreSQL's ``initdb``, ``redis-server`` and the test extra
(the harness is the tests'):

    sudo .venv/bin/python benchmarks/hosts.py --seconds 5 --rows 100000 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

import shardkit  # noqa: E402
from backends import PREFIX  # noqa: E402
from celery_app import build  # noqa: E402
from celery_workers import Workers  # noqa: E402
from deployment import Deployment, deployed  # noqa: E402
from hosts import Host  # noqa: E402
from servers import ClusterNode  # noqa: E402

Cell = dict[str, float]  # one round's figures of one (mode, hosts) cell


def commands(node: ClusterNode) -> int:
    """Commands a cache node has run (its statistics), this probe's excepted."""
    stats = node.client().info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k not in ("cmdstat_info",))


def writes(deployment: Deployment, kind: str, on: list[Host], seconds: float, threads: int) -> Cell:
    """Writes per second of ``kind`` from the hosts ``on``, checked exact."""
    name = f"bench:hosts:{kind}:{uuid.uuid4().hex}"
    primaries = deployment.cluster.primaries()
    with tempfile.TemporaryDirectory() as where:
        directory = Path(where)
        deployment.writers(kind, name, directory, threads, on)
        before = {node.port: commands(node) for node in primaries}
        start, started = deployment.acked(), time.perf_counter()
        time.sleep(seconds)
        done, elapsed = deployment.acked() - start, time.perf_counter() - started
        ran = {node.port: commands(node) - before[node.port] for node in primaries}
        deployment.stop_writers()
        acked = deployment.acked()
    with shardkit.connect(deployment.store_url, deployment.cache_url, prefix=PREFIX) as kit:
        if kind == "sharded":
            stored = kit.sharded(name).value(fresh=True)
        else:
            counter = kit.buffered(name)
            counter.flush()
            stored = counter.parts().stored
    if stored != acked:
        raise SystemExit(f"{kind} on {len(on)} hosts: stored {stored}, acknowledged {acked}")
    cell = {"rate": done / elapsed}
    if kind == "buffered" and len(on) == 3:
        mean = statistics.fmean(ran.values())
        cell["spread"] = max(abs(count - mean) for count in ran.values()) / mean
    return cell


class Job:
    """The mapping job's table and the Celery app and kit that run it."""

    def __init__(self, deployment: Deployment, rows: int, logs: Path) -> None:
        self.rows = rows
        self.table = deployment.job_table(rows)
        self.name = self.table.name
        self.config = deployment.celery_config("bench-hosts")
        self.records = redis.Redis.from_url(self.config.cache)
        self.logs = logs
        self.app, self.kit = build(self.config)

    def run(self, on: list[Host]) -> Cell:
        """Rows per second of the job with one worker on each host of ``on``, checked."""
        engine = self.kit.store.engine
        with engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE {self.name} SET balance = 0"))
            conn.execute(sa.text(f"DELETE FROM {self.name}_pages"))
        workers = Workers(self.config, self.records, self.logs)
        try:
            for host in on:
                workers.start(host=host, env={"SHARDKIT_HOSTS_TABLE": self.name})
            started = time.perf_counter()
            job = self.kit.map(self.table, "host_work:add_ten", transactional=True, page_size=500)
            status = job.wait(timeout=1800)
            elapsed = time.perf_counter() - started
        finally:
            workers.stop_all()
        with engine.connect() as conn:
            query = sa.select(self.table.c.balance, sa.func.count()).group_by(self.table.c.balance)
            balances = {int(b): int(n) for b, n in conn.execute(query)}
        if balances != {10: self.rows} or status.rows != self.rows:
            raise SystemExit(f"map on {len(on)} hosts: balances {balances}, rows {status.rows}")
        return {"rate": self.rows / elapsed}

    def close(self) -> None:
        self.kit.close()
        self.app.close()
        self.records.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="each writes cell's run")
    parser.add_argument("--threads", type=int, default=4, help="writer threads per host")
    parser.add_argument("--rows", type=int, default=100_000, help="the mapping job's rows")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (medians of them)")
    args = parser.parse_args()
    counts = [1, 2, 3]
    cells: dict[tuple[str, int], list[Cell]] = {}
    with tempfile.TemporaryDirectory() as logs, deployed() as deployment:
        mapping = Job(deployment, args.rows, Path(logs))
        modes: dict[str, Callable[[list[Host]], Cell]] = {
            "sharded": lambda on: writes(deployment, "sharded", on, args.seconds, args.threads),
            "buffered": lambda on: writes(deployment, "buffered", on, args.seconds, args.threads),
            "map": mapping.run,
        }
        try:
            for number in range(args.repeat):
                turn = number % len(counts)
                for count in counts[turn:] + counts[:turn]:
                    for mode, run in modes.items():
                        cell = run(deployment.workers[:count])
                        cells.setdefault((mode, count), []).append(cell)
                        print(f"round {number + 1}, {count} hosts, {mode}: {cell}", flush=True)
        finally:
            mapping.close()
    report(cells, counts, args)


def report(cells: dict[tuple[str, int], list[Cell]], counts: list[int], args: object) -> None:
    print(f"\n{time.strftime('%Y-%m-%d')}, {vars(args)}\n")
    print("| mode | hosts | median | vs 1 host | rounds |")
    print("| --- | --- | --- | --- | --- |")
    for mode in ("sharded", "buffered", "map"):
        unit = "rows/s" if mode == "map" else "writes/s"
        base = statistics.median(c["rate"] for c in cells[(mode, 1)])
        for count in counts:
            rates = [c["rate"] for c in cells[(mode, count)]]
            median = statistics.median(rates)
            each = ", ".join(f"{rate:,.0f}" for rate in rates)
            print(f"| {mode} | {count} | {median:,.0f} {unit} | {median / base:.2f}x | {each} |")
    spreads = [c["spread"] for c in cells[("buffered", 3)]]
    print(
        f"\nbuffered, 3 hosts: commands per cache primary within "
        f"{statistics.median(spreads):.1%} of their mean (rounds: "
        + ", ".join(f"{s:.1%}" for s in spreads)
        + ")"
    )


if __name__ == "__main__":
    main()
