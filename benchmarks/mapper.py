"""Visit every row of a big PostgreSQL table: ``kit.map`` against the loops it replaces.

Every mode does the same work for each page of ``--page-size`` rows, in one transaction
per page: read the page in key order, run ``fn`` on it, commit. With ``--fn update`` (the
default) ``fn`` is ``UPDATE <table> SET balance = balance + 1 WHERE id = ANY(<the page's
ids>)`` followed by ``--io-wait`` seconds of sleep (a function that waits on I/O: an API
call, a file); with ``--fn noop`` it does nothing, which leaves what finding the pages
costs.

* shardkit - ``kit.map(table, fn, transactional=True, page_size=…, fanout=…)`` on a
             ``LocalExecutor(workers=…)``; ``fn`` takes the page's ids from ``batch.records``
             (``row.id``; with ``--batch rows``, ``batch.rows``: ``row["id"]``) and
             writes through ``batch.conn``, so each
             page's update commits with its checkpoint (with ``--at-least-once``, the
             default ``transactional=False``: ``fn`` runs its update in a transaction of
             its own, on a connection of the kit's pool, and the page is read and
             checkpointed outside any transaction). The kit's connections (its pool
             keeps one per worker) are opened before the clock starts (the loops' are
             open too); ``job.wait`` wakes when the job completes, so its end is timed
             as it happens
* fixed    - the split written by hand: read ``min(id)`` and ``max(id)``, cut that span
             into ``--workers`` equal key ranges (integer arithmetic; strings are
             interpolated between min and max as numbers whose digits are code points,
             and the cut points sorted by the database: ``SELECT unnest(CAST(:points AS
             text[])) ORDER BY 1``), and walk each range with a keyset loop in a thread
             and connection of its own. Its time includes reading min and max
* balanced - the same threads, cut where each range holds the same number of rows (the
             keys' quantiles, ``percentile_disc``, read before the clock starts): a split
             no user has without sorting every key first, and so the ceiling of any split
             of the table into ``--workers`` ranges on this machine
* keyset   - one loop: ``SELECT … WHERE id > :last ORDER BY id LIMIT :page``, the work
* offset   - one loop: ``SELECT … ORDER BY id LIMIT :page OFFSET :offset``, the work;
             stopped after ``--offset-seconds`` and extrapolated to the whole table (not
             run unless named in ``--modes``)

Each kind of key (``--keys``) has a table of its own, ``(id <key> primary key, balance
bigint)``, made with ``INSERT … SELECT generate_series`` and reused when it holds exactly
``--rows`` rows of that kind (a table comment names the kind and the count). Rows are
inserted in key order, with ``fillfactor = 50`` so that updates mostly stay on their page
(HOT) and the order holds over runs: ``fn``'s ``UPDATE`` of a page is then an index scan
in every mode (string keys in random heap order made PostgreSQL scan the whole table
for some of those updates; on a table of a few tens of thousands of rows it still does):

* sequential - ``bench_accounts``: ids 1…N
* skewed     - ``bench_skewed``: 90 % of the rows at ids 1…0.9·N, the other 10 % evenly
               spread over the 100·N ids above them (every ≈ 1000th id)
* string     - ``bench_names``: ``md5(g::text)`` for g = 1…N, in the database's collation
* sparse     - ``bench_sparse``: ids 1000, 2000, … 1000·N
* clustered  - ``bench_clustered``: blocks of 10,000 consecutive ids, 10⁹ apart
* composite  - ``bench_tenants``: the key ``(tenant, id)``, 4 tenants of N/4 ids each (``id``
               unique too: the loops written by hand walk it, ``fn`` updates by it)
* prefixed   - ``bench_prefixed``: ``'customer/eu-west-1/account/'`` and g = 1…N in 10 digits

The first three run by default; ``--keys`` names others.

Extrapolating ``offset``: PostgreSQL reads and throws away the ``offset`` rows before a
page, so reading page i costs ``a + b·i``, growing linearly with its number; the rest of
a page (fn, commit) does not depend on where it is. The mode times both parts of each
page it visits before the time limit, fits the reads to ``a + b·i`` (least squares on the
medians of 40 runs of consecutive pages, so that pages slowed by other work on the
machine do not tilt the line) and averages the rest to ``r``; the pages it did not reach
(i = k … N - 1) are added as ``sum(a + b·i + r)``. The total is the measured time plus
that sum, marked ``≈`` and printed with the fit. A run that reaches the end of the table
in time is reported as measured.

The table is vacuumed before each mode, so no mode pays for the dead rows of the one
before. Each mode is checked: with ``--fn update``, ``sum(balance)`` moved by exactly the
rows it visited and, against a copy of the balances taken before it, those rows each rose
by exactly 1 and no other row changed; with ``--fn noop``, no balance changed. Every
mode but ``offset`` must visit every row.

Per mode: seconds, rows/s and their ratio to ``keyset`` and ``fixed``; the CPU seconds of
this process (all its threads) over the same span, and their ratio to ``fixed``'s; the
whole machine's CPU seconds over it (``/proc/stat``: the database's work shows there); and
the tuples PostgreSQL read from the table per row visited: ``seq_tup_read +
idx_tup_fetch`` of ``pg_stat_user_tables``, read before and after the run; next to it the
entries read from the table's indexes per row (``idx_tup_read`` of
``pg_stat_user_indexes``), which counts index-only scans too (keys read alone, which
``idx_tup_fetch`` does not count), and the index blocks it touched per 1,000 rows
(``idx_blks_hit + idx_blks_read`` of ``pg_statio_user_indexes``: entries an index scan
walks past without returning them show there only). A backend reports its counts when
it goes idle, at most once a second (up to 10 s later if it stays idle), and at exit, so
they are read with every connection that touched the table closed (the checks' before
the run, the mode's after it), polled until two reads 0.5 s apart agree. ``fn``'s ``UPDATE`` fetches
each row once by index, so with ``--fn update`` both figures include 1.0 per row of
``fn``'s own. For ``shardkit``: the depth of its range tree (``status.depth``), its pages,
and its ranges (ledger rows) per million rows.

``--memory`` adds a second, traced run of the job: the peak of memory allocated by this
process while it ran (``tracemalloc``, all threads), next to what ``--page-size`` x
``--workers`` rows take in memory (a page read through the job's source, measured the same
way): the job holds a page per worker, not the table. ``tracemalloc`` slows Python's
allocations, so that run's speed is not the one compared.

    python benchmarks/mapper.py                           # 5 ms of I/O wait per page
    python benchmarks/mapper.py --fn noop --io-wait 0     # what finding the pages costs
    python benchmarks/mapper.py --rows 5000000 --keys sequential
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import math
import os
import statistics
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

import shardkit
from hot_counter import choose_modes, report_console
from shardkit.executor import LocalExecutor
from shardkit.mapper import Batch, KeyRange, TableSource
from shardkit.mapper.keys import interpolate
from shardkit.store.sql import SqlStore, engine_from_url

DEFAULT_STORE = "postgresql://postgres@127.0.0.1:5432/test"
MODES = ("shardkit", "fixed", "balanced", "keyset", "offset")
DEFAULT_MODES = ["shardkit", "fixed", "balanced", "keyset"]
FNS = ("update", "noop")
# The targets, for fn = update with 5 ms of I/O wait per page (the throughput
# ratios) and for fn = noop (the tuples read per row).
TARGET_IO_WAIT = 0.005
TARGET_VS_FIXED = 0.9  # sequential keys: shardkit ÷ fixed
TARGET_VS_KEYSET = {"skewed": 3.5, "string": 3.0}  # shardkit ÷ keyset
TARGET_SKEW = 0.9  # skewed keys: shardkit ÷ keyset, over fixed ÷ keyset on sequential keys
TARGET_TUPLES = 1.1  # tuples read per row visited, fn = noop
TARGET_CPU = 1.15  # CPU seconds, shardkit ÷ fixed
MB = 1024 * 1024
FIT_BINS = 40  # runs of consecutive pages whose median read times the offset fit uses
SETTLE_INTERVAL = 0.5  # seconds between two reads of pg_stat that must agree
SETTLE_DEADLINE = 10.0


@dataclass(frozen=True)
class Keys:
    """A kind of key: its table, the key's type and how the table is filled."""

    kind: str
    table: str
    sql_type: str
    fill: str
    """``INSERT INTO {table} SELECT <id>, 0 FROM generate_series(1, :n) AS g``, with
    ``:dense`` and ``:step`` (the skewed keys') bound too; with ``tenants``,
    ``SELECT <tenant>, <id>, 0``."""
    tenants: bool = False
    """Whether the key is ``(tenant, id)``: a first part of few values (``id`` is unique
    too, and what the loops written by hand walk)."""

    def label(self, rows: int) -> str:
        """The table's comment: which rows it holds, and how they were laid out."""
        return f"shardkit benchmark: {self.kind} keys, {rows} rows, in key order, fillfactor 50"

    def describe(self, rows: int) -> str:
        dense, step = skew(rows)
        if self.kind == "sequential":
            return f"ids 1…{rows:,}"
        if self.kind == "skewed":
            return (
                f"ids 1…{dense:,}, then {rows - dense:,} ids every {step:,} up to "
                f"{dense + (rows - dense) * step:,}"
            )
        return {
            "sparse": f"ids 1,000, 2,000, … {rows * 1000:,}",
            "clustered": f"blocks of {BLOCK:,} consecutive ids, {GAP:,} apart",
            "composite": f"(tenant, id): {TENANTS} tenants of {rows // TENANTS:,} ids each",
            "prefixed": f"'{PREFIXED}' followed by 1…N in 10 digits",
        }.get(self.kind, "md5(1…N) as text")

    def sa_table(self) -> sa.Table:
        key_type: sa.types.TypeEngine[Any] = (
            sa.Text() if self.sql_type == "text" else sa.BigInteger()
        )
        tenant = [sa.Column("tenant", sa.Integer, primary_key=True, autoincrement=False)]
        return sa.Table(
            self.table,
            sa.MetaData(),
            *(tenant if self.tenants else []),
            sa.Column("id", key_type, primary_key=True, autoincrement=False),
            sa.Column("balance", sa.BigInteger, nullable=False),
        )


