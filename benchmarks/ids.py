"""Unique ids from many writer processes: the id allocator against PostgreSQL's own.

* nextval          - ``SELECT nextval('<seq>')``: raw psycopg, autocommit
* update-returning - ``UPDATE t SET n = n + 1 WHERE id = 1 RETURNING n`` on a one-row table:
                     raw psycopg, autocommit
* ids              - ``kit.ids(name, block, sub_block).next()`` with the in-process cache
                     ``memory://``: each process reserves its own blocks in the store
* ids-redis        - the same with a Redis ``--cache`` (only when one is given): the
                     processes share blocks, each taking ``sub_block`` ids of one at a time
                     with one Redis ``INCRBY`` (``--sub-block 1``: one per id, one
                     increasing sequence across processes)

Every cell is checked. The raw modes: the sequence or the row moved by exactly the
acknowledged calls. The allocator's modes: each writer records the ids it was handed as
runs of consecutive ids and reports them; across all writers and runs of a mode no id was
handed out twice, each writer's ids increase, their number is the acknowledged calls,
and none lies above ``reserved()``. The targets at 16 writers: ids ÷ nextval ≥ 10x,
ids-redis ÷ nextval ≥ 3x.

    python benchmarks/ids.py --cache redis://127.0.0.1:6379/12 --writers 1,16 \\
        --seconds 3 --repeat 5
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from rich.table import Table

import shardkit
from harness import (
    Crew,
    Op,
    Phase,
    Reports,
    Setup,
    Tally,
    forget_redis_keys,
    median_phase,
    ratio,
    run_grid,
)
from hot_counter import (
    REDIS_SCHEMES,
    _redis_client,
    choose_modes,
    raw_connect,
    report_console,
)
from shardkit import metrics
from shardkit.counters.ids import SUB_BLOCK
from shardkit.store.sql import SqlStore, engine_from_url

DEFAULT_STORE = "postgresql://postgres@127.0.0.1:5432/test"
MODES = ("nextval", "update-returning", "ids", "ids-redis")
RAW_MODES = ("nextval", "update-returning")
ALLOCATOR_MODES = ("ids", "ids-redis")
# The targets: each allocator mode at this many writers, against nextval.
TARGET_WRITERS = 16
TARGETS = {"ids": 10.0, "ids-redis": 3.0}


@dataclass(frozen=True)
class RawTarget:
    """What a raw-psycopg writer needs: the resolved URL, the sequence and the table."""

    url: str
    """SQLAlchemy URL, password included."""
    sequence: str
    table: str


@dataclass(frozen=True)
class IdsTarget:
    """What an allocator writer needs: the kit's URLs, the allocator, where to report."""

    store_url: str
    cache_url: str
    prefix: str
    name: str
    block: int
    sub_block: int
    report_dir: str
    """Each writer leaves a JSON file here with the ids it was handed."""


@contextlib.contextmanager
def raw_nextval(target: RawTarget) -> Iterator[Op]:
    """``SELECT nextval('seq')``, fetching the value."""
    conn = raw_connect(target.url)
    try:
        cursor = conn.cursor()
        cursor.execute("SELECT 1").fetchone()
        sql = f"SELECT nextval('{target.sequence}')"
        yield lambda: cursor.execute(sql).fetchone()
    finally:
        conn.close()


@contextlib.contextmanager
def raw_update_returning(target: RawTarget) -> Iterator[Op]:
    """``UPDATE t SET n = n + 1 WHERE id = 1 RETURNING n``, fetching the value."""
    conn = raw_connect(target.url)
    try:
        cursor = conn.cursor()
        cursor.execute(f"UPDATE {target.table} SET n = n + 0 WHERE id = 1 RETURNING n").fetchone()
        sql = f"UPDATE {target.table} SET n = n + 1 WHERE id = 1 RETURNING n"
        yield lambda: cursor.execute(sql).fetchone()
    finally:
        conn.close()


