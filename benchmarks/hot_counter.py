"""One hot counter hammered by many writer processes, five ways, side by side.

* naive      - ``UPDATE … SET n = n + 1`` on one row: raw driver, autocommit
* upsert     - raw driver upsert (``ON CONFLICT`` / ``ON DUPLICATE KEY``) on a random one of
               ``--shards`` rows of a table shaped like shardkit's shard table, autocommit
* sharded    - ``kit.sharded(name, shards).incr()``: a counter of ``--shards`` fixed shards
* auto       - ``kit.sharded(name).incr()``: an automatic counter, made with ``--shards``
               shards (grown), which its writers time and may grow further
* buffered   - ``kit.buffered(name, interval).incr()``: one cache round trip; the kit's
               executor flushes the cache's sums to the store every ``--interval`` seconds
* redis-incr - raw redis-py ``INCR`` on one key (only with a Redis ``--cache``): the
               baseline of the buffered counter
* sharded+metrics, buffered+metrics - the same, recording Prometheus metrics
               (``shardkit[metrics]``): what they cost. Only when named in ``--modes``.

The raw driver is the store's own: psycopg, PyMySQL or sqlite3. Every cell checks that
the counter moved by exactly the number of acknowledged writes (the buffered counter's
stored value, once flushed after the phase). For the buffered counter the benchmark also
counts the store writes its flushes made during the phase.

The writer processes are spawned (``--start spawn``: each imports what it runs, as
workers that import the application after they start) or forked from the benchmark
(``--start fork``: sharing the pages of what it imported, as workers forked from a
parent that imported the application, such as Celery's prefork pool or gunicorn's
``--preload``). The two can differ much: the dated results give both.

    python benchmarks/hot_counter.py --store postgresql://postgres@127.0.0.1:5432/test \\
        --cache redis://127.0.0.1:6379/12 --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

import shardkit
from harness import Crew, Op, Phase, Setup, forget_redis_keys, median_phase, ratio, run_grid
from shardkit import metrics
from shardkit.store.sql import SqlStore, engine_from_url, unprepare_behind_pooler

METERED = ("sharded+metrics", "buffered+metrics")
MODES = ("naive", "upsert", "sharded", "auto", "buffered", "redis-incr", *METERED)
KIT_MODES = ("sharded", "auto", "buffered", *METERED)
REDIS_SCHEMES = ("redis", "rediss", "unix")
# The targets: (mode, baseline, least ratio), at this many writer processes, of one
# thread each or of several. Against naive, a mode's ceiling on the machine is its raw
# counterpart's ratio to naive (the same one round trip, with no library around it).
CEILINGS = {"sharded": "upsert", "buffered": "redis-incr"}
TARGETS = {
    False: (
        16,
        (
            ("sharded", "naive", 3.0),
            ("sharded", "upsert", 1.2),
            ("auto", "sharded", 0.95),
            ("buffered", "naive", 10.0),
            ("buffered", "redis-incr", 1.1),
        ),
    ),
    True: (4, (("sharded", "upsert", 1.5), ("buffered", "redis-incr", 1.5))),
}
STORE_WRITES = ("statements", "advanced", "lost", "generations")
"""What the kits' store writes are: the sharded counter's shard writes (each carrying
the increments combined into it), the buffered counter's flushes' compare-and-sets that
advanced the store, ones that lost to another flush (a write that matched no row), and
new cache generations recorded."""


@dataclass(frozen=True)
class RawTarget:
    """What a raw-driver writer needs: the resolved URL and its tables."""

    url: str
    """SQLAlchemy URL naming the driver, password included."""
    naive_table: str
    shard_table: str
    name: str
    shards: int


@dataclass(frozen=True)
class KitTarget:
    """What a shardkit writer needs: the kit's URLs, the counter, and where to report."""

    kind: str
    """``sharded`` or ``buffered``."""
    metrics: bool
    """Whether the writer records Prometheus metrics."""
    store_url: str
    cache_url: str
    name: str
    prefix: str
    interval: float
    report_dir: str
    """Each writer leaves a JSON file here with the store writes its kit made."""
    stripes: int | None = None
    """A buffered counter's stripes (None: the cache's default)."""
    shards: int | None = None
    """A sharded counter's fixed shards (None: automatic)."""


@dataclass(frozen=True)
class RedisTarget:
    url: str
    key: str