SERIES = "FROM generate_series(1, CAST(:n AS bigint)) AS g ORDER BY 1, 2"
BLOCK, GAP = 10_000, 1_000_000_000  # the clustered keys' blocks and their distance
TENANTS = 4  # the composite keys' first part
PREFIXED = "customer/eu-west-1/account/"  # the prefix every prefixed key shares
KEYS = {
    keys.kind: keys
    for keys in (
        Keys("sequential", "bench_accounts", "bigint", f"SELECT g, 0 {SERIES}"),
        Keys(
            "skewed",
            "bench_skewed",
            "bigint",
            f"SELECT CASE WHEN g <= :dense THEN g ELSE :dense + (g - :dense) * :step END, 0 "
            f"{SERIES}",
        ),
        Keys("string", "bench_names", "text", f"SELECT md5(g::text), 0 {SERIES}"),
        Keys("sparse", "bench_sparse", "bigint", f"SELECT g * 1000, 0 {SERIES}"),
        Keys(
            "clustered",
            "bench_clustered",
            "bigint",
            f"SELECT (g - 1) / {BLOCK} * {GAP} + (g - 1) % {BLOCK} + 1, 0 {SERIES}",
        ),
        Keys(
            "composite",
            "bench_tenants",
            "bigint",
            f"SELECT 1 + (g - 1) * {TENANTS} / :n, g, 0 {SERIES}",
            tenants=True,
        ),
        Keys(
            "prefixed",
            "bench_prefixed",
            "text",
            f"SELECT '{PREFIXED}' || lpad(g::text, 10, '0'), 0 {SERIES}",
        ),
    )
}


def skew(rows: int) -> tuple[int, int]:
    """The skewed table's dense ids (1…dense) and the step between the sparse ones, which
    spread the other tenth of the rows over the 100 x rows ids above them."""
    dense = rows - rows // 10
    return dense, 100 * rows // max(1, rows - dense)


