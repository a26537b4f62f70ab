"""Visit every row of a big PostgreSQL table: ``kit.map`` against a keyset loop and OFFSET.

Every mode does the same work for each page of ``--page-size`` rows, in one transaction
per page: read the page in key order, ``UPDATE bench_accounts SET balance = balance + 1
WHERE id = ANY(<the page's ids>)``, then sleep ``--io-wait`` seconds (a function that
waits on I/O: an API call, a file) before the transaction commits.

* shardkit - ``kit.map(table, fn, transactional=True, page_size=…, fanout=…)`` on a
             ``LocalExecutor(workers=…)``; ``fn`` writes through ``batch.conn``, so each
             page's update commits with its checkpoint. The kit's connections (its pool
             keeps one per worker) are opened before the clock starts (the loops' one is
             open too); ``job.wait`` wakes when the job completes, so its end is timed
             as it happens
* keyset   - one loop: ``SELECT … WHERE id > :last ORDER BY id LIMIT :page``, the work
* offset   - one loop: ``SELECT … ORDER BY id LIMIT :page OFFSET :offset``, the work;
             stopped after ``--offset-seconds`` and extrapolated to the whole table

Extrapolating ``offset``: PostgreSQL reads and throws away the ``offset`` rows before a
page, so reading page i costs ``a + b·i``, growing linearly with its number; the rest of
a page (update, wait, commit) does not depend on where it is. The mode times both parts
of each page it visits before the time limit, fits the reads to ``a + b·i`` (least
squares on the medians of 40 runs of consecutive pages, so that pages slowed by other
work on the machine do not tilt the line) and averages the rest to ``r``; the pages it
did not reach (i = k … N - 1) are added as ``sum(a + b·i + r)``. The total is the
measured time plus that sum, marked ``≈`` and printed with the fit. A run that reaches
the end of the table in time is reported as measured.

The table ``bench_accounts(id bigint primary key, balance bigint)`` is made with
``INSERT … SELECT generate_series`` (ids 1…``--rows``) and reused when it already holds
exactly those ids. It is vacuumed before each mode, so no mode pays for the dead rows of
the one before. Each mode is checked: ``sum(balance)`` moved by exactly the rows it
visited, and, against a copy of the balances taken before it, those rows each rose by
exactly 1 and no other row changed (every row, for ``shardkit`` and ``keyset``).

For ``shardkit`` the table also gives the depth of its range tree (``status.depth``), its
pages and ranges, and the peak of memory allocated by this process while the job ran
(``tracemalloc``, all threads), next to what ``--page-size`` x ``--workers`` rows take
in memory (a page read through the job's source, measured the same way): the job holds
a page per worker, not the table. ``tracemalloc`` slows Python's allocations, so the
peak is measured in a second, traced run of the job (``--no-memory`` skips it); the
speed reported is that of the untraced run.

    python benchmarks/mapper.py                 # 5 ms of I/O wait per page
    python benchmarks/mapper.py --io-wait 0     # the database and CPU alone
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

import shardkit
from hot_counter import choose_modes, report_console
from shardkit.executor import LocalExecutor
from shardkit.mapper import Batch, KeyRange, TableSource
from shardkit.store.sql import SqlStore, engine_from_url

DEFAULT_STORE = "postgresql://postgres@127.0.0.1:5432/test"
TABLE = "bench_accounts"
MODES = ("shardkit", "keyset", "offset")
BASELINE = "keyset"
# The targets: shardkit ≥ 3x the keyset loop with 5 ms of I/O wait per page.
TARGET_RATIO = 3.0
TARGET_IO_WAIT = 0.005
UPDATE = sa.text(f"UPDATE {TABLE} SET balance = balance + 1 WHERE id = ANY(:ids)")
KEYSET = sa.text(f"SELECT id, balance FROM {TABLE} WHERE id > :last ORDER BY id LIMIT :page")
OFFSET = sa.text(f"SELECT id, balance FROM {TABLE} ORDER BY id LIMIT :page OFFSET :offset")
MB = 1024 * 1024
FIT_BINS = 40  # runs of consecutive pages whose median read times the offset fit uses


@dataclass
class Result:
    """One mode's run."""

    mode: str
    rows: int
    """Rows visited: the whole table, or (offset) those visited before the time limit."""
    seconds: float
    """Measured, or (``extrapolated``) the estimate for the whole table."""
    exact: bool
    cpu: float = 0.0
    """CPU seconds of this process (all threads) while the mode ran."""
    extrapolated: bool = False
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def work(conn: sa.Connection, ids: list[int], io_wait: float) -> None:
    """What every mode does with a page: the update, then the wait."""
    updated = conn.execute(UPDATE, {"ids": ids}).rowcount
    if updated != len(ids):
        raise RuntimeError(f"updated {updated} rows of a page of {len(ids)}")
    if io_wait > 0:
        time.sleep(io_wait)