@contextlib.contextmanager
def ids_writer(target: IdsTarget) -> Iterator[Op]:
    """``kit.ids(name, block, sub_block).next()``, recording the ids and counting the
    blocks the process reserves; both backends are reached by ``connect`` and
    ``kit.ids``, and no id is taken before the phase."""
    with shardkit.connect(target.store_url, target.cache_url, prefix=target.prefix) as kit:
        ids = kit.ids(target.name, block=target.block, sub_block=target.sub_block)
        tally = Tally(ids.next)
        before = blocks_reserved()
        yield tally.op
        after = blocks_reserved()
    tally.close()
    counted = None if before is None or after is None else round(after - before)
    tally.report(Path(target.report_dir), counted)


def blocks_reserved() -> float | None:
    """The id blocks this process has reserved, as its metrics count them (None with
    metrics off: ``prometheus_client`` missing)."""
    if not metrics.meter.enabled:
        return None
    found = metrics.prometheus().REGISTRY.get_sample_value("shardkit_id_blocks_total")
    return None if found is None else float(found)


@dataclass
class Cell:
    """Repeated phases of one mode at one writer count."""

    phases: list[Phase]
    exact: bool = True
    store_txns: list[float] = field(default_factory=list)
    """Store transactions per second of each phase (blocks reserved, for the allocator:
    NaN where the writers could not count them)."""
    taken: int = 0
    """The allocator's ids handed out in all phases."""
    reserved: int = 0
    """The allocator's ids reserved in the store in all phases."""

    @property
    def rate(self) -> float:
        return median_phase(self.phases)


@dataclass(frozen=True)
class Mode:
    """How to run one mode and check one phase of it."""

    setup: Setup[Any]
    arg: Any
    before: Callable[[], int]
    """Reads the value the phase must move (the sequence, the row, ``reserved()``)."""
    check: Callable[[Cell, Phase, int], bool]
    """Given the phase and ``before``'s value, records and checks what it did."""


