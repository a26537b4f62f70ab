"""The example FastAPI service under uvicorn, loaded over HTTP by wrk: one hot item
counted per request, side by side with the plain way.

* row      - ``UPDATE row SET n = n + 1`` on one row, through SQLAlchemy's async engine
             (psycopg), in its own transaction: a counter written without shardkit
* sharded  - ``POST /items/hot/view``: the item's sharded counter (32 shards)
* upsert   - the same written by hand: an upsert of a random one of 32 rows, through the
             same engine, autocommitted
* buffered - ``POST /items/hot/hit``: the item's buffered counter (flushed every second
             on the event loop)
* incr     - the same written by hand, without flushes: redis-py's async ``INCR``
* noop     - an endpoint that does nothing: the framework's (and this machine's) ceiling

Each repetition runs the modes one further on (every mode takes each place). The table
gives each endpoint against the row, the no-op and its hand-written form.

The service (``examples/fastapi_app``, the plain endpoints in ``benchmarks/service_bench``)
runs under uvicorn (``--workers``) on a PostgreSQL database of the benchmark's own
(created if missing) and a Redis cache; wrk (Debian's package) POSTs to each endpoint
with ``--connections`` for ``--seconds``. Every cell is checked: the count moved equals
the completed responses, give or take those in flight when this run and the one before
stopped (one per connection each), with no error.

    pip install -e '.[test,bench]' && apt-get install wrk
    python benchmarks/fastapi_app.py --cache redis://127.0.0.1:6379/12 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from rich.table import Table

import shardkit
from django_counts import create_database
from hot_counter import choose_modes, report_console
from http_load import Cell, free_port, serving, wrk

HERE = Path(__file__).resolve().parent
SERVICE = HERE.parent / "examples" / "fastapi_app"
DEFAULT_DATABASE = "postgresql://postgres@127.0.0.1:5432/shardkit_bench_fastapi"
MODES = ("row", "sharded", "upsert", "buffered", "incr", "noop")
BASELINE = "row"
PATHS = {
    "row": "/row",
    "sharded": "/items/hot/view",
    "upsert": "/upsert",
    "buffered": "/items/hot/hit",
    "incr": "/incr",
}
BY_HAND = {"sharded": "upsert", "buffered": "incr"}  # each counter's hand-written form
TARGETS = {"sharded": 0.8, "buffered": 0.8}  # the least ratio to the no-op endpoint
PREFIX = "bench_fastapi_"
POST = 'wrk.method = "POST"\n'


def prepare(database: str) -> sa.Engine:
    """Create the database if missing, and its plain row; an engine on it."""
    create_database(database)
    engine = sa.create_engine(database.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"CREATE TABLE IF NOT EXISTS {PREFIX}row (id INT PRIMARY KEY, n BIGINT NOT NULL)"
            )
        )
        conn.execute(sa.text(f"INSERT INTO {PREFIX}row VALUES (1, 0) ON CONFLICT DO NOTHING"))
        conn.execute(
            sa.text(
                f"CREATE TABLE IF NOT EXISTS {PREFIX}upsert (id INT PRIMARY KEY, n BIGINT NOT NULL)"
            )
        )
    return engine


def count_of(mode: str, engine: sa.Engine, kit: shardkit.Kit, cache: Any) -> int:
    """The hot item's count of ``mode`` now (a buffered count's stored plus pending)."""
    if mode in ("row", "upsert"):
        query = f"SELECT coalesce(sum(n), 0) FROM {PREFIX}{mode}"
        with engine.connect() as conn:
            return int(conn.execute(sa.text(query)).scalar_one())
    if mode == "incr":
        return int(cache.get(f"{PREFIX}incr") or 0)
    if mode == "sharded":
        return kit.store.total("views:hot")
    if mode == "buffered":
        return kit.parts(["hits:hot"])["hits:hot"].total
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", default=DEFAULT_DATABASE, help="PostgreSQL URL")
    parser.add_argument("--cache", default="redis://127.0.0.1:6379/12", help="cache URL")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn workers (2)")
    parser.add_argument("--connections", type=int, default=64, help="wrk connections (64)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per run (5)")
    parser.add_argument("--repeat", type=int, default=3, help="median of N runs (3)")
    parser.add_argument("--modes", help=f"comma-separated, of {','.join(MODES)}")
    args = parser.parse_args(argv)
    args.modes = choose_modes(parser, args.modes, MODES, list(MODES))
    if min(args.workers, args.connections, args.repeat) < 1:
        parser.error("--workers, --connections and --repeat must be >= 1")
    if shutil.which("wrk") is None:
        parser.error("wrk is missing: apt-get install wrk")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console()
    engine = prepare(args.database)
    port = free_port()
    paths = [str(SERVICE), str(HERE), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "SHARDKIT_BENCH_DATABASE": args.database,
        "SHARDKIT_BENCH_CACHE": args.cache,
    }
    command = [
        sys.executable, "-m", "uvicorn", "service_bench:app", "--host", "127.0.0.1",
        "--port", str(port), "--workers", str(args.workers), "--no-access-log",
        "--log-level", "warning",
    ]  # fmt: skip
    console.print(
        f"uvicorn {args.workers} worker(s), wrk {args.connections} connections, "
        f"{args.seconds:g} s per run, {args.repeat} run(s); database "
        f"{sa.make_url(args.database).render_as_string()}, cache {args.cache}; load average "
        f"{' '.join(f'{n:.1f}' for n in os.getloadavg())}"
    )
    cells: dict[str, Cell] = {mode: Cell() for mode in args.modes}
    with (
        tempfile.NamedTemporaryFile("w", suffix=".lua") as script,
        shardkit.connect(args.database, args.cache, prefix=PREFIX) as kit,
        redis.Redis.from_url(args.cache) as cache,
        serving(command, env, port, "/noop") as base,
    ):
        script.write(POST)
        script.flush()
        for mode in args.modes:  # warm every worker's connections and counters
            wrk(base + PATHS.get(mode, "/noop"), args.connections, 1, script=script.name)
        for number in range(args.repeat):
            turn = number % len(args.modes)  # each repetition starts one mode further on
            for mode in args.modes[turn:] + args.modes[:turn]:
                with console.status(f"{mode}, run {number + 1}…"):
                    before = count_of(mode, engine, kit, cache)
                    load = wrk(
                        base + PATHS.get(mode, "/noop"),
                        args.connections,
                        args.seconds,
                        script=None if mode == "noop" else script.name,
                    )
                    moved = count_of(mode, engine, kit, cache) - before
                cell = cells[mode]
                cell.rates.append(load.rate)
                # Requests in flight when a wrk run stops are served after it: counted in
                # this run (at most one per connection) or, from the run before, after
                # ``before`` was read (as many more).
                surplus = moved - load.completed
                if load.failed or not (mode == "noop" or 0 <= surplus <= 2 * args.connections):
                    cell.exact = False
                    cell.notes.append(
                        f"{load.completed} done, {moved} counted, {load.failed} failed"
                    )
    console.print(results_table(cells, args.modes))
    console.print(targets_line(cells, args.modes))
    for mode, cell in cells.items():
        for note in cell.notes:
            console.print(f"[red]{mode}: {note}[/]")
    return 0 if all(cell.exact for cell in cells.values()) else 1


def results_table(cells: dict[str, Cell], modes: list[str]) -> Table:
    table = Table(title="One hot item counted per request, over HTTP (requests/s, medians)")
    columns = ("endpoint", "requests/s", f"vs {BASELINE}", "vs noop", "vs by hand", "checked")
    for column in (*columns, "runs"):
        table.add_column(column, justify="left" if column in ("endpoint", "runs") else "right")
    for mode in modes:
        cell = cells[mode]
        table.add_row(
            mode,
            f"{cell.rate:,.0f}",
            ratio(cells, mode, BASELINE),
            ratio(cells, mode, "noop"),
            ratio(cells, mode, BY_HAND.get(mode)),
            "[green]✓[/]" if cell.exact else "[red]✗[/]",
            " ".join(f"{rate:,.0f}" for rate in cell.rates),
        )
    return table


def ratio(cells: dict[str, Cell], mode: str, to: str | None) -> str:
    """``mode``'s rate over ``to``'s, or "-" when either was not run."""
    if to is None or to not in cells or mode == to:
        return "-"
    return f"{cells[mode].rate / cells[to].rate:.2f}x"


def targets_line(cells: dict[str, Cell], modes: list[str]) -> str:
    """Each counter's target against the no-op endpoint, beside the same ratio of its
    hand-written form (the ceiling this machine allows it)."""
    if "noop" not in modes:
        return ""
    parts = []
    for mode, least in TARGETS.items():
        if mode in modes:
            got = cells[mode].rate / cells["noop"].rate
            mark = "[green]✓[/]" if got >= least else "[red]✗[/]"
            part = f"{mode} ÷ noop {got:.2f}x (target ≥ {least:g}x) {mark}"
            hand = BY_HAND[mode]
            if hand in modes:
                part += f", its hand-written form ÷ noop {ratio(cells, hand, 'noop')}"
            parts.append(part)
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