def raw_connect(url: str) -> Any:
    """An autocommit DB-API connection of the store's own driver."""
    parsed = sa.make_url(url)
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        import psycopg

        conn = psycopg.connect(
            host=parsed.host or "localhost",
            port=parsed.port or 5432,
            user=parsed.username,
            password=parsed.password,
            dbname=parsed.database,
            autocommit=True,
        )
        unprepare_behind_pooler(conn)  # as a PgBouncer user must
        return conn
    if backend in ("mysql", "mariadb"):
        import pymysql

        return pymysql.connect(
            host=parsed.host or "localhost",
            port=parsed.port or 3306,
            user=parsed.username,
            password=parsed.password or "",
            database=parsed.database,
            autocommit=True,
        )
    # Set up in the process's main thread, written from one of its writing threads.
    return sqlite3.connect(
        parsed.database or "", timeout=60, isolation_level=None, check_same_thread=False
    )


def _is_mysql(url: str) -> bool:
    return sa.make_url(url).get_backend_name() in ("mysql", "mariadb")


@contextlib.contextmanager
def raw_naive(target: RawTarget) -> Iterator[Op]:
    """``UPDATE t SET n = n + 1`` on the one row."""
    conn = raw_connect(target.url)
    try:
        cursor = conn.cursor()
        cursor.execute(f"UPDATE {target.naive_table} SET n = n + 0 WHERE id = 1")
        sql = f"UPDATE {target.naive_table} SET n = n + 1 WHERE id = 1"
        yield lambda: cursor.execute(sql)
    finally:
        conn.close()


@contextlib.contextmanager
def raw_upsert(target: RawTarget) -> Iterator[Op]:
    """Add 1 to a random shard row, inserting it if missing, in one statement."""
    conn = raw_connect(target.url)
    table, shards = target.shard_table, target.shards
    name: str | bytes = target.name
    if _is_mysql(target.url):
        name = target.name.encode()  # shardkit's MySQL name column is VARBINARY
        sql = (
            f"INSERT INTO {table} (name, shard, value) VALUES (%s, %s, %s) "
            "ON DUPLICATE KEY UPDATE value = value + VALUES(value)"
        )
    else:
        mark = "?" if isinstance(conn, sqlite3.Connection) else "%s"
        sql = (
            f"INSERT INTO {table} (name, shard, value) VALUES ({mark}, {mark}, {mark}) "
            f"ON CONFLICT (name, shard) DO UPDATE SET value = {table}.value + excluded.value"
        )
    try:
        cursor = conn.cursor()
        cursor.execute(sql, (name, random.randrange(shards), 0))
        pick = random.randrange
        yield lambda: cursor.execute(sql, (name, pick(shards), 1))
    finally:
        conn.close()


class StoreWrites:
    """Counts the store writes a kit's counters make, by wrapping the store's
    ``add_many``, ``advance`` and ``add_generation`` on this one store object
    (benchmark-only)."""

    def __init__(self, store: Any) -> None:
        self.counts = dict.fromkeys(STORE_WRITES, 0)
        self._lock = threading.Lock()  # flushes run on the executor's threads
        add_many, advance, add_generation = store.add_many, store.advance, store.add_generation

        def counted_add_many(*args: Any, **kwargs: Any) -> list[bool]:
            self._count("statements")
            return list(add_many(*args, **kwargs))

        def counted_advance(*args: Any, **kwargs: Any) -> bool:
            advanced = bool(advance(*args, **kwargs))
            self._count("advanced" if advanced else "lost")
            return advanced

        def counted_add_generation(*args: Any, **kwargs: Any) -> None:
            add_generation(*args, **kwargs)
            self._count("generations")

        store.add_many = counted_add_many
        store.advance = counted_advance
        store.add_generation = counted_add_generation

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1


@contextlib.contextmanager
def kit_writer(target: KitTarget) -> Iterator[Op]:
    """``kit.sharded(name, shards).incr()`` or ``kit.buffered(name, interval).incr()``; on the way
    out, the kit's close runs the flush it has waiting, then the writer reports the
    store writes its kit made."""
    # The switch a user has: opening a kit records metrics unless it is off.
    os.environ["SHARDKIT_METRICS"] = "on" if target.metrics else "off"
    if target.metrics:
        metrics.enable()
    else:
        metrics.disable()
    with shardkit.connect(target.store_url, target.cache_url, prefix=target.prefix) as kit:
        writes = StoreWrites(kit.store)
        # Warm up both connections without counting, so that no flush is scheduled
        # before the phase: every flush counted is one the phase's increments caused.
        if target.kind == "sharded":
            sharded = kit.sharded(target.name, target.shards)
            sharded.value()
            yield sharded.incr
        else:
            buffered = kit.buffered(target.name, interval=target.interval, stripes=target.stripes)
            buffered.parts()
            yield buffered.incr
    report = Path(target.report_dir) / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    report.write_text(json.dumps(writes.counts))


