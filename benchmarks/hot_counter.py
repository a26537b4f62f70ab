"""One hot counter hammered by many writer processes, three ways, side by side.

* naive   - ``UPDATE … SET n = n + 1`` on one row: raw driver, autocommit
* upsert  - raw driver upsert (``ON CONFLICT`` / ``ON DUPLICATE KEY``) on a random one of
            ``--shards`` rows of a table shaped like shardkit's shard table, autocommit
* sharded - ``kit.sharded(name, shards).incr()``

The raw driver is the store's own: psycopg, PyMySQL or sqlite3. Every cell checks that
the counter moved by exactly the number of acknowledged writes.

    python benchmarks/hot_counter.py --store postgresql://postgres@127.0.0.1:5432/test \\
        --cache redis://127.0.0.1:6379/12 --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sqlite3
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

import shardkit
from shardkit.demo import (
    Crew,
    Op,
    Phase,
    Setup,
    Target,
    median_phase,
    naive_table,
    sharded_writer,
)
from shardkit.store.sql import SqlStore, engine_from_url

MODES = ("naive", "upsert", "sharded")


@dataclass(frozen=True)
class RawTarget:
    """What a raw-driver writer needs: the resolved URL and its tables."""

    url: str
    """SQLAlchemy URL naming the driver, password included."""
    naive_table: str
    shard_table: str
    name: str
    shards: int


def raw_connect(url: str) -> Any:
    """An autocommit DB-API connection of the store's own driver."""
    parsed = sa.make_url(url)
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        import psycopg

        return psycopg.connect(
            host=parsed.host or "localhost",
            port=parsed.port or 5432,
            user=parsed.username,
            password=parsed.password,
            dbname=parsed.database,
            autocommit=True,
        )
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
    return sqlite3.connect(parsed.database or "", timeout=60, isolation_level=None)


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


def totals(store: SqlStore, naive: sa.Table, shard: sa.Table, name: str) -> dict[str, int]:
    """The current value of each mode's counter."""
    with store.engine.connect() as conn:
        n = conn.execute(sa.select(naive.c.n)).scalar_one()
        upserted = conn.execute(sa.select(sa.func.sum(shard.c.value))).scalar()
    return {"naive": int(n), "upsert": int(upserted or 0), "sharded": store.total(name)}


@dataclass
class Cell:
    """Repeated phases of one mode at one writer count."""

    phases: list[Phase]
    exact: bool = True

    @property
    def rate(self) -> float:
        return median_phase(self.phases)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", help="store URL (default: a temporary SQLite file)")
    parser.add_argument("--cache", default="memory://", help="cache URL (default memory://)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per cell (3)")
    parser.add_argument("--writers", default="1,4,16", help="writer counts (1,4,16)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell; medians shown")
    parser.add_argument("--shards", type=int, default=20, help="shards (20)")
    args = parser.parse_args(argv)
    args.writer_counts = [int(w) for w in args.writers.split(",")]
    if min(args.writer_counts) < 1 or args.repeat < 1 or not args.seconds > 0:
        parser.error("writers and --repeat must be >= 1, --seconds > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    tag = uuid.uuid4().hex[:8]
    prefix = f"skbench{tag}_"
    with contextlib.ExitStack() as stack:
        store_url: str = args.store or ""
        if not store_url:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="shardkit-bench-"))
            store_url = f"sqlite:///{Path(folder) / 'bench.db'}"
        kit = stack.enter_context(shardkit.connect(store_url, args.cache, prefix=prefix))
        store = kit.store
        assert isinstance(store, SqlStore)
        engine = engine_from_url(store_url)
        stack.callback(engine.dispose)
        stack.callback(store.metadata.drop_all, engine)
        md = sa.MetaData()
        naive = naive_table(f"{prefix}naive", md)
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
        sharded = Target(store_url, args.cache, "hot", prefix=prefix)
        runs: dict[str, tuple[Setup[Any], Any]] = {
            "naive": (raw_naive, raw),
            "upsert": (raw_upsert, raw),
            "sharded": (sharded_writer, sharded),
        }
        console.print(
            f"store [cyan]{store.url}[/], cache [cyan]{kit.cache.url}[/], "
            f"{args.seconds:g} s per run, {args.repeat} run(s) per cell, {args.shards} shards"
        )
        cells: dict[tuple[int, str], Cell] = {}
        for writers in args.writer_counts:
            with Crew(writers) as crew:
                for run in range(args.repeat):
                    for mode in MODES:
                        with console.status(f"{writers} writers, {mode}, run {run + 1}…"):
                            cell = cells.setdefault((writers, mode), Cell([]))
                            before = totals(store, naive, shard, raw.name)[mode]
                            setup, arg = runs[mode]
                            phase = crew.run(setup, arg, args.seconds)
                            moved = totals(store, naive, shard, raw.name)[mode] - before
                            cell.phases.append(phase)
                            cell.exact = cell.exact and moved == phase.ops
        console.print(results_table(cells, args.writer_counts, args.repeat))
    if all(cell.exact for cell in cells.values()):
        return 0
    console.print("[red]a total differed from the acknowledged writes[/]")
    return 1


def results_table(cells: dict[tuple[int, str], Cell], counts: list[int], repeat: int) -> Table:
    table = Table(title="One hot counter: acknowledged increments per second")
    for column in ("writers", "mode", "ops/s", "vs naive", "vs upsert", "exact"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    if repeat > 1:
        table.add_column("runs (ops/s)", justify="left")
    for writers in counts:
        base, upsert = cells[writers, "naive"].rate, cells[writers, "upsert"].rate
        for mode in MODES:
            cell = cells[writers, mode]
            row = [
                str(writers),
                mode,
                f"{cell.rate:,.0f}",
                f"{cell.rate / base:.2f}x",
                f"{cell.rate / upsert:.2f}x",
                "[green]✓[/]" if cell.exact else "[red]✗[/]",
            ]
            if repeat > 1:
                row.append(" ".join(f"{p.rate:,.0f}" for p in cell.phases))
            table.add_row(*row, end_section=mode == MODES[-1])
    return table


if __name__ == "__main__":
    sys.exit(main())
