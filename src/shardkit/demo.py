"""``shardkit demo``: writer processes hammer one hot counter: a naive row, a sharded
counter, a buffered counter; then a map over a generated table, with its progress bar.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardkit.kit import Kit, connect
from shardkit.mapper import Batch
from shardkit.mapper.progress import watch
from shardkit.mapper.tables import ledger_tables
from shardkit.store.sql import SqlStore, engine_from_url

Op = Callable[[], object]
"""One write; returning means the store acknowledged it."""

DEMO_SHARDS = 20
DEMO_INTERVAL = 1.0
DEMO_ROWS = 20_000
DEMO_PAGE = 250
_READY_TIMEOUT = 120.0  # spawning and connecting many writers on a busy machine


# -- the demo's writers ----------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where a writer writes: a store, a cache, and a table or counter name."""

    store_url: str
    cache_url: str
    name: str
    prefix: str = "shardkit_"


def naive_table(name: str) -> sa.Table:
    """A one-row counter table: what a hot counter looks like without sharding."""
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("n", sa.BigInteger, nullable=False),
    )


@contextlib.contextmanager
def naive_writer(target: Target) -> Iterator[Op]:
    """``UPDATE t SET n = n + 1`` on the one row, autocommit, on a held connection."""
    engine = engine_from_url(target.store_url)
    table = naive_table(target.name)
    bump = sa.update(table).where(table.c.id == 1)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(bump.values(n=table.c.n + 0))
            statement = bump.values(n=table.c.n + 1)
            yield lambda: conn.execute(statement)
    finally:
        engine.dispose()


@contextlib.contextmanager
def sharded_writer(target: Target) -> Iterator[Op]:
    """``kit.sharded(name).incr()`` on an existing counter (the caller creates it)."""
    with connect(target.store_url, target.cache_url, prefix=target.prefix) as kit:
        counter = kit.sharded(target.name)
        counter.incr(0)  # take a home shard and a connection
        yield counter.incr


@contextlib.contextmanager
def buffered_writer(target: Target) -> Iterator[Op]:
    """``kit.buffered(name).incr()``; closing the kit flushes what is still pending."""
    with connect(target.store_url, target.cache_url, prefix=target.prefix) as kit:
        counter = kit.buffered(target.name, interval=DEMO_INTERVAL)
        counter.parts()  # connect to both backends
        yield counter.incr


# -- the race: writer processes released together --------------------------------------

Writer = Callable[[Target], AbstractContextManager[Op]]
"""A module-level context-manager function (so spawn can pickle it): it connects, warms
up without changing any total, and yields the write to repeat."""

_start: Any = None
"""In a writer process: the pool's barrier, which releases every writer at once."""


def _enlist(start: Any) -> None:
    """A writer process's initializer: keep the pool's barrier."""
    global _start
    _start = start


def _write(writer: Writer, target: Target, seconds: float) -> tuple[int, float]:
    """In a writer process: set up ``writer(target)``, wait for every writer, then repeat
    its write for ``seconds``; the writes acknowledged and the seconds they took."""
    try:
        with writer(target) as op:
            _start.wait(_READY_TIMEOUT)
            count, began = 0, time.monotonic()
            while time.monotonic() - began < seconds:
                op()
                count += 1
            return count, time.monotonic() - began
    except BaseException:
        _start.abort()  # the other writers stop waiting for this one
        raise


def _race(
    pool: ProcessPoolExecutor, writers: int, writer: Writer, target: Target, seconds: float
) -> tuple[int, float]:
    """``writers`` processes of ``pool`` (one each: the barrier holds all) repeat
    ``writer(target)``'s write for ``seconds``, released together once set up, so neither
    start-up nor connecting is measured: the writes acknowledged, and the sum of the
    writers' rates per second. A writer's error is raised here."""
    futures = [pool.submit(_write, writer, target, seconds) for _ in range(writers)]
    done = [future.result() for future in futures]
    return sum(count for count, _ in done), sum(count / spent for count, spent in done)


# -- the demo --------------------------------------------------------------------------