def total_balance(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT sum(balance) FROM {TABLE}")).scalar_one())


def vacuum(engine: sa.Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"VACUUM (ANALYZE) {TABLE}"))


def prepare_table(engine: sa.Engine, rows: int, console: Console) -> None:
    """Make ``bench_accounts`` hold ids 1…rows, reusing it if it already does."""
    with engine.connect() as conn:
        found = conn.execute(
            sa.text(f"SELECT to_regclass('{TABLE}') IS NOT NULL AS present")
        ).scalar_one()
        if found:
            count, low, high = conn.execute(
                sa.text(f"SELECT count(*), min(id), max(id) FROM {TABLE}")
            ).one()
            if (count, low, high) == (rows, 1, rows):
                console.print(f"reusing [cyan]{TABLE}[/] ({rows:,} rows)")
                return
    started = time.perf_counter()
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {TABLE}"))
        conn.execute(sa.text(f"CREATE TABLE {TABLE} (id bigint NOT NULL, balance bigint NOT NULL)"))
        conn.execute(
            sa.text(f"INSERT INTO {TABLE} SELECT g, 0 FROM generate_series(1, :n) AS g"),
            {"n": rows},
        )
        conn.execute(sa.text(f"ALTER TABLE {TABLE} ADD PRIMARY KEY (id)"))
    vacuum(engine)
    console.print(
        f"created [cyan]{TABLE}[/] ({rows:,} rows) in {time.perf_counter() - started:.1f} s"
    )


def load() -> str:
    return " ".join(f"{n:.1f}" for n in os.getloadavg())


def accounts_table() -> sa.Table:
    return sa.Table(
        TABLE,
        sa.MetaData(),
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("balance", sa.BigInteger, nullable=False),
    )


def run_keyset(engine: sa.Engine, args: argparse.Namespace) -> Result:
    visited, last = 0, 0
    started = time.perf_counter()
    while True:
        with engine.begin() as conn:
            ids = [row.id for row in conn.execute(KEYSET, {"last": last, "page": args.page_size})]
            if not ids:
                break
            work(conn, ids, args.io_wait)
        visited += len(ids)
        last = ids[-1]
    return Result("keyset", visited, time.perf_counter() - started, exact=True)


def run_offset(engine: sa.Engine, args: argparse.Namespace) -> Result:
    pages = math.ceil(args.rows / args.page_size)
    reads: list[float] = []  # per page: the SELECT … OFFSET and its rows
    rests: list[float] = []  # per page: the work and the commit
    visited = 0
    started = time.perf_counter()
    while time.perf_counter() - started < args.offset_seconds:
        page_started = time.perf_counter()
        with engine.begin() as conn:
            result = conn.execute(OFFSET, {"page": args.page_size, "offset": visited})
            ids = [row.id for row in result]
            if not ids:
                break
            read = time.perf_counter()
            work(conn, ids, args.io_wait)
        visited += len(ids)
        reads.append(read - page_started)
        rests.append(time.perf_counter() - read)
    measured = time.perf_counter() - started
    if visited >= args.rows:
        return Result("offset", visited, measured, exact=True, note="whole table, measured")
    done = len(reads)
    if done < 2:
        raise SystemExit("offset: fewer than 2 pages before the time limit: raise --offset-seconds")
    a, b = fit_reads(reads)
    rest = statistics.fmean(rests)
    missing = sum(a + b * i + rest for i in range(done, pages))
    note = (
        f"{done:,} of {pages:,} pages in {measured:.1f} s; reading page i fitted (least squares "
        f"on the medians of {min(FIT_BINS, done)} runs of pages) as {a * 1e3:.2f} ms + "
        f"{b * 1e6:.2f} µs x i, the rest of a page (update, wait, commit) {rest * 1e3:.2f} ms "
        f"on average; pages {done:,}…{pages - 1:,} ≈ {missing:.1f} s by that fit"
    )
    return Result("offset", visited, measured + missing, exact=True, extrapolated=True, note=note)


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