def collect_store_writes(folder: Path) -> dict[str, int]:
    """Sum and remove the reports the buffered writers left in ``folder``."""
    totals = dict.fromkeys(STORE_WRITES, 0)
    for report in folder.glob("*.json"):
        for what, n in json.loads(report.read_text()).items():
            totals[what] += n
        report.unlink()
    return totals


def _redis_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_connect_timeout=5)


@contextlib.contextmanager
def redis_incr(target: RedisTarget) -> Iterator[Op]:
    """Raw redis-py ``INCR`` on one key."""
    client = _redis_client(target.url)
    try:
        client.incrby(target.key, 0)
        key, incr = target.key, client.incr
        yield lambda: incr(key)
    finally:
        client.close()


@dataclass
class Cell:
    """Repeated phases of one mode at one writer count."""

    phases: list[Phase]
    exact: bool = True
    writes: list[dict[str, int]] = field(default_factory=list)
    """The buffered writers' store writes, per phase."""

    @property
    def rate(self) -> float:
        return median_phase(self.phases)

    @property
    def cpu_per_op(self) -> float:
        """Median CPU seconds the writer processes spent per acknowledged write."""
        return statistics.median(phase.cpu_per_op for phase in self.phases)

    @property
    def write_rate(self) -> float:
        """Median store writes per second of a counter's phases: every write its kits
        made, over the phase's length (the writers' mean time writing)."""
        return statistics.median(
            sum(w.values()) / statistics.fmean(p.elapsed)
            for p, w in zip(self.phases, self.writes, strict=True)
        )


