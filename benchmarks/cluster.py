"""One hot buffered counter, many writer processes, on one Redis server and on a Redis
Cluster, side by side: increments per second, the ``INCRBY`` commands each server ran
(``INFO commandstats``) and how far the busiest and idlest primary are from their mean.

* redis    - ``kit.buffered(name).incr()`` with ``--redis`` (one server) as the cache
* cluster  - the same on the cluster with ``stripes=1``: every increment goes to the
             primary that holds the counter's one generation
* striped  - the same with one stripe per primary (the cluster's default)

Each cell checks that the store holds exactly the acknowledged increments once flushed.
The cluster is started by the run (``--primaries`` redis-servers, no replicas, on free
loopback ports, removed at the end) unless ``--cluster URL`` names one.

    python benchmarks/cluster.py --store postgresql://postgres@127.0.0.1:5432/test \\
        --writers 16 --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import redis
from rich.table import Table

import shardkit
from harness import Crew, Phase
from hot_counter import KitTarget, choose_modes, kit_writer, report_console
from shardkit.cache.cluster import RedisClusterCache
from shardkit.store.sql import SqlStore

MODES = ("redis", "cluster", "striped")


@contextlib.contextmanager
def throwaway_cluster(primaries: int, folder: Path) -> Iterator[str]:
    """A Redis Cluster of ``primaries`` redis-servers (no persistence, no replicas)."""
    ports: list[int] = []
    while len(ports) < primaries:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port <= 55535 and port not in ports:  # its bus listens on port + 10000
            ports.append(port)
    servers = []
    try:
        for port in ports:
            (folder / str(port)).mkdir()
            command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
            command += ["--cluster-enabled", "yes", "--save", "", "--appendonly", "no"]
            command += ["--dir", str(folder / str(port))]
            servers.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
        for port in ports:
            wait(lambda port=port: _answers(port), f"redis-server on {port}")
        create = ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports)]
        subprocess.run([*create, "--cluster-yes"], check=True, capture_output=True)
        wait(lambda: all(_cluster_ok(p) for p in ports), "the cluster to serve every slot")
        yield "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    finally:
        for server in servers:
            server.kill()
            server.wait()


def wait(condition: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def _cluster_ok(port: int) -> bool:
    with redis.Redis(port=port) as client:
        return client.cluster("INFO").get("cluster_state") == "ok"  # type: ignore[no-any-return]


def incrbys(servers: list[tuple[str, int]]) -> list[int]:
    """``INCRBY`` commands each server has run so far."""
    counts = []
    for host, port in servers:
        with redis.Redis(host=host, port=port) as client:
            stats = client.info("commandstats").get("cmdstat_incrby", {"calls": 0})
        counts.append(int(stats["calls"]))
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", help="store URL (default: a temporary SQLite file)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/12", help="one server")
    parser.add_argument("--cluster", help="a cluster's redis+cluster:// URL (default: start one)")
    parser.add_argument("--primaries", type=int, default=3, help="primaries to start (3)")
    parser.add_argument("--writers", type=int, default=16, help="writer processes (16)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per run (3)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell; medians shown")
    parser.add_argument("--modes", help=f"comma-separated, of {','.join(MODES)} (default all)")
    args = parser.parse_args(argv)
    if min(args.writers, args.repeat, args.primaries) < 1 or not args.seconds > 0:
        parser.error("--writers, --repeat and --primaries must be >= 1, --seconds > 0")
    args.modes = choose_modes(parser, args.modes, MODES, list(MODES))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console()
    if not args.cluster and not shutil.which("redis-cli"):
        raise SystemExit("redis-server and redis-cli are needed to start a cluster")
    prefix = f"skcluster{uuid.uuid4().hex[:8]}_"
    name = "hot"
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shardkit-")))
        store = args.store or f"sqlite:///{scratch / 'bench.db'}"
        cluster = args.cluster or stack.enter_context(throwaway_cluster(args.primaries, scratch))
        kits = {url: stack.enter_context(shardkit.connect(store, url, prefix=prefix))
                for url in (args.redis, cluster)}  # fmt: skip
        tables = kits[args.redis].store
        assert isinstance(tables, SqlStore)
        stack.callback(tables.metadata.drop_all, tables.engine)
        cache = kits[cluster].cache
        assert isinstance(cache, RedisClusterCache), f"{cluster} is not a Redis Cluster"
        owners = [owner.rpartition(":") for owner in cache.owners()]
        primaries = [(host, int(port)) for host, _, port in owners]
        single = urlsplit(args.redis)
        where = {
            "redis": [(single.hostname or "127.0.0.1", single.port or 6379)],
            "cluster": primaries,
            "striped": primaries,
        }
        reports = scratch / "reports"
        reports.mkdir()
        cells: dict[str, list[tuple[Phase, list[int], bool]]] = {mode: [] for mode in args.modes}
        console.print(
            f"store [cyan]{kits[args.redis].store.url}[/], one server [cyan]{args.redis}[/], "
            f"cluster [cyan]{cluster}[/] ({len(primaries)} primaries); {args.writers} writer "
            f"processes, {args.seconds:g} s per run, {args.repeat} run(s) per cell"
        )
        with Crew(args.writers) as crew:
            for number in range(args.repeat):
                for mode in args.modes:
                    url = args.redis if mode == "redis" else cluster
                    counter = f"{name}:{mode}"
                    stripes = 1 if mode == "cluster" else None
                    target = KitTarget(
                        "buffered", False, store, url, counter, prefix, 3600.0, str(reports),
                        stripes,
                    )  # fmt: skip
                    reader = kits[url].buffered(counter, interval=3600, stripes=stripes)
                    before, commands = reader.parts().total, incrbys(where[mode])
                    with console.status(f"{mode}, run {number + 1}…"):
                        phase = crew.run(kit_writer, target, args.seconds)
                    spread = [b - a for a, b in zip(commands, incrbys(where[mode]), strict=True)]
                    reader.flush()
                    exact = reader.parts() == (before + phase.ops, 0)
                    cells[mode].append((phase, spread, exact))
                    for report in reports.iterdir():
                        report.unlink()
    console.print(results(cells, args.repeat))
    return 0 if all(exact for runs in cells.values() for *_, exact in runs) else 1


def results(cells: dict[str, list[tuple[Phase, list[int], bool]]], repeat: int) -> Table:
    table = Table(title="One hot buffered counter: increments per second, INCRBY per server")
    for column in ("mode", "ops/s", "vs redis", "INCRBY per server", "±max from mean", "exact"):
        table.add_column(
            column, justify="left" if column in ("mode", "INCRBY per server") else "right"
        )
    base = statistics.median(p.rate for p, *_ in cells["redis"]) if "redis" in cells else None
    for mode, runs in cells.items():
        rate = statistics.median(phase.rate for phase, *_ in runs)
        spread = [sum(run[1][i] for run in runs) for i in range(len(runs[0][1]))]
        mean = sum(spread) / len(spread)
        worst = max(abs(count - mean) for count in spread) / mean if mean else 0.0
        table.add_row(
            mode,
            f"{rate:,.0f}",
            f"{rate / base:.2f}x" if base else "-",
            " ".join(f"{count:,}" for count in spread),
            f"{100 * worst:.0f} %",
            "[green]✓[/]" if all(exact for *_, exact in runs) else "[red]✗[/]",
        )
    return table


if __name__ == "__main__":
    sys.exit(main())