def page_bytes(engine: sa.Engine, page_size: int) -> int:
    """Memory taken by one page of rows as the job's source returns them."""
    source = TableSource(accounts_table(), "id")
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


def run_shardkit(
    args: argparse.Namespace, prefix: str, *, traced: bool
) -> tuple[float, Any, int | None]:
    """Run the job on a kit of its own; (seconds, status, tracemalloc peak or None)."""
    io_wait = args.io_wait

    def fn(batch: Batch) -> None:
        work(batch.conn, [row["id"] for row in batch.rows], io_wait)

    executor = LocalExecutor(workers=args.workers)
    with shardkit.connect(args.store, "memory://", prefix=prefix, executor=executor) as kit:
        table = accounts_table()
        store = kit.store
        assert isinstance(store, SqlStore)
        with contextlib.ExitStack() as warm:  # the workers' connections, as the loops' is
            for _ in range(args.workers):
                warm.enter_context(store.engine.connect()).execute(sa.select(sa.literal(1)))
        peak = None
        if traced:
            tracemalloc.start()
        try:
            started = time.perf_counter()
            job = kit.map(
                table,
                fn,
                transactional=True,
                page_size=args.page_size,
                fanout=args.fanout,
            )
            status = job.wait(timeout=args.timeout)
            seconds = time.perf_counter() - started
            if traced:
                peak = tracemalloc.get_traced_memory()[1]
        finally:
            if traced:
                tracemalloc.stop()
        with store.engine.begin() as conn:  # the next run starts on empty ledger tables
            conn.execute(store.ranges_table.delete().where(store.ranges_table.c.job == job.id))
            conn.execute(store.jobs_table.delete().where(store.jobs_table.c.id == job.id))
    return seconds, status, peak


def shardkit_run(args: argparse.Namespace, prefix: str, *, traced: bool) -> Result:
    seconds, status, peak = run_shardkit(args, prefix, traced=traced)
    return Result(
        "shardkit (traced)" if traced else "shardkit",
        status.rows,
        seconds,
        exact=status.state == "complete",
        extra={
            "depth": status.depth,
            "pages": status.pages,
            "ranges": status.done + status.pending,
            "peak": peak,
        },
    )


class Balances:
    """The balances before a mode, copied to a table of their own, to check every row
    after it."""

    def __init__(self, engine: sa.Engine, table: str) -> None:
        self.engine = engine
        self.table = table

    def take(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.table}"))
            conn.execute(
                sa.text(f"CREATE UNLOGGED TABLE {self.table} AS SELECT id, balance FROM {TABLE}")
            )

    def changes(self) -> tuple[int, int]:
        """Rows whose balance rose by exactly 1, and rows that changed otherwise."""
        statement = sa.text(
            "SELECT count(*) FILTER (WHERE a.balance = s.balance + 1), "
            "count(*) FILTER (WHERE a.balance <> s.balance AND a.balance <> s.balance + 1) "
            f"FROM {TABLE} AS a FULL JOIN {self.table} AS s USING (id)"
        )
        with self.engine.connect() as conn:
            plus_one, other = conn.execute(statement).one()
        return int(plus_one), int(other)

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.table}"))


