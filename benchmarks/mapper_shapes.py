"""``kit.map`` against the split written by hand in every shape: page sizes, workers, I/O
wait, and what ``fn`` reads of a page, in one run.

Each shape is a run of ``mapper.py`` (its ``measure``) on sequential integer keys with the
modes ``shardkit`` (a transactional ``kit.map``) and ``fixed`` (``--workers`` key ranges
cut between ``min(id)`` and ``max(id)``, a keyset loop in a thread each), ``--repeat``
rounds with the modes taking turns, each mode's median round. Every shape's runs are
checked as ``mapper.py`` checks them (every row +1, no other change). Each shape runs
in a Python process of its own, as a job runs in a worker: the kits each run opens leave
objects behind in SQLAlchemy's caches, which the collector's full passes in the runs
after it would go through again. The table gives, per shape, both rates, their ratio
(target ≥ 0.9x) and the ratio of the process's CPU seconds (target ≤ 1.15x), with the
rounds' spread; a line per shape as it ends.

    python benchmarks/mapper_shapes.py                     # 3 x 3 x 2 x 2 shapes
    python benchmarks/mapper_shapes.py --page-sizes 100 --io-waits 0 --batches rows
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor

from rich.table import Table

import mapper
from hot_counter import report_console

TARGET_RATE = 0.9
TARGET_CPU = 1.15


def measured(argv: list[str]) -> list[mapper.Result]:
    """``mapper.measure`` of one shape, its progress not printed."""
    quiet = report_console(width=160)
    quiet.quiet = True
    results, _, _ = mapper.measure(mapper.parse_args(argv), quiet)
    return results


def parts(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=mapper.DEFAULT_STORE, help="PostgreSQL URL")
    parser.add_argument("--rows", type=int, default=1_000_000, help="table rows (1,000,000)")
    parser.add_argument("--page-sizes", default="100,500,2000", help="(100,500,2000)")
    parser.add_argument("--workers", default="4,8,16", help="worker counts (4,8,16)")
    parser.add_argument("--io-waits", default="0,0.005", help="seconds of sleep per page")
    parser.add_argument("--batches", default="records,rows", help="what fn reads")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per shape (3)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console(width=160)
    shapes = list(
        itertools.product(
            [int(n) for n in parts(args.page_sizes)],
            [int(n) for n in parts(args.workers)],
            [float(n) for n in parts(args.io_waits)],
            parts(args.batches),
        )
    )
    table = Table(
        title=f"Visiting {args.rows:,} rows: a transactional kit.map ÷ the split by hand "
        f"(medians of {args.repeat} rounds)"
    )
    for column in ("page", "workers", "I/O wait", "fn reads", "kit.map rows/s", "fixed rows/s"):
        table.add_column(column, justify="right")
    for column in ("÷ fixed", "CPU ÷ fixed", "kit.map rounds, s", "fixed rounds, s", "checked"):
        table.add_column(column, justify="right")
    exact = True
    for number, (page, workers, io_wait, batch) in enumerate(shapes, 1):
        shape = [
            *("--store", args.store, "--rows", str(args.rows), "--keys", "sequential"),
            *("--modes", "shardkit,fixed", "--repeat", str(args.repeat)),
            *("--page-size", str(page), "--workers", str(workers)),
            *("--io-wait", str(io_wait), "--batch", batch),
        ]
        with (
            console.status(f"shape {number} of {len(shapes)}: {' '.join(shape[6:])}…"),
            ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as own,
        ):
            results = own.submit(measured, shape).result()
        by_mode = {r.mode: r for r in results}
        ours, fixed = by_mode["shardkit"], by_mode["fixed"]
        speed = mapper.rate(ours, args) / mapper.rate(fixed, args)
        cpu = ours.cpu / fixed.cpu
        exact = exact and ours.exact and fixed.exact
        console.print(
            f"shape {number} of {len(shapes)}: page {page}, {workers} workers, "
            f"{io_wait * 1e3:g} ms, batch.{batch}: {speed:.2f}x, CPU {cpu:.2f}x",
            highlight=False,
        )
        table.add_row(
            str(page),
            str(workers),
            f"{io_wait * 1e3:g} ms",
            f"batch.{batch}",
            f"{mapper.rate(ours, args):,.0f}",
            f"{mapper.rate(fixed, args):,.0f}",
            f"[{'green' if speed >= TARGET_RATE else 'red'}]{speed:.2f}x[/]",
            f"[{'green' if cpu <= TARGET_CPU else 'red'}]{cpu:.2f}x[/]",
            ours.note.rpartition("rounds, ")[2],
            fixed.note.rpartition("rounds, ")[2],
            "[green]✓[/]" if ours.exact and fixed.exact else "[red]✗[/]",
        )
    console.print(table)
    console.print(f"load average {mapper.load()}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