@dataclass
class Result:
    """One mode's run on one kind of key."""

    keys: str
    mode: str
    rows: int
    """Rows visited: the whole table, or (offset) those visited before the time limit."""
    seconds: float
    """Measured, or (``extrapolated``) the estimate for the whole table."""
    cpu: float
    """CPU seconds of this process (all threads) over the measured span."""
    machine: float | None = None
    """CPU seconds of the whole machine (every process: this one and the database's) over
    the measured span; None where ``/proc/stat`` is not there to read."""
    exact: bool = True
    extrapolated: bool = False
    note: str = ""
    tuples: int | None = None
    """Tuples PostgreSQL read from the table during the run (seq_tup_read + idx_tup_fetch)."""
    entries: int | None = None
    """Entries PostgreSQL read from the table's indexes during the run (idx_tup_read)."""
    blocks: int | None = None
    """Blocks of the table's indexes PostgreSQL touched during the run."""
    settled: bool = True
    """Whether pg_stat's counts settled before and after the run."""
    extra: dict[str, Any] = field(default_factory=dict)


Work = Callable[[sa.Connection, list[Any]], None]


def make_work(keys: Keys, args: argparse.Namespace) -> Work:
    """What every mode does with a page: ``fn``."""
    if args.fn == "noop":
        return lambda conn, ids: None
    update = sa.text(f"UPDATE {keys.table} SET balance = balance + 1 WHERE id = ANY(:ids)")
    io_wait: float = args.io_wait

    def work(conn: sa.Connection, ids: list[Any]) -> None:
        updated = conn.execute(update, {"ids": ids}).rowcount
        if updated != len(ids):
            raise RuntimeError(f"updated {updated} rows of a page of {len(ids)}")
        if io_wait > 0:
            time.sleep(io_wait)

    return work


class Clock(NamedTuple):
    wall: float
    cpu: float
    """This process's, all threads."""
    machine: float | None
    """Every process's (``/proc/stat``: user, nice, system, irq and softirq time)."""


def machine_cpu() -> float | None:
    """The CPU seconds the machine has spent, every process and core; None off Linux."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(field) for field in stat.readline().split()[1:8]]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = ticks
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def clock() -> Clock:
    """Wall, CPU (this process) and machine CPU seconds, to subtract."""
    return Clock(time.perf_counter(), time.process_time(), machine_cpu())


def since(start: Clock) -> Clock:
    """Wall, CPU and machine CPU seconds since ``clock()`` gave ``start``."""
    now = clock()
    machine = None if now.machine is None or start.machine is None else now.machine - start.machine
    return Clock(now.wall - start.wall, now.cpu - start.cpu, machine)


def total_balance(engine: sa.Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT sum(balance) FROM {table}")).scalar_one())


def vacuum(engine: sa.Engine, table: str) -> None:
    """Vacuum and analyze ``table``, then write the server's dirty pages out
    (``CHECKPOINT``, where this role may), so that no mode pays for the last one's."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"VACUUM (ANALYZE) {table}"))
        with contextlib.suppress(sa.exc.DBAPIError):
            conn.execute(sa.text("CHECKPOINT"))


def prepare_table(engine: sa.Engine, keys: Keys, rows: int, console: Console) -> None:
    """Make ``keys.table`` hold ``rows`` rows of its kind, reusing it if it already does."""
    label = keys.label(rows)
    with engine.connect() as conn:
        comment = conn.execute(
            sa.text("SELECT obj_description(to_regclass(:table), 'pg_class')"),
            {"table": keys.table},
        ).scalar_one()
        if comment == label:
            count = conn.execute(sa.text(f"SELECT count(*) FROM {keys.table}")).scalar_one()
            if count == rows:
                console.print(f"reusing [cyan]{keys.table}[/] ({rows:,} rows)")
                return
    started = time.perf_counter()
    dense, step = skew(rows)
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {keys.table}"))
        conn.execute(
            sa.text(
                f"CREATE TABLE {keys.table} ({'tenant int NOT NULL, ' if keys.tenants else ''}"
                f"id {keys.sql_type} NOT NULL, balance bigint NOT NULL) WITH (fillfactor = 50)"
            )
        )
        conn.execute(
            sa.text(f"INSERT INTO {keys.table} {keys.fill}"),
            {"n": rows, "dense": dense, "step": step},
        )
        primary = "tenant, id" if keys.tenants else "id"
        conn.execute(sa.text(f"ALTER TABLE {keys.table} ADD PRIMARY KEY ({primary})"))
        if keys.tenants:  # what the loops by hand walk, and fn's UPDATE finds rows by
            conn.execute(sa.text(f"ALTER TABLE {keys.table} ADD UNIQUE (id)"))
        conn.execute(sa.text(f"COMMENT ON TABLE {keys.table} IS '{label}'"))
    vacuum(engine, keys.table)
    console.print(
        f"created [cyan]{keys.table}[/] ({rows:,} rows) in {time.perf_counter() - started:.1f} s"
    )


def load() -> str:
    return " ".join(f"{n:.1f}" for n in os.getloadavg())


def warm(engine: sa.Engine, connections: int) -> None:
    """Open ``connections`` of the engine's pool before the clock starts."""
    with contextlib.ExitStack() as stack:
        for _ in range(connections):
            stack.enter_context(engine.connect()).execute(sa.select(sa.literal(1)))


@functools.cache
def page_statement(table: str, lower: str, upper: bool) -> sa.TextClause:
    """A keyset page: ``lower`` is ``""`` (from the start), ``">"`` (after ``:lo``, the
    last key read) or ``">="`` (from ``:lo``); ``upper``: below ``:hi``."""
    where = [f"id {lower} :lo"] if lower else []
    if upper:
        where.append("id < :hi")
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    return sa.text(f"SELECT id, balance FROM {table}{clause} ORDER BY id LIMIT :page")


def walk(
    engine: sa.Engine, table: str, work: Work, page_size: int, lo: Any = None, hi: Any = None
) -> int:
    """The keyset loop over the keys in ``[lo, hi)`` (None: unbounded), each page in a
    transaction of its own; returns the rows visited."""
    visited = 0
    lower = "" if lo is None else ">="
    while True:
        params: dict[str, Any] = {"page": page_size}
        if lower:
            params["lo"] = lo
        if hi is not None:
            params["hi"] = hi
        with engine.begin() as conn:
            statement = page_statement(table, lower, hi is not None)
            ids = [row.id for row in conn.execute(statement, params)]
            if ids:
                work(conn, ids)
        visited += len(ids)
        if len(ids) < page_size:
            return visited
        lower, lo = ">", ids[-1]