@dataclass(frozen=True)
class Mode:
    """How to run one mode and how to read the total its writes must move exactly."""

    setup: Setup[Any]
    arg: Any
    read: Callable[[], int]
    shared: bool = True
    """Whether a writer's threads share one setup (a kit), or each has its own (a raw
    driver connection)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", help="store URL (default: a temporary SQLite file)")
    parser.add_argument("--cache", default="memory://", help="cache URL (default memory://)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per cell (3)")
    parser.add_argument("--writers", default="1,4,16", help="writer process counts (1,4,16)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="writing threads per process (1); shardkit's share one kit, the raw "
        "baselines' each have a connection",
    )
    parser.add_argument(
        "--start",
        choices=("spawn", "fork"),
        default="spawn",
        help="how the writer processes start (spawn)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell; medians shown")
    parser.add_argument("--shards", type=int, default=20, help="shards (20)")
    parser.add_argument(
        "--interval", type=float, default=1.0, help="buffered counter's flush interval (1.0 s)"
    )
    parser.add_argument(
        "--modes",
        help=f"comma-separated, of {','.join(MODES)} (default: all that apply; "
        "redis-incr needs a Redis --cache)",
    )
    args = parser.parse_args(argv)
    args.writer_counts = [int(w) for w in args.writers.split(",")]
    if min(args.writer_counts) < 1 or min(args.repeat, args.threads) < 1 or not args.seconds > 0:
        parser.error("writers, --threads and --repeat must be >= 1, --seconds > 0")
    if not args.interval > 0:
        parser.error("--interval must be > 0")
    redis = args.cache.split(":", 1)[0].lower() in REDIS_SCHEMES
    default = [m for m in MODES if (redis or m != "redis-incr") and m not in METERED]
    args.modes = choose_modes(parser, args.modes, MODES, default)
    if "redis-incr" in args.modes and not redis:
        parser.error("redis-incr needs a Redis --cache (redis://, rediss:// or unix://)")
    return args


def choose_modes(
    parser: argparse.ArgumentParser, text: str | None, modes: Sequence[str], default: list[str]
) -> list[str]:
    """The modes a comma-separated ``--modes`` names, in ``modes``' order (``default``
    without it); a usage error for an unknown mode, or for none."""
    chosen = default
    if text is not None:
        wanted = {m.strip() for m in text.split(",") if m.strip()}
        if unknown := wanted - set(modes):
            parser.error(f"unknown modes {', '.join(sorted(unknown))}; choose from {modes}")
        chosen = [m for m in modes if m in wanted]
    if not chosen:
        parser.error("no modes selected")
    return chosen


def report_console(width: int = 120) -> Console:
    """A console wide enough for the results table when the output is not a terminal
    (a log file, a pipe)."""
    return Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else width)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console()
    tag = uuid.uuid4().hex[:8]
    prefix = f"skbench{tag}_"
    modes: list[str] = args.modes
    with contextlib.ExitStack() as stack:
        store_url: str = args.store or ""
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shardkit-bench-")))
        if not store_url:
            store_url = f"sqlite:///{scratch / 'bench.db'}"
        reports = scratch / "store-writes"
        reports.mkdir()
        kit = shardkit.connect(store_url, args.cache, prefix=prefix)
        store = kit.store
        assert isinstance(store, SqlStore)
        engine = engine_from_url(store_url)
        stack.callback(engine.dispose)
        stack.callback(store.metadata.drop_all, engine)
        stack.callback(kit.close)  # first: it saves what it holds into the tables
        md = sa.MetaData()
        naive = sa.Table(  # one row: a hot counter without sharding
            f"{prefix}naive",
            md,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("n", sa.BigInteger, nullable=False),
        )
        shard = sa.Table(  # the shape of shardkit's shard table
            f"{prefix}raw",
            md,
            *(
                sa.Column(c.name, c.type, primary_key=c.primary_key, autoincrement=False)
                for c in store.shards_table.columns
            ),
        )
        stack.callback(md.drop_all, engine)
        md.create_all(engine)
        with engine.begin() as conn:
            conn.execute(naive.insert().values(id=1, n=0))

        raw = RawTarget(
            url=engine.url.render_as_string(hide_password=False),
            naive_table=f"{prefix}naive",
            shard_table=f"{prefix}raw",
            name="hot",
            shards=args.shards,
        )
        kit.sharded("hot", shards=args.shards)
        kit.sharded("hot-auto", shards=args.shards)  # grown: its writers open it automatic
        buffered = kit.buffered("hot-buffered", interval=args.interval)

        def read_naive() -> int:
            with engine.connect() as conn:
                return int(conn.execute(sa.select(naive.c.n)).scalar_one())

        def read_upsert() -> int:
            with engine.connect() as conn:
                return int(conn.execute(sa.select(sa.func.sum(shard.c.value))).scalar() or 0)

        def read_buffered() -> int:
            buffered.flush()  # what the writers' kits left pending in a shared cache
            return buffered.parts().stored

        runs: dict[str, Mode] = {
            "naive": Mode(raw_naive, raw, read_naive, shared=False),
            "upsert": Mode(raw_upsert, raw, read_upsert, shared=False),
        }
        for metered in (False, True):
            suffix = "+metrics" if metered else ""
            runs["sharded" + suffix] = Mode(
                kit_writer,
                KitTarget(
                    "sharded",
                    metered,
                    store_url,
                    args.cache,
                    "hot",
                    prefix,
                    0,
                    str(reports),
                    shards=args.shards,
                ),
                lambda: store.total("hot"),
            )
            runs["buffered" + suffix] = Mode(
                kit_writer,
                KitTarget(
                    "buffered",
                    metered,
                    store_url,
                    args.cache,
                    buffered.name,
                    prefix,
                    args.interval,
                    str(reports),
                ),
                read_buffered,
            )
        runs["auto"] = Mode(
            kit_writer,
            KitTarget("sharded", False, store_url, args.cache, "hot-auto", prefix, 0, str(reports)),
            lambda: store.total("hot-auto"),
        )
        if args.cache.split(":", 1)[0].lower() in REDIS_SCHEMES:
            client = _redis_client(args.cache)
            stack.callback(client.close)
            stack.callback(forget_redis_keys, client, kit.namespace, f"{prefix}incr")
            runs["redis-incr"] = Mode(
                redis_incr,
                RedisTarget(args.cache, f"{prefix}incr"),
                lambda: int(client.get(f"{prefix}incr") or 0),
                shared=False,
            )
        console.print(
            f"store [cyan]{store.url}[/], cache [cyan]{kit.cache.url}[/], "
            f"{args.seconds:g} s per run, {args.repeat} run(s) per cell, "
            f"{args.threads} thread(s) per writer ({args.start}), {args.shards} shards, "
            f"buffered flush interval {args.interval:g} s; modes {', '.join(modes)}"
        )
        cells: dict[tuple[int, str], Cell] = {}

        def measure(crew: Crew, writers: int, mode: str) -> None:
            cell = cells.setdefault((writers, mode), Cell([]))
            spec = runs[mode]
            before = spec.read()
            phase = crew.run(spec.setup, spec.arg, args.seconds, shared=spec.shared)
            moved = spec.read() - before
            cell.phases.append(phase)
            cell.exact = cell.exact and moved == phase.ops
            if mode in KIT_MODES:
                cell.writes.append(collect_store_writes(reports))

        run_grid(args.writer_counts, args.repeat, modes, measure, console, args.threads, args.start)
        console.print(results_table(cells, args.writer_counts, modes, args.repeat))
        console.print(targets_summary(cells, args.writer_counts, modes, args.threads))
        if "buffered" in modes:
            console.print(store_writes_table(cells, args.writer_counts, args.interval))
            if kit.cache.url == "memory://":
                console.print(
                    "[dim]memory:// is a cache per process: each buffered writer counts in "
                    "its own dict and flushes its own generation, so its ops/s is no "
                    "cross-process figure; use a Redis --cache for that.[/]"
                )
    if all(cell.exact for cell in cells.values()):
        return 0
    console.print("[red]a total differed from the acknowledged writes[/]")
    return 1


def results_table(
    cells: dict[tuple[int, str], Cell], counts: list[int], modes: list[str], repeat: int
) -> Table:
    table = Table(title="One hot counter: acknowledged increments per second")
    bases = [m for m in ("naive", "upsert", "redis-incr") if m in modes]
    columns = [
        "writers",
        "mode",
        "ops/s",
        *(f"vs {b}" for b in bases),
        "client CPU µs/write",
        "store writes/s",
    ]
    for column in [*columns, "exact"]:
        table.add_column(column, justify="left" if column == "mode" else "right")
    if repeat > 1:
        table.add_column("runs (ops/s)", justify="left")
    for writers in counts:
        for mode in modes:
            cell = cells[writers, mode]
            if mode in KIT_MODES:  # counted: combined, or flushes
                writes = f"{cell.write_rate:,.1f}"
            elif mode == "redis-incr":
                writes = "0"
            else:  # every acknowledged increment is one store write
                writes = f"{cell.rate:,.0f}"
            row = [
                str(writers),
                mode,
                f"{cell.rate:,.0f}",
                *(ratio(cells, writers, mode, b) for b in bases),
                f"{cell.cpu_per_op * 1e6:,.1f}",
                writes,
                "[green]✓[/]" if cell.exact else "[red]✗[/]",
            ]
            if repeat > 1:
                row.append(" ".join(f"{p.rate:,.0f}" for p in cell.phases))
            table.add_row(*row, end_section=mode == modes[-1])
    return table


def store_writes_table(
    cells: dict[tuple[int, str], Cell], counts: list[int], interval: float
) -> Table:
    """What the buffered counter's store writes were, summed over a cell's runs."""
    table = Table(
        title=f"Buffered counter ({interval:g} s interval): store writes by the writers' kits"
    )
    columns = ("writers", "seconds", "advanced", "lost CAS", "new generations", "writes/s")
    for column in columns:
        table.add_column(column, justify="right")
    flushes = STORE_WRITES[1:]  # a buffered counter makes no shard writes
    for writers in counts:
        cell = cells[writers, "buffered"]
        seconds = sum(statistics.fmean(p.elapsed) for p in cell.phases)
        total = {what: sum(w[what] for w in cell.writes) for what in flushes}
        table.add_row(
            str(writers),
            f"{seconds:.1f}",
            *(f"{total[what]:,}" for what in flushes),
            f"{cell.write_rate:,.1f}",
        )
    return table


def targets_summary(
    cells: dict[tuple[int, str], Cell], counts: list[int], modes: list[str], threads: int
) -> str:
    """Each measured mode against its targets, at the writer count they are set for (or
    the most run)."""
    target_writers, targets = TARGETS[threads > 1]
    writers = target_writers if target_writers in counts else max(counts)
    parts = []
    for mode, base, least in targets:
        if mode not in modes or base not in modes:
            continue
        ratio = cells[writers, mode].rate / cells[writers, base].rate
        mark = "[green]✓[/]" if ratio >= least else "[red]✗[/]"
        line = f"{mode} ÷ {base} {ratio:.2f}x (target ≥ {least:g}x) {mark}"
        raw = CEILINGS.get(mode, "")
        if base == "naive" and raw in modes:
            ceiling = cells[writers, raw].rate / cells[writers, base].rate
            line += f"; this machine's ceiling, {raw} ÷ {base}: {ceiling:.2f}x"
        parts.append(line)
    if not parts:
        return "targets: run the baselines (naive, upsert, redis-incr) beside the counters"
    shape = f"{writers} writers" + (f" x {threads} threads" if threads > 1 else "")
    note = "" if writers == target_writers else f" (targets are for {target_writers} writers)"
    return f"targets at {shape}{note}:\n  " + "\n  ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