@dataclass(frozen=True)
class Race:
    """One mode of the demo's race: what its writers had acknowledged, and what the
    counter held after."""

    mode: str
    writers: int
    ops: int
    rate: float
    counted: int

    @property
    def exact(self) -> bool:
        return self.counted == self.ops


@dataclass(frozen=True)
class Mapped:
    """The demo's mapping job: how it ended, and whether every row ended exactly +10."""

    state: str
    rows: int
    pages: int
    ranges: int
    depth: int
    exact: bool


@dataclass(frozen=True)
class DemoResult:
    """What ``run_demo`` did: the race of each mode, then the mapping job."""

    store: str
    cache: str
    seconds: float
    races: list[Race]
    mapped: Mapped

    @property
    def exact(self) -> bool:
        """Every total exact, and every row mapped exactly once."""
        return self.mapped.exact and all(race.exact for race in self.races)


def run_demo(
    store_url: str | None,
    cache_url: str | None,
    *,
    writers: int = 4,
    seconds: float = 3.0,
    console: Console | None = None,
    prefix: str = "shardkit_",
) -> DemoResult:
    """Race ``writers`` processes on one hot counter for ``seconds``: on a single row, on
    a sharded counter, on a buffered counter; then add 10 to every row of a generated
    table with ``kit.map``. Shown on ``console`` as it goes (a table, a progress bar),
    if one is given. The counters, in the store's tables of ``prefix``, are deleted at
    the end."""
    if writers < 1 or not seconds > 0:
        raise ValueError("writers must be ≥ 1 and seconds > 0")
    tag = uuid.uuid4().hex[:12]
    say = console.print if console is not None else _quiet

    def status(text: str) -> AbstractContextManager[Any]:
        return console.status(text) if console is not None else contextlib.nullcontext()

    with contextlib.ExitStack() as stack:
        if store_url is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="shardkit-demo-"))
            store_url = f"sqlite:///{Path(folder) / 'demo.db'}"
        cache_url = cache_url or "memory://"
        kit = stack.enter_context(connect(store_url, cache_url, prefix=prefix))
        engine = engine_from_url(store_url)
        stack.callback(engine.dispose)
        table = naive_table(f"shardkit_demo_naive_{tag}")
        table.create(engine)
        stack.callback(table.drop, engine)
        with engine.begin() as conn:
            conn.execute(table.insert().values(id=1, n=0))
        counter = kit.sharded(f"shardkit-demo-{tag}", shards=DEMO_SHARDS)
        buffered = kit.buffered(f"shardkit-demo-buffered-{tag}", interval=DEMO_INTERVAL)
        stack.callback(kit.delete, counter.name)
        stack.callback(kit.delete, buffered.name)

        say(
            f"[bold]{writers}[/] writer processes, {seconds:g} s each, "
            f"store [cyan]{escape(kit.store.url)}[/], cache [cyan]{escape(kit.cache.url)}[/]"
        )
        spawn = multiprocessing.get_context("spawn")
        pool = stack.enter_context(
            ProcessPoolExecutor(
                writers, spawn, initializer=_enlist, initargs=(spawn.Barrier(writers),)
            )
        )
        race = partial(_race, pool, writers, seconds=seconds)
        with status(f"naive: {writers} writers on one row…"):
            naive = race(naive_writer, Target(store_url, cache_url, table.name, prefix))
        with status(f"sharded: {writers} writers on {DEMO_SHARDS} shards…"):
            sharded = race(sharded_writer, Target(store_url, cache_url, counter.name, prefix))
        with status(f"buffered: {writers} writers into the cache…"):
            target = Target(store_url, cache_url, buffered.name, prefix)
            buffering = race(buffered_writer, target)

        with engine.connect() as conn:
            naive_total = int(conn.execute(sa.select(table.c.n)).scalar_one())
        races = [
            Race(mode, writers, ops, rate, total)
            for mode, (ops, rate), total in (
                ("naive", naive, naive_total),
                ("sharded", sharded, counter.value(fresh=True)),
                ("buffered", buffering, buffered.value()),
            )
        ]
        say(_table(races))
        if engine.dialect.name == "sqlite":
            say(
                "[dim]SQLite serialises all writers on one database lock, so sharding shows "
                "its gain on PostgreSQL/MySQL "
                "([bold]shardkit --store postgresql://HOST/DB demo[/]).[/]"
            )
        else:
            say(
                "[dim]Naive writers queue on one row lock; sharded writers each write "
                "their own row.[/]"
            )
        say(
            "[dim]Buffered writers count in the cache and flush to the store every "
            f"{DEMO_INTERVAL:g} s (with memory:// each process has its own cache).[/]"
        )
        mapped = _map_demo(kit, engine, tag, console)
        return DemoResult(kit.store.url, kit.cache.url, seconds, races, mapped)