def run_keyset(keys: Keys, args: argparse.Namespace) -> Result:
    work = make_work(keys, args)
    engine = engine_from_url(args.store, pool_size=1)
    try:
        warm(engine, 1)
        start = clock()
        visited = walk(engine, keys.table, work, args.page_size)
        seconds, cpu, machine = since(start)
    finally:
        engine.dispose()
    return Result(keys.kind, "keyset", visited, seconds, cpu, machine)


def cut_points(conn: sa.Connection, keys: Keys, low: Any, high: Any, parts: int) -> list[Any]:
    """Up to ``parts - 1`` keys cutting ``[low, high]`` into equal key ranges, in the
    database's order."""
    if keys.sql_type != "text":
        points = [low + (high - low + 1) * i // parts for i in range(1, parts)]
        return sorted({p for p in points if low < p <= high})
    # Interpolated in Python's order (digits: code points); PostgreSQL text holds no NUL.
    aimed = {str(p).split("\0", 1)[0] for p in interpolate(low, high, parts)} - {""}
    ordered = conn.execute(
        sa.text("SELECT unnest(CAST(:points AS text[])) ORDER BY 1"), {"points": list(aimed)}
    ).scalars()
    return [p for p, _ in itertools.groupby(ordered)]


def quantiles(conn: sa.Connection, keys: Keys, parts: int) -> list[Any]:
    """The keys that cut the table into ``parts`` ranges of equal row counts, found by
    sorting every key (``percentile_disc``): what only a full read can tell."""
    fractions = [i / parts for i in range(1, parts)]
    points = conn.execute(
        sa.text(
            "SELECT percentile_disc(CAST(:fractions AS float8[])) WITHIN GROUP (ORDER BY id) "
            f"FROM {keys.table}"
        ),
        {"fractions": fractions},
    ).scalar_one()
    return [p for p, _ in itertools.groupby(points)]


def run_fixed(keys: Keys, args: argparse.Namespace, *, balanced: bool = False) -> Result:
    """The hand-written split, cut by key arithmetic (timed), or ``balanced``: cut at the
    rows' quantiles, found before the clock starts."""
    work = make_work(keys, args)
    engine = engine_from_url(args.store, pool_size=args.workers)
    try:
        warm(engine, args.workers)
        if balanced:
            with engine.connect() as conn:
                points = quantiles(conn, keys, args.workers)
        start = clock()
        if not balanced:
            with engine.connect() as conn:
                low, high = conn.execute(
                    sa.text(f"SELECT min(id), max(id) FROM {keys.table}")
                ).one()
                points = cut_points(conn, keys, low, high, args.workers)
        bounds = [None, *points, None]
        with ThreadPoolExecutor(len(bounds) - 1) as pool:
            counts = list(
                pool.map(
                    lambda i: walk(
                        engine, keys.table, work, args.page_size, bounds[i], bounds[i + 1]
                    ),
                    range(len(bounds) - 1),
                )
            )
        seconds, cpu, machine = since(start)
    finally:
        engine.dispose()
    visited = sum(counts)
    where = "at the rows' quantiles" if balanced else f"between min {low} and max {high}"
    note = (
        f"{len(counts)} ranges {where}; the busiest held "
        f"{max(counts) / max(1, visited):.0%} of the rows"
    )
    mode = "balanced" if balanced else "fixed"
    return Result(keys.kind, mode, visited, seconds, cpu, machine, note=note)


def run_offset(keys: Keys, args: argparse.Namespace) -> Result:
    work = make_work(keys, args)
    statement = sa.text(
        f"SELECT id, balance FROM {keys.table} ORDER BY id LIMIT :page OFFSET :offset"
    )
    pages = math.ceil(args.rows / args.page_size)
    reads: list[float] = []  # per page: the SELECT … OFFSET and its rows
    rests: list[float] = []  # per page: the work and the commit
    visited = 0
    engine = engine_from_url(args.store, pool_size=1)
    try:
        warm(engine, 1)
        start = clock()
        while time.perf_counter() - start.wall < args.offset_seconds:
            page_started = time.perf_counter()
            with engine.begin() as conn:
                result = conn.execute(statement, {"page": args.page_size, "offset": visited})
                ids = [row.id for row in result]
                if not ids:
                    break
                read = time.perf_counter()
                work(conn, ids)
            visited += len(ids)
            reads.append(read - page_started)
            rests.append(time.perf_counter() - read)
        measured, cpu, machine = since(start)
    finally:
        engine.dispose()
    if visited >= args.rows:
        return Result(
            keys.kind, "offset", visited, measured, cpu, machine, note="whole table, measured"
        )
    done = len(reads)
    if done < 2:
        raise SystemExit("offset: fewer than 2 pages before the time limit: raise --offset-seconds")
    a, b = fit_reads(reads)
    rest = statistics.fmean(rests)
    missing = sum(a + b * i + rest for i in range(done, pages))
    note = (
        f"{done:,} of {pages:,} pages in {measured:.1f} s; reading page i fitted (least squares "
        f"on the medians of {min(FIT_BINS, done)} runs of pages) as {a * 1e3:.2f} ms + "
        f"{b * 1e6:.2f} µs x i, the rest of a page (fn, commit) {rest * 1e3:.2f} ms "
        f"on average; pages {done:,}…{pages - 1:,} ≈ {missing:.1f} s by that fit"
    )
    return Result(
        keys.kind, "offset", visited, measured + missing, cpu, extrapolated=True, note=note
    )


def fit_reads(reads: list[float]) -> tuple[float, float]:
    """``(a, b)`` of the line ``a + b·i`` through the read times of pages i = 0, 1, …: least
    squares on the medians of ``FIT_BINS`` runs of consecutive pages, so that pages slowed
    by other work on the machine do not tilt it."""
    bins = min(FIT_BINS, len(reads))
    xs, ys = [], []
    for k in range(bins):
        lo, hi = len(reads) * k // bins, len(reads) * (k + 1) // bins
        xs.append((lo + hi - 1) / 2)
        ys.append(statistics.median(reads[lo:hi]))
    fit = statistics.linear_regression(xs, ys)
    return fit.intercept, fit.slope


def page_bytes(engine: sa.Engine, keys: Keys, page_size: int) -> int:
    """Memory taken by one page of rows as the job's source returns them."""
    source = TableSource(keys.sa_table(), "id")
    with engine.connect() as conn:
        source.page(conn, KeyRange(), None, page_size)  # compile and cache the statement
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            page = source.page(conn, KeyRange(), None, page_size)
            size = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    if len(page) != page_size:
        raise SystemExit(f"the table has fewer than --page-size ({page_size}) rows")
    return size


def run_shardkit(keys: Keys, args: argparse.Namespace, prefix: str, *, traced: bool) -> Result:
    """Run the job on a kit of its own, closed (its connections too) before returning."""
    work = make_work(keys, args)
    transactional = not args.at_least_once
    engine: sa.Engine | None = None  # the kit's, for fn's own transactions

    def fn(batch: Batch) -> None:
        if args.batch == "rows":
            ids = [row["id"] for row in batch.rows]
        else:
            ids = [row.id for row in batch.records]
        if transactional:
            work(batch.conn, ids)
            return
        assert engine is not None
        with engine.begin() as conn:
            work(conn, ids)

    def nothing(batch: Batch) -> None:
        return None

    executor = LocalExecutor(workers=args.workers)
    with shardkit.connect(args.store, "memory://", prefix=prefix, executor=executor) as kit:
        store = kit.store
        assert isinstance(store, SqlStore)
        engine = store.engine
        warm(store.engine, args.workers)  # the workers' connections, as the loops' are
        peak = None
        if traced:
            tracemalloc.start()
        try:
            start = clock()
            job = kit.map(
                keys.sa_table(),
                nothing if args.fn == "noop" else fn,
                transactional=transactional,
                page_size=args.page_size,
                fanout=args.fanout,
            )
            status = job.wait(timeout=args.timeout)
            seconds, cpu, machine = since(start)
            if traced:
                peak = tracemalloc.get_traced_memory()[1]
        finally:
            if traced:
                tracemalloc.stop()
        with store.engine.begin() as conn:  # the next run starts on empty ledger tables
            ranges, jobs = kit.mapper.ledger.ranges, kit.mapper.ledger.jobs
            conn.execute(ranges.delete().where(ranges.c.job == job.id))
            conn.execute(jobs.delete().where(jobs.c.id == job.id))
    return Result(
        keys.kind,
        "shardkit (traced)" if traced else "shardkit",
        status.rows,
        seconds,
        cpu,
        machine,
        exact=status.state == "complete",
        extra={
            "depth": status.depth,
            "pages": status.pages,
            "ranges": status.done + status.pending,
            "peak": peak,
        },
    )


class TupleReads:
    """What PostgreSQL has read from a table: its tuples, ``seq_tup_read + idx_tup_fetch``
    of ``pg_stat_user_tables``, and the entries of its indexes, ``idx_tup_read`` of
    ``pg_stat_user_indexes`` (index-only scans too), through a connection that never
    reads the table itself."""

    STATEMENT = sa.text(
        "SELECT coalesce(t.seq_tup_read, 0) + coalesce(t.idx_tup_fetch, 0), "
        "(SELECT coalesce(sum(i.idx_tup_read), 0) FROM pg_stat_user_indexes AS i "
        "WHERE i.relid = t.relid), "
        "(SELECT coalesce(sum(b.idx_blks_hit + b.idx_blks_read), 0) "
        "FROM pg_statio_user_indexes AS b WHERE b.relid = t.relid) "
        "FROM pg_stat_user_tables AS t WHERE t.relid = to_regclass(:table)"
    )

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.waits: list[float] = []
        """Seconds each settled read took."""

    def read(self, table: str) -> tuple[int, int, int]:
        """Tuples read from ``table``, entries read from its indexes, index blocks touched."""
        with self.engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))  # no cached snapshot
            tuples, entries, blocks = conn.execute(self.STATEMENT, {"table": table}).one()
        return int(tuples), int(entries), int(blocks)

    def settled(self, table: str) -> tuple[tuple[int, int, int], bool]:
        """The counts once two reads ``SETTLE_INTERVAL`` apart agree (the last read and
        False after ``SETTLE_DEADLINE``). Close the connections that read the table first:
        their backends report at exit, or when idle but up to 10 s late."""
        started = time.perf_counter()
        value = self.read(table)
        while True:
            time.sleep(SETTLE_INTERVAL)
            again = self.read(table)
            waited = time.perf_counter() - started
            if again == value or waited > SETTLE_DEADLINE:
                self.waits.append(waited)
                return again, again == value
            value = again


