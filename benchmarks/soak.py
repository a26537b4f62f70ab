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

``--sustain SECONDS`` runs a steady load instead, on one kit: 50 buffered counters
flushed every ``--interval`` (0.05 s), each incremented about 50 times a second; sharded
counters written with an idempotency key each time; ids taken; a mapping job every
``--job-every`` seconds. Every ``--sample`` seconds it prints the Python memory
(tracemalloc: bytes and blocks, after a GC), the process's RSS and the tasks waiting in
the local executor. At the end every count must be exact (status 1 if not, or if more
tasks ever waited than a flush per counter and a job's ranges), and the growth of
memory from the sample nearest ``--from`` seconds to the last is printed.

    python benchmarks/soak.py                       # temporary SQLite file, memory cache
    python benchmarks/soak.py --store postgresql://postgres@127.0.0.1:5432/test \\
        --cache redis://127.0.0.1:6379/12 --rounds 300
    python benchmarks/soak.py --sustain 600 --sample 30 --from 120
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import tempfile
import threading
import time
import tracemalloc
import uuid
from pathlib import Path

import sqlalchemy as sa
from rich.table import Table

import shardkit
from harness import forget_redis_keys
from hot_counter import _redis_client, report_console
from shardkit import _fork
from shardkit.cache.memory import MemoryCache
from shardkit.counters.buffered import pointer_keys
from shardkit.executor import local
from shardkit.mapper import Batch
from shardkit.store.sql import SqlStore

COUNTERS = 50
ROWS = 200
JOB_TASKS = 16  # ranges of a job over ROWS rows (pages of 50, fanout 4) waiting at once


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
    parser.add_argument("--sustain", type=float, help="seconds of steady load (see above)")
    parser.add_argument("--interval", type=float, default=0.05, help="flush interval (0.05)")
    parser.add_argument("--sample", type=float, default=30.0, help="seconds between rows (30)")
    parser.add_argument(
        "--from",
        dest="since",
        type=float,
        default=120.0,
        help="growth measured from the sample nearest this second (120)",
    )
    parser.add_argument("--job-every", type=float, default=60.0, help="seconds between jobs")
    return parser.parse_args(argv)


def count_rows(store: SqlStore, table: sa.Table) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def lose_generations(kit: shardkit.Kit, names: list[str]) -> None:
    """The cache loses every buffered generation of ``names``: their keys and pointers."""
    settings = kit.settings
    for name, generations in kit.store.generations(names).items():
        for generation in generations:
            for side in ("up", "down"):
                kit.cache.delete(settings.cache_key(name, f"buffered:{generation}:{side}"))
        info = kit.store.counter(name)
        if info is not None:
            kit.cache.delete(pointer_keys(settings, info, 1)[0])


def setting_up(
    stack: contextlib.ExitStack, args: argparse.Namespace, prefix: str, kit: shardkit.Kit
) -> tuple[SqlStore, sa.Table]:
    """The run's store and its ``accounts`` table of ROWS rows, both dropped by ``stack``
    (the kit closed first; its Redis keys, with a Redis cache, deleted)."""
    store = kit.store
    assert isinstance(store, SqlStore)
    stack.callback(store.metadata.drop_all, store.engine)
    stack.callback(kit.close)  # before the tables go
    if args.cache.startswith(("redis://", "rediss://", "unix://")):
        client = _redis_client(args.cache)
        stack.callback(client.close)
        stack.callback(forget_redis_keys, client, kit.settings.namespace)
    accounts = sa.Table(
        f"{prefix}accounts",
        store.metadata,
        sa.Column("k", sa.Integer, primary_key=True),
        sa.Column("v", sa.Integer, nullable=False),
    )
    accounts.create(store.engine)
    with store.engine.begin() as conn:
        conn.execute(accounts.insert(), [{"k": k, "v": 0} for k in range(ROWS)])
    return store, accounts


def rss_kib() -> int:
    """The process's resident memory (``/proc/self/statm``), in KiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


class Load:
    """The steady load of ``--sustain``: writer threads counting what was acknowledged."""

    def __init__(self, kit: shardkit.Kit, interval: float) -> None:
        self.kit = kit
        self.buffered = [kit.buffered(f"load:{n}", interval=interval) for n in range(COUNTERS)]
        self.sharded = [kit.sharded(f"load:{n}:sharded") for n in range(10)]
        self.ids = kit.ids("load:ids", block=100)
        self.acked = [0] * COUNTERS
        self.keyed = [0] * len(self.sharded)
        self.last_id = 0  # ids must increase (no list of them: the load keeps nothing)
        self.ids_increase = True
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._buffered, args=(part,)) for part in range(4)
        ] + [threading.Thread(target=self._others)]

    def _buffered(self, part: int) -> None:
        """A quarter of the counters, each incremented about 50 times a second."""
        mine = range(part, COUNTERS, 4)
        while not self.stop.wait(0.02):
            for n in mine:
                self.buffered[n].incr()
                self.acked[n] += 1

    def _others(self) -> None:
        while not self.stop.wait(0.01):
            for n, counter in enumerate(self.sharded):
                if counter.incr(key=f"k{self.keyed[n]}"):
                    self.keyed[n] += 1
            new = self.ids.next()
            self.ids_increase = self.ids_increase and new > self.last_id
            self.last_id = new

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def exact(self) -> bool:
        self.kit.flush_all()
        buffered = [counter.parts() for counter in self.buffered]
        sharded = [counter.value(fresh=True) for counter in self.sharded]
        ids_ok = self.ids_increase and self.last_id > 0
        return buffered == [(acked, 0) for acked in self.acked] and sharded == self.keyed and ids_ok


def sustain(args: argparse.Namespace) -> int:
    """``--sustain``: the steady load, sampled."""
    console = report_console()
    prefix = f"sksoak{uuid.uuid4().hex[:8]}_"
    executor = local.LocalExecutor()
    table = Table(title=f"Sustained load: {args.sustain:.0f} s ({args.cache})")
    for column in ("s", "memory KiB", "blocks", "RSS KiB", "tasks waiting"):
        table.add_column(column, justify="right")
    samples: list[tuple[float, int, int, int]] = []
    waiting = 0
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shardkit-soak-")))
        store_url = args.store or f"sqlite:///{scratch / 'soak.db'}"
        kit = shardkit.connect(store_url, args.cache, prefix=prefix, executor=executor)
        store, accounts = setting_up(stack, args, prefix, kit)
        jobs = 0

        def fn(batch: Batch) -> None:
            statement = sa.update(accounts).where(accounts.c.k == sa.bindparam("key"))
            batch.conn.execute(
                statement.values(v=accounts.c.v + 1), [{"key": row["k"]} for row in batch.rows]
            )

        tracemalloc.start()
        started = time.monotonic()
        next_sample = next_job = started
        with Load(kit, args.interval) as load:
            while (now := time.monotonic()) < started + args.sustain:
                waiting = max(waiting, executor.queued)
                if now >= next_job:
                    kit.map(accounts, fn, transactional=True, page_size=50, fanout=4)
                    jobs += 1
                    kit.purge_jobs(args.job_age)
                    next_job += args.job_every
                if now >= next_sample:
                    gc.collect()
                    memory, _ = tracemalloc.get_traced_memory()
                    blocks = len(tracemalloc.take_snapshot().traces)
                    sample = (now - started, memory // 1024, blocks, rss_kib())
                    samples.append(sample)
                    table.add_row(f"{sample[0]:.0f}", *(f"{v:,}" for v in sample[1:]),
                                  str(executor.queued))  # fmt: skip
                    next_sample += args.sample
                time.sleep(0.05)
        tracemalloc.stop()
        executor.close()  # the jobs ran to their end
        exact = load.exact()
        with store.engine.connect() as conn:
            moved = {int(v) for (v,) in conn.execute(sa.select(accounts.c.v))}
        exact = exact and moved == {jobs}
    console.print(table)
    base = min(samples, key=lambda sample: abs(sample[0] - args.since))
    last = samples[-1]
    for what, index in (("memory", 1), ("blocks", 2), ("RSS", 3)):
        growth = (last[index] - base[index]) / base[index] * 100
        console.print(f"{what}: {growth:+.1f} % from {base[0]:.0f} s to {last[0]:.0f} s")
    console.print(f"every count exact: {exact}; at most {waiting} tasks waited ({COUNTERS} "
                  f"counters); {jobs} jobs")  # fmt: skip
    return 0 if exact and waiting <= COUNTERS + JOB_TASKS else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sustain:
        return sustain(args)
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
        kit.settings = dataclasses.replace(kit.settings, fold_after=args.fold_after)
        store, accounts = setting_up(stack, args, prefix, kit)

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
                    str(count_rows(store, kit.mapper.ledger.jobs)),
                    str(count_rows(store, kit.mapper.ledger.ranges)),
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