def checked(
    engine: sa.Engine, balances: Balances, run: Callable[[], Result], whole: bool, rows: int
) -> Result:
    """Run a mode (on a freshly vacuumed table) and check it: ``sum(balance)`` moved by
    the rows it visited, and exactly those rows, each by 1 (all of them if ``whole``)."""
    vacuum(engine)
    balances.take()
    before = total_balance(engine)
    cpu = time.process_time()
    result = run()
    result.cpu = time.process_time() - cpu
    moved = total_balance(engine) - before
    plus_one, other = balances.changes()
    result.exact = (
        result.exact
        and moved == plus_one == result.rows
        and other == 0
        and (not whole or result.rows == rows)
    )
    result.extra.update(moved=moved, plus_one=plus_one, other=other)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=DEFAULT_STORE, help=f"PostgreSQL URL ({DEFAULT_STORE})")
    parser.add_argument("--rows", type=int, default=1_000_000, help="table rows (1,000,000)")
    parser.add_argument("--page-size", type=int, default=500, help="rows per page (500)")
    parser.add_argument("--workers", type=int, default=8, help="shardkit's local workers (8)")
    parser.add_argument("--fanout", type=int, default=8, help="shardkit's fanout (8)")
    parser.add_argument(
        "--io-wait", type=float, default=0.005, help="seconds of sleep per page (0.005)"
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
        "--no-memory", action="store_true", help="skip shardkit's traced run (no peak memory)"
    )
    parser.add_argument("--modes", help=f"comma-separated, of {','.join(MODES)} (default all)")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.page_size < 1 or args.workers < 1 or args.fanout < 2:
        parser.error("--rows, --page-size and --workers must be >= 1, --fanout >= 2")
    if args.io_wait < 0 or not args.offset_seconds > 0 or not args.timeout > 0:
        parser.error("--io-wait must be >= 0, --offset-seconds and --timeout > 0")
    if not args.store.split(":", 1)[0].lower().startswith("postgresql"):
        parser.error("the benchmark needs PostgreSQL (--store postgresql://…)")
    args.modes = choose_modes(parser, args.modes, MODES, list(MODES))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console(width=140)
    prefix = f"skbench{uuid.uuid4().hex[:8]}_"
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        engine = engine_from_url(args.store)
        stack.callback(engine.dispose)
        prepare_table(engine, args.rows, console)
        console.print(
            f"store [cyan]{engine.url.render_as_string()}[/], {args.rows:,} rows, page "
            f"{args.page_size}, I/O wait {args.io_wait * 1e3:g} ms per page; shardkit: "
            f"{args.workers} local workers, fanout {args.fanout}; modes {', '.join(args.modes)}; "
            f"load average {load()}"
        )
        if "shardkit" in args.modes:
            # Create shardkit's tables now, to drop them at the end whatever happens.
            with shardkit.connect(args.store, "memory://", prefix=prefix) as kit:
                store = kit.store
                assert isinstance(store, SqlStore)
                stack.callback(store.metadata.drop_all, engine)
        balances = Balances(engine, f"{prefix}balances")
        stack.callback(balances.drop)
        runs: list[tuple[str, Callable[[], Result], bool]] = []
        for mode in args.modes:
            if mode == "shardkit":
                runs.append((mode, lambda: shardkit_run(args, prefix, traced=False), True))
                if not args.no_memory:
                    runs.append(
                        ("shardkit (traced)", lambda: shardkit_run(args, prefix, traced=True), True)
                    )
            elif mode == "keyset":
                runs.append((mode, lambda: run_keyset(engine, args), True))
            else:
                runs.append((mode, lambda: run_offset(engine, args), False))
        for name, run, whole in runs:
            console.print(f"running [bold]{name}[/]…")
            result = checked(engine, balances, run, whole, args.rows)
            results.append(result)
            console.print(
                f"  {result.mode}: {result.rows:,} rows visited in {result.seconds:.1f} s"
                f"{' (extrapolated to the whole table)' if result.extrapolated else ''}; "
                f"sum(balance) moved by {result.extra['moved']:,}; rows +1: "
                f"{result.extra['plus_one']:,}, rows changed otherwise: {result.extra['other']:,}"
                f": {'[green]exact[/]' if result.exact else '[red]WRONG[/]'}"
            )
        one_page = page_bytes(engine, args.page_size)
    console.print(f"load average {load()} ({os.cpu_count()} CPUs)")
    console.print(results_table(results, args))
    for line in notes(results, args, one_page):
        console.print(line)
    if all(r.exact for r in results):
        return 0
    console.print("[red]a check failed: the balances did not move by 1 on the rows visited[/]")
    return 1