class Balances:
    """The balances before a mode, copied to a table of their own, to check every row
    after it."""

    def __init__(self, engine: sa.Engine, table: str, source: str) -> None:
        self.engine = engine
        self.table = table
        self.source = source

    def take(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.table}"))
            conn.execute(
                sa.text(
                    f"CREATE UNLOGGED TABLE {self.table} AS SELECT id, balance FROM {self.source}"
                )
            )

    def changes(self) -> tuple[int, int]:
        """Rows whose balance rose by exactly 1, and rows that changed otherwise."""
        statement = sa.text(
            "SELECT count(*) FILTER (WHERE a.balance = s.balance + 1), "
            "count(*) FILTER (WHERE a.balance IS DISTINCT FROM s.balance "
            "AND a.balance IS DISTINCT FROM s.balance + 1) "
            f"FROM {self.source} AS a FULL JOIN {self.table} AS s USING (id)"
        )
        with self.engine.connect() as conn:
            plus_one, other = conn.execute(statement).one()
        return int(plus_one), int(other)

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.table}"))


def checked(
    engine: sa.Engine,
    reads: TupleReads,
    balances: Balances,
    run: Callable[[], Result],
    *,
    whole: bool,
    args: argparse.Namespace,
) -> Result:
    """Run a mode (on a freshly vacuumed table), count the tuples it read and check it:
    with fn = update, ``sum(balance)`` moved by the rows it visited, and exactly those rows,
    each by 1; with fn = noop, nothing changed; every row visited if ``whole``."""
    vacuum(engine, balances.source)
    balances.take()
    before_total = total_balance(engine, balances.source)
    engine.dispose()  # its backends report the reads above as they exit: not counted
    before, settled = reads.settled(balances.source)
    result = run()  # closes the connections it used
    after, settled_after = reads.settled(balances.source)
    result.tuples = after[0] - before[0]
    result.entries = after[1] - before[1]
    result.blocks = after[2] - before[2]
    result.settled = settled and settled_after
    moved = total_balance(engine, balances.source) - before_total
    plus_one, other = balances.changes()
    expected = result.rows if args.fn == "update" else 0
    result.exact = (
        result.exact
        and moved == plus_one == expected
        and other == 0
        and (not whole or result.rows == args.rows)
    )
    result.extra.update(moved=moved, plus_one=plus_one, other=other)
    return result