def _is_postgresql(url: str) -> bool:
    return sa.make_url(url).get_backend_name() == "postgresql"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--store", default=DEFAULT_STORE, help=f"store URL (default {DEFAULT_STORE})"
    )
    parser.add_argument(
        "--cache", help="a Redis cache URL for ids-redis (ids always uses memory://)"
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per run (3)")
    parser.add_argument("--writers", default="1,16", help="writer counts (1,16)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell; medians (3)")
    parser.add_argument("--block", type=int, default=1000, help="the allocator's block (1000)")
    parser.add_argument(
        "--sub-block",
        type=int,
        default=SUB_BLOCK,
        help=f"ids a writer takes from a block at a time ({SUB_BLOCK}; 1: one sequence)",
    )
    parser.add_argument(
        "--modes",
        help=f"comma-separated, of {','.join(MODES)} (default: all that apply; the raw "
        "modes need a PostgreSQL --store, ids-redis a Redis --cache)",
    )
    args = parser.parse_args(argv)
    try:
        args.writer_counts = [int(w) for w in args.writers.split(",")]
    except ValueError:
        parser.error("--writers takes comma-separated integers")
    if min(args.writer_counts) < 1 or args.repeat < 1 or not args.seconds > 0:
        parser.error("writers and --repeat must be >= 1, --seconds > 0")
    if not (1 <= args.block <= 2**40 and 1 <= args.sub_block <= 2**40):
        parser.error("--block and --sub-block must be in 1..2**40")
    redis = args.cache is not None and args.cache.split(":", 1)[0].lower() in REDIS_SCHEMES
    if args.cache is not None and not redis:
        parser.error("--cache must be a Redis URL (redis://, rediss:// or unix://)")
    postgresql = _is_postgresql(args.store)
    default = [
        m for m in MODES if (postgresql or m not in RAW_MODES) and (redis or m != "ids-redis")
    ]
    args.modes = choose_modes(parser, args.modes, MODES, default)
    if "ids-redis" in args.modes and not redis:
        parser.error("ids-redis needs a Redis --cache")
    if set(args.modes) & set(RAW_MODES) and not postgresql:
        parser.error("nextval and update-returning need a PostgreSQL --store")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console()
    prefix = f"skids{uuid.uuid4().hex[:8]}_"
    modes: list[str] = args.modes
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shardkit-ids-")))
        kit = stack.enter_context(shardkit.connect(args.store, "memory://", prefix=prefix))
        store = kit.store
        assert isinstance(store, SqlStore)
        engine = engine_from_url(args.store)
        stack.callback(engine.dispose)
        stack.callback(store.metadata.drop_all, engine)
        runs: dict[str, Mode] = {}

        if set(modes) & set(RAW_MODES):
            sequence, table = f"{prefix}seq", f"{prefix}row"
            with engine.begin() as conn:
                conn.exec_driver_sql(f"CREATE SEQUENCE {sequence}")
                conn.exec_driver_sql(
                    f"CREATE TABLE {table} (id int PRIMARY KEY, n bigint NOT NULL)"
                )
                conn.exec_driver_sql(f"INSERT INTO {table} VALUES (1, 0)")

            def drop_raw() -> None:
                with engine.begin() as conn:
                    conn.exec_driver_sql(f"DROP SEQUENCE IF EXISTS {sequence}")
                    conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")

            stack.callback(drop_raw)
            raw = RawTarget(engine.url.render_as_string(hide_password=False), sequence, table)

            def read(sql: str) -> Callable[[], int]:
                def value() -> int:
                    with engine.connect() as conn:
                        return int(conn.exec_driver_sql(sql).scalar_one())

                return value

            def check_raw(read_after: Callable[[], int]) -> Callable[[Cell, Phase, int], bool]:
                def check(cell: Cell, phase: Phase, before: int) -> bool:
                    cell.store_txns.append(phase.rate)  # one autocommit statement a call
                    return read_after() - before == phase.ops

                return check

            # The sequence's value: 0 until the first nextval.
            seq_value = read(
                f"SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {sequence}"
            )
            row_value = read(f"SELECT n FROM {table} WHERE id = 1")
            runs["nextval"] = Mode(raw_nextval, raw, seq_value, check_raw(seq_value))
            runs["update-returning"] = Mode(
                raw_update_returning, raw, row_value, check_raw(row_value)
            )

        if args.cache is not None:  # the allocator's keys are deleted at the end
            redis = _redis_client(args.cache)
            stack.callback(redis.close)
            stack.callback(forget_redis_keys, redis, kit.namespace)
        reports: dict[str, Reports] = {}
        for mode in ALLOCATOR_MODES:
            if mode not in modes:
                continue
            allocator = kit.ids(mode, block=args.block)  # creates it in the store
            folder = scratch / mode
            folder.mkdir()
            cache = args.cache if mode == "ids-redis" else "memory://"
            target = IdsTarget(
                args.store, cache, prefix, mode, args.block, args.sub_block, str(folder)
            )
            reports[mode] = Reports()
            runs[mode] = Mode(
                ids_writer,
                target,
                allocator.reserved,
                allocator_check(allocator.reserved, reports[mode], folder),
            )

        console.print(
            f"store [cyan]{store.url}[/], cache for ids-redis [cyan]{args.cache or '-'}[/], "
            f"{args.seconds:g} s per run, {args.repeat} run(s) per cell, block {args.block}, "
            f"sub-block {args.sub_block}; "
            f"modes {', '.join(modes)}"
        )
        cells: dict[tuple[int, str], Cell] = {}

        def measure(crew: Crew, writers: int, mode: str) -> None:
            cell = cells.setdefault((writers, mode), Cell([]))
            spec = runs[mode]
            before = spec.before()
            phase = crew.run(spec.setup, spec.arg, args.seconds)
            cell.phases.append(phase)
            cell.exact = spec.check(cell, phase, before) and cell.exact

        run_grid(args.writer_counts, args.repeat, modes, measure, console)
        console.print(results_table(cells, args.writer_counts, modes, args.repeat))
        for mode, got in reports.items():
            if got.backwards or got.doubled:
                console.print(
                    f"[red]{mode}: {got.doubled:,} ids handed out twice, "
                    f"{got.backwards:,} times a writer's ids went backwards[/]"
                )
        console.print(target_summary(cells, args.writer_counts, modes))
        if "ids" in modes:
            console.print(
                "[dim]ids: memory:// is a cache per process, so each writer takes ids from "
                "blocks of its own: one store transaction per block, no round trip per id.[/]"
            )
    if all(cell.exact for cell in cells.values()):
        return 0
    console.print("[red]a check failed (see the 'checked' column)[/]")
    return 1


def allocator_check(
    reserved: Callable[[], int], reports: Reports, folder: Path
) -> Callable[[Cell, Phase, int], bool]:
    """After a phase: the writers handed out as many ids as they acknowledged, none
    twice (in any phase of this mode), each writer's increasing, none above
    ``reserved()``; records the blocks reserved per second (as the writers counted
    them: blocks grow) and the share of reserved ids handed out."""

    def check(cell: Cell, phase: Phase, before: int) -> bool:
        mark = reserved()
        faults = reports.backwards + reports.doubled
        taken, largest = reports.collect(folder)
        blocks = math.nan if reports.blocks is None else reports.blocks
        cell.store_txns.append(blocks / statistics.fmean(phase.elapsed))
        cell.taken += taken
        cell.reserved += mark - before
        clean = reports.backwards + reports.doubled == faults
        return clean and taken == phase.ops and largest <= mark

    return check


def _rate(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.1f}"


def results_table(
    cells: dict[tuple[int, str], Cell], counts: list[int], modes: list[str], repeat: int
) -> Table:
    table = Table(title="Unique ids: acknowledged ids per second")
    columns = ["writers", "mode", "ids/s", "vs nextval", "CPU µs/id", "store txns/s", "ids used"]
    for column in [*columns, "checked"]:
        table.add_column(column, justify="left" if column == "mode" else "right")
    if repeat > 1:
        table.add_column("runs (ids/s)", justify="left")
    for writers in counts:
        for mode in modes:
            cell = cells[writers, mode]
            row = [
                str(writers),
                mode,
                f"{cell.rate:,.0f}",
                ratio(cells, writers, mode, "nextval"),
                f"{statistics.median(p.cpu_per_op for p in cell.phases) * 1e6:,.1f}",
                _rate(statistics.median(cell.store_txns)),
                f"{cell.taken / cell.reserved:.1%}" if cell.reserved else "-",
                "[green]✓[/]" if cell.exact else "[red]✗[/]",
            ]
            if repeat > 1:
                row.append(" ".join(f"{p.rate:,.0f}" for p in cell.phases))
            table.add_row(*row, end_section=mode == modes[-1])
    return table


def target_summary(cells: dict[tuple[int, str], Cell], counts: list[int], modes: list[str]) -> str:
    """Each allocator mode against its target, at 16 writers (or the most run)."""
    writers = TARGET_WRITERS if TARGET_WRITERS in counts else max(counts)
    note = "" if writers == TARGET_WRITERS else f" (the target is for {TARGET_WRITERS})"
    head = f"targets at {writers} writers{note}, ÷ nextval: " + ", ".join(
        f"{mode} ≥ {target:g}x" for mode, target in TARGETS.items()
    )
    if "nextval" not in modes:
        return f"{head}: run nextval alongside to compare"
    parts = []
    for mode in ALLOCATOR_MODES:
        if mode in modes:
            ratio = cells[writers, mode].rate / cells[writers, "nextval"].rate
            met = "[green]met ✓[/]" if ratio >= TARGETS[mode] else "[red]not met ✗[/]"
            parts.append(f"{mode} {ratio:.2f}x {met}")
    return f"{head}: " + ("; ".join(parts) if parts else "no allocator mode run")


if __name__ == "__main__":
    sys.exit(main())