def results_table(results: list[Result], args: argparse.Namespace) -> Table:
    table = Table(
        title=(
            f"Visiting {args.rows:,} rows, {args.page_size} per page, "
            f"{args.io_wait * 1e3:g} ms I/O wait per page"
        )
    )
    columns = ("mode", "rows", "seconds", "rows/s", f"vs {BASELINE}", "CPU s", "checked")
    extra = ("depth", "pages", "ranges", "peak MB")
    for column in (*columns, *extra):
        table.add_column(column, justify="left" if column == "mode" else "right")
    base = next((r for r in results if r.mode == BASELINE), None)
    for r in results:
        whole = args.rows if r.extrapolated else r.rows
        rate = whole / r.seconds
        vs = f"{rate / (base.rows / base.seconds):.2f}x" if base else "-"
        seconds = f"≈ {r.seconds:,.1f}" if r.extrapolated else f"{r.seconds:,.1f}"
        if not r.exact:
            checked_text = "[red]✗[/]"
        elif r.extrapolated:
            checked_text = f"[green]✓[/] +1 on {r.rows:,} visited"
        else:
            checked_text = "[green]✓[/] +1 each"
        cells = [
            r.mode + (" (extrapolated)" if r.extrapolated else ""),
            f"{whole:,}",
            seconds,
            f"{rate:,.0f}",
            vs,
            f"{r.cpu:.1f}",
            checked_text,
        ]
        if r.mode.startswith("shardkit"):
            peak = r.extra["peak"]
            cells += [
                str(r.extra["depth"]),
                f"{r.extra['pages']:,}",
                f"{r.extra['ranges']:,}",
                "-" if peak is None else f"{peak / MB:.1f}",
            ]
        else:
            cells += ["-"] * len(extra)
        table.add_row(*cells)
    return table


def notes(results: list[Result], args: argparse.Namespace, one_page: int) -> list[str]:
    lines = [f"[dim]offset: {r.note}[/]" for r in results if r.mode == "offset" and r.note]
    lines.append(
        "[dim]CPU s: CPU time of this Python process (all its threads) during the mode; "
        "the database's own CPU is not included[/]"
    )
    reference = one_page * args.workers
    whole_table = one_page / args.page_size * args.rows
    for r in results:
        if r.mode.startswith("shardkit") and r.extra["peak"] is not None:
            lines.append(
                f"shardkit memory: peak {r.extra['peak'] / MB:.1f} MB allocated during the job "
                f"(tracemalloc); {args.page_size} rows x {args.workers} workers = "
                f"{reference / MB:.1f} MB ({one_page / 1024:.0f} KB a page); the whole table "
                f"as rows would be ≈ {whole_table / MB:,.0f} MB"
            )
        if r.mode == "shardkit (traced)":
            lines.append(
                "[dim]shardkit (traced) is the same job run again under tracemalloc, for its "
                "peak; its speed is not the one compared[/]"
            )
    ran = {r.mode: r for r in results}
    if "shardkit" in ran and BASELINE in ran:
        fast, base = ran["shardkit"], ran[BASELINE]
        ratio = (fast.rows / fast.seconds) / (base.rows / base.seconds)
        mark = "[green]✓[/]" if ratio >= TARGET_RATIO else "[red]✗[/]"
        where = (
            ""
            if math.isclose(args.io_wait, TARGET_IO_WAIT)
            else f" (the target is for {TARGET_IO_WAIT * 1e3:g} ms; this run waits "
            f"{args.io_wait * 1e3:g} ms)"
        )
        lines.append(
            f"target: shardkit ÷ keyset ≥ {TARGET_RATIO:g}x with {TARGET_IO_WAIT * 1e3:g} ms "
            f"I/O wait per page{where}: {ratio:.2f}x {mark}; depth "
            f"{fast.extra['depth']} reported"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