DEFAULT_KEYS = ["sequential", "skewed", "string"]


def choose_keys(parser: argparse.ArgumentParser, text: str | None) -> list[str]:
    if text is None:
        return DEFAULT_KEYS
    wanted = {k.strip() for k in text.split(",") if k.strip()}
    if unknown := wanted - set(KEYS):
        parser.error(f"unknown keys {', '.join(sorted(unknown))}; choose from {tuple(KEYS)}")
    if not wanted:
        parser.error("no keys selected")
    return [k for k in KEYS if k in wanted]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=DEFAULT_STORE, help=f"PostgreSQL URL ({DEFAULT_STORE})")
    parser.add_argument("--rows", type=int, default=400_000, help="table rows (400,000)")
    parser.add_argument("--page-size", type=int, default=500, help="rows per page (500)")
    parser.add_argument(
        "--workers",
        type=int,
        default=8,
        help="shardkit's local workers, the fixed split's ranges and threads (8)",
    )
    parser.add_argument("--fanout", type=int, default=8, help="shardkit's fanout (8)")
    parser.add_argument(
        "--io-wait", type=float, default=0.005, help="seconds of sleep per page (0.005)"
    )
    parser.add_argument(
        "--fn", choices=FNS, default="update", help="update and wait (default), or nothing"
    )
    parser.add_argument(
        "--keys", help=f"comma-separated, of {','.join(KEYS)} (default {','.join(DEFAULT_KEYS)})"
    )
    parser.add_argument(
        "--batch",
        choices=("records", "rows"),
        default="records",
        help='what shardkit\'s fn reads: batch.records (row.id, default) or batch.rows (row["id"])',
    )
    parser.add_argument(
        "--offset-seconds",
        type=float,
        default=20.0,
        help="time limit of the offset mode, then extrapolated (20)",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for a shardkit job (600)"
    )
    parser.add_argument(
        "--memory", action="store_true", help="add shardkit's traced run (peak memory)"
    )
    parser.add_argument(
        "--at-least-once",
        action="store_true",
        help="shardkit's job not transactional (the default of kit.map): fn commits on its own",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of the modes, interleaved, each starting one mode further on; the table "
        "gives each one's median run (1)",
    )
    parser.add_argument(
        "--modes",
        help=f"comma-separated, of {','.join(MODES)} (default {','.join(DEFAULT_MODES)})",
    )
    args = parser.parse_args(argv)
    if min(args.rows, args.page_size, args.workers, args.repeat) < 1 or args.fanout < 2:
        parser.error("--rows, --page-size, --workers and --repeat must be >= 1, --fanout >= 2")
    if args.io_wait < 0 or not args.offset_seconds > 0 or not args.timeout > 0:
        parser.error("--io-wait must be >= 0, --offset-seconds and --timeout > 0")
    if not args.store.split(":", 1)[0].lower().startswith("postgresql"):
        parser.error("the benchmark needs PostgreSQL (--store postgresql://…)")
    args.modes = choose_modes(parser, args.modes, MODES, DEFAULT_MODES)
    args.keys = choose_keys(parser, args.keys)
    return args


def measure(
    args: argparse.Namespace, console: Console
) -> tuple[list[Result], dict[str, int], TupleReads]:
    """Run every mode of ``args`` on each kind of key, ``args.repeat`` rounds; return
    each mode's median run, a page's bytes by kind of key (with ``--memory``), and the
    reads of ``pg_stat`` (how they settled)."""
    prefix = f"skbench{uuid.uuid4().hex[:8]}_"
    results: list[Result] = []
    one_page: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        engine = engine_from_url(args.store)
        stack.callback(engine.dispose)
        stats_engine = engine_from_url(args.store, pool_size=1)
        stack.callback(stats_engine.dispose)
        reads = TupleReads(stats_engine)
        for kind in args.keys:
            prepare_table(engine, KEYS[kind], args.rows, console)
        console.print(
            f"store [cyan]{engine.url.render_as_string()}[/], {args.rows:,} rows, page "
            f"{args.page_size}, fn {args.fn}"
            + (f", I/O wait {args.io_wait * 1e3:g} ms per page" if args.fn == "update" else "")
            + f"; shardkit: {args.workers} local workers, fanout {args.fanout}, "
            f"fn reads batch.{args.batch}"
            + (", at least once" if args.at_least_once else ", transactional")
            + f"; fixed: "
            f"{args.workers} ranges; keys {', '.join(args.keys)}; modes "
            f"{', '.join(args.modes)}; load average {load()}"
        )
        if "shardkit" in args.modes:
            # Create shardkit's tables now, to drop them at the end whatever happens.
            with shardkit.connect(args.store, "memory://", prefix=prefix) as kit:
                store = kit.store
                assert isinstance(store, SqlStore)
                stack.callback(store.metadata.drop_all, engine)
        scratch = f"{prefix}balances"
        stack.callback(Balances(engine, scratch, "").drop)
        for kind in args.keys:
            keys = KEYS[kind]
            balances = Balances(engine, scratch, keys.table)
            console.print(f"[bold]{kind}[/] keys: {keys.table}, {keys.describe(args.rows)}")
            rounds: dict[str, list[Result]] = {}
            chosen = runs(keys, args, prefix)
            for turn in range(args.repeat):
                # Each round starts one mode further on: every mode takes each place in
                # turn, so none always runs after the same other.
                shift = turn % len(chosen)
                for name, run, whole in chosen[shift:] + chosen[:shift]:
                    console.print(f"  running [bold]{name}[/]…")
                    result = checked(engine, reads, balances, run, whole=whole, args=args)
                    rounds.setdefault(name, []).append(result)
                    console.print(
                        f"    {result.rows:,} rows visited in {result.seconds:.1f} s"
                        f"{' (extrapolated to the whole table)' if result.extrapolated else ''}; "
                        f"sum(balance) moved by {result.extra['moved']:,}; rows +1: "
                        f"{result.extra['plus_one']:,}, rows changed otherwise: "
                        f"{result.extra['other']:,}; tuples read {result.tuples:,}, index entries "
                        f"{result.entries:,}, index blocks {result.blocks:,}"
                        f"{'' if result.settled else ' (pg_stat did not settle)'}"
                        f": {'[green]exact[/]' if result.exact else '[red]WRONG[/]'}"
                    )
            results.extend(median(runs_of_mode) for runs_of_mode in rounds.values())
            if args.memory and "shardkit" in args.modes:
                one_page[kind] = page_bytes(engine, keys, args.page_size)
    return results, one_page, reads


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console(width=180)
    results, one_page, reads = measure(args, console)
    console.print(f"load average {load()} ({os.cpu_count()} CPUs)")
    console.print(results_table(results, args))
    for line in notes(results, args, one_page, reads):
        console.print(line)
    for line in targets(results, args):
        console.print(line)
    if all(r.exact for r in results):
        return 0
    console.print("[red]a check failed: the rows visited or the balances were not as expected[/]")
    return 1


