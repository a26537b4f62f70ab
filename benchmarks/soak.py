"""A long uptime compressed: rounds of churn, and what the process and the store hold.

Each round opens and closes a kit, writes to a fixed set of buffered and sharded
counters, runs a small mapping job with a closure, flushes, and (with a shared
``--cache``) makes the cache lose every buffered generation's keys, as a cache restart
would. A private ``memory://`` cache loses its data only with its process; its dead
generations are folded at ``Kit.close()``, never by flushes. Every ``--every``
rounds it prints a row: Python memory (tracemalloc, after a GC), at-fork registrations
(``shardkit._fork._OWNERS``), live local executors (``shardkit.executor.local._OPEN``),
rows in the store's ``flushed``, ``jobs`` and ``ranges`` tables, and the entries of the
kit's ``memory://`` cache. Finished jobs are purged ``--job-age`` seconds after they end
(``kit.purge_jobs``), as a long-running service would. After warm-up every column
should stay flat.

    python benchmarks/soak.py                       # temporary SQLite file, memory cache
    python benchmarks/soak.py --store postgresql://postgres@127.0.0.1:5432/test \\
        --cache redis://127.0.0.1:6379/12 --rounds 300
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

import sqlalchemy as sa
from rich.table import Table

import shardkit
from hot_counter import _redis_client, forget_redis_keys, report_console
from shardkit import _fork
from shardkit.cache.memory import MemoryCache
from shardkit.executor import local
from shardkit.mapper import Batch
from shardkit.store.sql import SqlStore

COUNTERS = 50
ROWS = 200


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="store URL (default: a temporary SQLite file)")
    parser.add_argument("--cache", default="memory://", help="cache URL (default memory://)")
    parser.add_argument("--rounds", type=int, default=180, help="rounds of churn (180)")
    parser.add_argument("--every", type=int, default=20, help="print a row every N rounds")
    parser.add_argument(
        "--fold-after",
        type=float,
        default=2.0,
        help="seconds before a dead buffered generation is folded (2; the library's is 600)",
    )
    parser.add_argument(
        "--job-age",
        type=float,
        default=5.0,
        help="seconds after which finished jobs are purged (5; kit.purge_jobs' is a week)",
    )
    return parser.parse_args(argv)


def count_rows(store: SqlStore, table: sa.Table) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def lose_generations(kit: shardkit.Kit, names: list[str]) -> None:
    """The cache loses every buffered generation of ``names``: their keys and pointers."""
    settings = kit._settings
    for name, generations in kit.store.generations(names).items():
        for generation in generations:
            for side in ("up", "down"):
                kit.cache.delete(settings.cache_key(name, f"buffered:{generation}:{side}"))
        kit.cache.delete(settings.cache_key(name, "buffered:generation"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console()
    prefix = f"sksoak{uuid.uuid4().hex[:8]}_"
    names = [f"soak:{index}" for index in range(COUNTERS)]
    table = Table(title=f"Soak: {args.rounds} rounds ({args.cache})")
    for column in ("round", "s", "memory KiB", "fork hooks", "executors", "flushed", "jobs"):
        table.add_column(column, justify="right")
    for column in ("ranges", "cache entries"):
        table.add_column(column, justify="right")
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shardkit-soak-")))
        store_url = args.store or f"sqlite:///{scratch / 'soak.db'}"

        def connect() -> shardkit.Kit:
            return shardkit.connect(store_url, args.cache, prefix=prefix)

        kit = connect()
        # A short grace so that a run of a minute shows dead generations being folded.
        kit._settings = dataclasses.replace(kit._settings, fold_after=args.fold_after)
        store = kit.store
        assert isinstance(store, SqlStore)
        stack.callback(store.metadata.drop_all, store.engine)
        stack.callback(kit.close)  # before the tables go
        if args.cache.startswith(("redis://", "rediss://", "unix://")):
            client = _redis_client(args.cache)
            stack.callback(client.close)
            stack.callback(forget_redis_keys, client, kit._settings.namespace)
        accounts = sa.Table(
            f"{prefix}accounts",
            store.metadata,
            sa.Column("k", sa.Integer, primary_key=True),
            sa.Column("v", sa.Integer, nullable=False),
        )
        accounts.create(store.engine)
        with store.engine.begin() as conn:
            conn.execute(accounts.insert(), [{"k": k, "v": 0} for k in range(ROWS)])

        tracemalloc.start()
        started = time.monotonic()
        for number in range(1, args.rounds + 1):
            with connect() as passing:  # a kit opened and closed: its hooks must go too
                passing.sharded(f"soak:passing:{number % COUNTERS}").incr()
            for name in names:
                kit.buffered(name, interval=0.2).incr()
                kit.sharded(f"{name}:sharded").incr()

            def fn(batch: Batch, step: int = number) -> None:  # a fresh closure per job
                statement = sa.update(accounts).where(accounts.c.k == sa.bindparam("key"))
                batch.conn.execute(
                    statement.values(v=accounts.c.v + step),
                    [{"key": row["k"]} for row in batch.rows],
                )

            kit.map(accounts, fn, transactional=True, page_size=50, fanout=4).wait(60)
            kit.purge_jobs(args.job_age)
            kit.flush_all()
            if kit.cache.shared:
                lose_generations(kit, names)
            if number % args.every == 0 or number == args.rounds:
                gc.collect()
                memory, _ = tracemalloc.get_traced_memory()
                cache = kit.cache
                table.add_row(
                    str(number),
                    f"{time.monotonic() - started:.0f}",
                    f"{memory / 1024:,.0f}",
                    str(len(_fork._OWNERS)),
                    str(len(local._OPEN)),
                    str(count_rows(store, store.flushed_table)),
                    str(count_rows(store, store.jobs_table)),
                    str(count_rows(store, store.ranges_table)),
                    str(cache.size()) if isinstance(cache, MemoryCache) else "-",
                )
                console.print(f"round {number}: {time.monotonic() - started:.0f} s")
        tracemalloc.stop()
        totals = kit.values(names)
        exact = all(total == args.rounds for total in totals.values())
        console.print(table)
        console.print(f"buffered counters exact after every cache loss: {exact}")
        return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