def _quiet(*shown: object) -> None:
    """Shows nothing (``run_demo`` without a console)."""


def _map_demo(kit: Kit, engine: sa.Engine, tag: str, console: Console | None) -> Mapped:
    """Add 10 to every row of a generated table with ``kit.map`` (transactional), showing
    its progress on ``console`` if given."""
    accounts = sa.Table(
        f"shardkit_demo_accounts_{tag}",
        sa.MetaData(),
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("balance", sa.BigInteger, nullable=False),
    )
    accounts.create(engine)
    try:
        rows = random.Random(tag).sample(range(10**12), DEMO_ROWS)  # sparse random keys
        with engine.begin() as conn:
            conn.execute(accounts.insert(), [{"id": key, "balance": 0} for key in rows])

        def add_credit(batch: Batch) -> None:
            ids = [row["id"] for row in batch.rows]
            batch.conn.execute(
                sa.update(accounts)
                .where(accounts.c.id.in_(ids))
                .values(balance=accounts.c.balance + 10)
            )

        job = kit.map(accounts, add_credit, transactional=True, page_size=DEMO_PAGE)
        if console is None:
            job.wait()
            status = job.status()
        else:
            console.print(
                f"\n[bold]kit.map[/]: add 10 to each of {DEMO_ROWS:,} rows, page by page, on "
                f"{kit.executor.url}; ranges split as they go"
            )
            status = watch(job, console)
        with engine.connect() as conn:
            balances: dict[int, int] = dict(
                conn.execute(
                    sa.select(accounts.c.balance, sa.func.count()).group_by(accounts.c.balance)
                ).all()
            )
        exact = balances == {10: DEMO_ROWS}
        if console is not None:
            mark = "[green]✓ every row exactly +10[/]" if exact else f"[red]✗ {balances}[/]"
            console.print(
                f"{status.state}: {status.rows:,} rows in {status.pages:,} pages, "
                f"{status.done:,} ranges, tree depth {status.depth}  {mark}"
            )
        _forget_job(kit, job.id)
        return Mapped(status.state, status.rows, status.pages, status.done, status.depth, exact)
    finally:
        accounts.drop(engine)


def _table(races: list[Race]) -> Table:
    """The race's results: acknowledged ops beside what the counter holds (exact when
    they are equal)."""
    table = Table(title="One hot counter")
    for column in ("mode", "writers", "ops", "ops/s", "vs naive", "counted"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    table.add_column("exact", justify="center")
    naive_rate = races[0].rate
    for race in races:
        table.add_row(
            race.mode,
            str(race.writers),
            f"{race.ops:,}",
            f"{race.rate:,.0f}",
            f"{race.rate / naive_rate:.2f}x",
            f"{race.counted:,}",
            "[green]✓[/]" if race.exact else "[red]✗[/]",
        )
    return table


def _forget_job(kit: Kit, job: str) -> None:
    """Delete the demo's job from the ledger."""
    store = kit.store
    assert isinstance(store, SqlStore)
    tables = ledger_tables(store.prefix)
    with store.engine.begin() as conn:
        conn.execute(sa.delete(tables.ranges).where(tables.ranges.c.job == job))
        conn.execute(sa.delete(tables.jobs).where(tables.jobs.c.id == job))


__all__ = [
    "DemoResult",
    "Mapped",
    "Op",
    "Race",
    "Target",
    "buffered_writer",
    "naive_table",
    "naive_writer",
    "run_demo",
    "sharded_writer",
]