def runs(
    keys: Keys, args: argparse.Namespace, prefix: str
) -> list[tuple[str, Callable[[], Result], bool]]:
    """The runs of one kind of key: (name, run, whether it visits every row)."""
    chosen: list[tuple[str, Callable[[], Result], bool]] = []
    for mode in args.modes:
        if mode == "shardkit":
            chosen.append((mode, lambda: run_shardkit(keys, args, prefix, traced=False), True))
            if args.memory:
                chosen.append(
                    (
                        "shardkit (traced)",
                        lambda: run_shardkit(keys, args, prefix, traced=True),
                        True,
                    )
                )
        elif mode == "fixed":
            chosen.append((mode, lambda: run_fixed(keys, args), True))
        elif mode == "balanced":
            chosen.append((mode, lambda: run_fixed(keys, args, balanced=True), True))
        elif mode == "keyset":
            chosen.append((mode, lambda: run_keyset(keys, args), True))
        else:
            chosen.append((mode, lambda: run_offset(keys, args), False))
    return chosen


def median(results: list[Result]) -> Result:
    """The run of median time among a mode's rounds (the slower middle one of an even
    count), marked exact only if every round was, noting the rounds' spread."""
    ordered = sorted(results, key=lambda r: r.seconds)
    chosen = ordered[len(ordered) // 2]
    chosen.exact = all(r.exact for r in results)
    if len(results) > 1:
        spread = f"{len(results)} rounds, {ordered[0].seconds:.2f} to {ordered[-1].seconds:.2f} s"
        chosen.note = f"{chosen.note}; {spread}" if chosen.note else spread
    return chosen


def rate(r: Result, args: argparse.Namespace) -> float:
    return (args.rows if r.extrapolated else r.rows) / r.seconds


def find(results: Sequence[Result], keys: str, mode: str) -> Result | None:
    return next((r for r in results if r.keys == keys and r.mode == mode), None)


def results_table(results: list[Result], args: argparse.Namespace) -> Table:
    work = (
        f"UPDATE and {args.io_wait * 1e3:g} ms I/O wait per page"
        if args.fn == "update"
        else "fn doing nothing"
    )
    table = Table(title=f"Visiting {args.rows:,} rows, {args.page_size} per page, {work}")
    columns = [
        "keys",
        "mode",
        "rows",
        "seconds",
        "rows/s",
        "vs keyset",
        "vs fixed",
        "CPU s",
        "CPU vs fixed",
        "machine CPU s",
        "tuples/row",
        "index entries/row",
        "index blocks/1k rows",
        "checked",
        "depth",
        "pages",
        "ranges/M rows",
    ]
    if args.memory:
        columns.append("peak MB")
    for column in columns:
        table.add_column(column, justify="left" if column in ("keys", "mode") else "right")
    for i, r in enumerate(results):
        if i and r.keys != results[i - 1].keys:
            table.add_section()
        base, fixed = find(results, r.keys, "keyset"), find(results, r.keys, "fixed")
        whole = args.rows if r.extrapolated else r.rows
        seconds = f"≈ {r.seconds:,.1f}" if r.extrapolated else f"{r.seconds:,.1f}"
        if not r.exact:
            checked_text = "[red]✗[/]"
        elif args.fn == "noop":
            checked_text = "[green]✓[/] unchanged"
        elif r.extrapolated:
            checked_text = f"[green]✓[/] +1 on {r.rows:,} visited"
        else:
            checked_text = "[green]✓[/] +1 each"
        unsettled = "" if r.settled else "?"
        tuples = "-" if r.tuples is None or not r.rows else f"{r.tuples / r.rows:.2f}{unsettled}"
        entries = "-" if r.entries is None or not r.rows else f"{r.entries / r.rows:.2f}{unsettled}"
        blocks = (
            "-" if r.blocks is None or not r.rows else f"{1000 * r.blocks / r.rows:.1f}{unsettled}"
        )
        cells = [
            r.keys,
            r.mode + (" (extrapolated)" if r.extrapolated else ""),
            f"{whole:,}",
            seconds,
            f"{rate(r, args):,.0f}",
            f"{rate(r, args) / rate(base, args):.2f}x" if base else "-",
            f"{rate(r, args) / rate(fixed, args):.2f}x" if fixed else "-",
            f"{r.cpu:.2f}",
            f"{r.cpu / fixed.cpu:.2f}x" if fixed and fixed.cpu and not r.extrapolated else "-",
            "-" if r.machine is None or r.extrapolated else f"{r.machine:.2f}",
            tuples,
            entries,
            blocks,
            checked_text,
        ]
        if r.mode.startswith("shardkit"):
            cells += [
                str(r.extra["depth"]),
                f"{r.extra['pages']:,}",
                f"{r.extra['ranges'] / max(1, r.rows) * 1e6:,.0f}",
            ]
            if args.memory:
                peak = r.extra["peak"]
                cells.append("-" if peak is None else f"{peak / MB:.1f}")
        else:
            cells += ["-"] * (len(columns) - len(cells))
        table.add_row(*cells)
    return table


def notes(
    results: list[Result], args: argparse.Namespace, one_page: dict[str, int], reads: TupleReads
) -> list[str]:
    lines = [f"[dim]{r.mode} ({r.keys}): {r.note}[/]" for r in results if r.note]
    lines.append(
        "[dim]CPU s: CPU time of this Python process (all its threads) while the mode ran, "
        "the database's own not included; machine CPU s: the whole machine's (this process, "
        "the database and anything else running), so what a mode costs the server shows "
        "there; tuples/row: seq_tup_read + idx_tup_fetch of the "
        "table (pg_stat_user_tables) during the run ÷ rows visited; index entries/row: "
        "idx_tup_read of its indexes (pg_stat_user_indexes), index-only scans included; "
        "index blocks/1k rows: idx_blks_hit + idx_blks_read of its indexes "
        "(pg_statio_user_indexes), entries walked past without being returned included"
        + (
            "; fn's UPDATE fetches each row once by index, so both include 1.0 per row of "
            f"fn's own (the target of ≤ {TARGET_TUPLES:g} tuples per row is for --fn noop)"
            if args.fn == "update"
            else ""
        )
        + "[/]"
    )
    if reads.waits:
        unsettled = sum(1 for r in results if not r.settled)
        low, high = f"{min(reads.waits):.1f}", f"{max(reads.waits):.1f}"
        lines.append(
            f"[dim]pg_stat settled {low if low == high else f'{low} to {high}'} s after "
            "the connections that read the table were closed"
            + (
                f"; [red]{unsettled} runs did not settle within {SETTLE_DEADLINE:g} s (marked ?)[/]"
                if unsettled
                else ""
            )
            + "[/]"
        )
    for r in results:
        if r.mode.startswith("shardkit") and r.extra["peak"] is not None and r.keys in one_page:
            page = one_page[r.keys]
            lines.append(
                f"shardkit memory ({r.keys}): peak {r.extra['peak'] / MB:.1f} MB allocated "
                f"during the job (tracemalloc); {args.page_size} rows x {args.workers} workers "
                f"= {page * args.workers / MB:.1f} MB ({page / 1024:.0f} KB a page); the whole "
                f"table as rows would be ≈ {page / args.page_size * args.rows / MB:,.0f} MB"
            )
    if args.memory:
        lines.append(
            "[dim]shardkit (traced) is the same job run again under tracemalloc, for its "
            "peak; its speed is not the one compared[/]"
        )
    return lines


def mark(ok: bool) -> str:
    return "[green]✓[/]" if ok else "[red]✗[/]"


def targets(results: list[Result], args: argparse.Namespace) -> list[str]:
    """The issue's targets, each checked where its modes ran."""
    lines: list[str] = []
    speed_note = (
        ""
        if args.fn == "update"
        and math.isclose(args.io_wait, TARGET_IO_WAIT)
        and not args.at_least_once
        else f" (the target is for a transactional job, --fn update with "
        f"{TARGET_IO_WAIT * 1e3:g} ms of I/O wait; this run: {args.fn}"
        + (f", {args.io_wait * 1e3:g} ms" if args.fn == "update" else "")
        + (", at least once" if args.at_least_once else "")
        + ")"
    )
    for kind in args.keys:
        fast = find(results, kind, "shardkit")
        fixed, base = find(results, kind, "fixed"), find(results, kind, "keyset")
        if fast is None:
            continue
        if kind == "sequential" and fixed:
            ratio = rate(fast, args) / rate(fixed, args)
            lines.append(
                f"target, {kind} keys: shardkit ÷ fixed ≥ {TARGET_VS_FIXED:g}x{speed_note}: "
                f"{ratio:.2f}x {mark(ratio >= TARGET_VS_FIXED)}"
            )
        if kind in TARGET_VS_KEYSET and base:
            goal = TARGET_VS_KEYSET[kind]
            ratio = rate(fast, args) / rate(base, args)
            beside = (
                f"; fixed ÷ keyset {rate(fixed, args) / rate(base, args):.2f}x" if fixed else ""
            )
            ceiling = find(results, kind, "balanced")
            if ceiling:
                beside += (
                    f"; this machine's ceiling, balanced ÷ keyset "
                    f"{rate(ceiling, args) / rate(base, args):.2f}x (shardkit ÷ balanced "
                    f"{rate(fast, args) / rate(ceiling, args):.2f}x)"
                )
            lines.append(
                f"target, {kind} keys: shardkit ÷ keyset ≥ {goal:g}x{speed_note}: "
                f"{ratio:.2f}x {mark(ratio >= goal)}{beside}"
            )
        even = [find(results, "sequential", mode) for mode in ("fixed", "keyset")]
        if kind == "skewed" and base and even[0] and even[1]:
            # Skew must cost nothing: the speed-up over one loop that a fixed split gets
            # where the keys are even.
            goal = TARGET_SKEW * rate(even[0], args) / rate(even[1], args)
            ratio = rate(fast, args) / rate(base, args)
            lines.append(
                f"target, skewed keys: shardkit ÷ keyset ≥ {TARGET_SKEW:g} of what fixed ÷ "
                f"keyset gets on sequential keys ({goal:.2f}x){speed_note}: {ratio:.2f}x "
                f"{mark(ratio >= goal)}"
            )
        if fast.tuples is not None and fast.rows:
            per_row = fast.tuples / fast.rows
            if args.fn == "noop":
                lines.append(
                    f"target, {kind} keys: tuples read per row ≤ {TARGET_TUPLES:g}: "
                    f"{per_row:.2f} {mark(per_row <= TARGET_TUPLES)}"
                    + ("" if fast.settled else " (pg_stat did not settle)")
                )
            else:
                lines.append(
                    f"[dim]{kind} keys: tuples read per row {per_row:.2f}, {per_row - 1:.2f} "
                    f"besides fn's UPDATE (the target of ≤ {TARGET_TUPLES:g} is for --fn noop)[/]"
                )
        if fixed and fixed.cpu:
            ratio = fast.cpu / fixed.cpu
            lines.append(
                f"target, {kind} keys: CPU shardkit ÷ fixed ≤ {TARGET_CPU:g}x: "
                f"{ratio:.2f}x {mark(ratio <= TARGET_CPU)}"
            )
    return lines


if __name__ == "__main__":
    sys.exit(main())
