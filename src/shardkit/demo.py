"""``shardkit demo``: writer processes hammer one hot counter: a naive row, a sharded
counter, a buffered counter; then a map over a generated table, with its progress bar.

The process machinery (``Crew``: start N spawned writers once, release them together
for each timed phase, collect their acknowledged counts) is reused by
``benchmarks/hot_counter.py``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import random
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

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

T = TypeVar("T")
Setup = Callable[[T], AbstractContextManager[Op]]
"""A module-level context-manager function (so spawn can pickle it): given its argument,
it connects, warms up without changing any total, and yields the write to repeat."""

DEMO_SHARDS = 20
DEMO_INTERVAL = 1.0
DEMO_ROWS = 20_000
DEMO_PAGE = 250
_READY_TIMEOUT = 120.0  # spawning and connecting many writers on a busy machine


# -- writer processes ------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """What a crew's writers did in one timed phase."""

    counts: tuple[int, ...]
    """Acknowledged writes of each writer."""
    elapsed: tuple[float, ...]
    """Seconds each writer spent writing."""
    cpu: tuple[float, ...] = ()
    """CPU seconds each writer's process spent meanwhile, its background threads
    included."""

    @property
    def ops(self) -> int:
        return sum(self.counts)

    @property
    def rate(self) -> float:
        """Acknowledged writes per second: the sum of the writers' rates."""
        return sum(n / s for n, s in zip(self.counts, self.elapsed, strict=True))

    @property
    def cpu_per_op(self) -> float:
        """The writers' CPU seconds per acknowledged write."""
        return sum(self.cpu) / self.ops if self.ops else 0.0


def _member(index: int, tasks: Any, reports: Any, start: Any) -> None:
    """A crew process: run each task it is given until told to stop (``None``)."""
    while (task := tasks.get()) is not None:
        setup, arg, seconds, threads, shared = task
        counts = [0] * threads
        try:
            with contextlib.ExitStack() as stack:
                # One setup shared by the threads (a kit, as an application has one per
                # process), or one each (a raw driver connection).
                ops = (
                    [stack.enter_context(setup(arg))] * threads
                    if shared
                    else [stack.enter_context(setup(arg)) for _ in range(threads)]
                )
                reports.put(("ready", index, 0, 0.0))
                start.wait()
                began, cpu = time.monotonic(), time.process_time()
                _write_until(ops, counts, began + seconds)
                spent = (time.monotonic() - began, time.process_time() - cpu)
            reports.put(("done", index, sum(counts), spent))
        except BaseException as exc:
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            reports.put(("error", index, sum(counts), detail))
            if not isinstance(exc, Exception):
                raise


def _write_until(ops: list[Op], counts: list[int], deadline: float) -> None:
    """Repeat ``ops[i]`` in thread ``i`` (the first in this one) until ``deadline``,
    counting into ``counts[i]``; re-raise the first error of any."""
    errors: list[BaseException] = []

    def repeat(i: int) -> None:
        op = ops[i]
        try:
            while time.monotonic() < deadline:
                op()
                counts[i] += 1
        except BaseException as exc:
            errors.append(exc)

    others = [threading.Thread(target=repeat, args=(i,)) for i in range(1, len(ops))]
    for thread in others:
        thread.start()
    repeat(0)
    for thread in others:
        thread.join()
    if errors:
        raise errors[0]


class Crew:
    """``writers`` spawned processes that run timed phases together, each with
    ``threads`` writing threads.

    Each phase: every writer sets up (connects, warms up), then all are released by one
    Event at once, so neither process start-up nor connecting is measured. A failing
    writer makes ``run`` raise ``RuntimeError``. Use as a context manager.
    """

    def __init__(self, writers: int, threads: int = 1) -> None:
        if writers < 1 or threads < 1:
            raise ValueError("a crew needs at least one writer, of at least one thread")
        self.threads = threads
        ctx = multiprocessing.get_context("spawn")
        self._start = ctx.Event()
        self._reports: Any = ctx.Queue()
        self._tasks: list[Any] = [ctx.Queue() for _ in range(writers)]
        self._processes = [
            ctx.Process(
                target=_member,
                args=(i, tasks, self._reports, self._start),
                name=f"shardkit-writer-{i}",
                daemon=True,
            )
            for i, tasks in enumerate(self._tasks)
        ]
        self._broken = False
        for process in self._processes:
            process.start()

    @property
    def writers(self) -> int:
        return len(self._processes)

    def __enter__(self) -> Crew:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, setup: Setup[T], arg: T, seconds: float, *, shared: bool = True) -> Phase:
        """Every writer's threads repeat ``setup(arg)``'s write for ``seconds``, all
        starting at once: one setup per writer, its write shared by its threads
        (``shared``), or one setup per thread."""
        if self._broken:
            raise RuntimeError("the crew is broken by an earlier failure")
        self._start.clear()  # every writer has reported: none is waiting on it
        for tasks in self._tasks:
            tasks.put((setup, arg, seconds, self.threads, shared))
        self._collect("ready", _READY_TIMEOUT)
        self._start.set()
        done = self._collect("done", seconds + _READY_TIMEOUT)
        return Phase(
            counts=tuple(int(done[i][0]) for i in range(self.writers)),
            elapsed=tuple(float(done[i][1][0]) for i in range(self.writers)),
            cpu=tuple(float(done[i][1][1]) for i in range(self.writers)),
        )

    def _collect(self, kind: str, timeout: float) -> dict[int, tuple[int, Any]]:
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[int, Any]] = {}
        while len(got) < self.writers:
            try:
                what, index, ops, detail = self._reports.get(timeout=0.5)
            except queue.Empty:
                dead = [p.name for p in self._processes if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self._broken = True
                    why = f"{', '.join(dead)} died" if dead else f"no {kind!r} in {timeout:.0f} s"
                    raise RuntimeError(f"writer processes failed: {why}") from None
                continue
            if what == "error":
                self._broken = True
                raise RuntimeError(f"writer {index} failed after {ops} writes: {detail}")
            got[index] = (ops, detail)
        return got

    def close(self) -> None:
        """Stop the writers (at once if a phase failed)."""
        if not self._broken:
            for tasks in self._tasks:
                tasks.put(None)
        for process in self._processes:
            if not self._broken:
                process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        for q in [self._reports, *self._tasks]:
            q.close()
            q.join_thread()


# -- the demo's writers ----------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where a writer writes: a store, a cache, and a table or counter name."""

    store_url: str
    cache_url: str
    name: str
    prefix: str = "shardkit_"


def naive_table(name: str, metadata: sa.MetaData | None = None) -> sa.Table:
    """A one-row counter table: what a hot counter looks like without sharding."""
    return sa.Table(
        name,
        metadata or sa.MetaData(),
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
        crew = stack.enter_context(Crew(writers))
        with status(f"naive: {writers} writers on one row…"):
            naive = crew.run(
                naive_writer, Target(store_url, cache_url, table.name, prefix), seconds
            )
        with status(f"sharded: {writers} writers on {DEMO_SHARDS} shards…"):
            sharded = crew.run(
                sharded_writer, Target(store_url, cache_url, counter.name, prefix), seconds
            )
        with status(f"buffered: {writers} writers into the cache…"):
            target = Target(store_url, cache_url, buffered.name, prefix)
            buffering = crew.run(buffered_writer, target, seconds)

        with engine.connect() as conn:
            naive_total = int(conn.execute(sa.select(table.c.n)).scalar_one())
        races = [
            Race(mode, writers, phase.ops, phase.rate, total)
            for mode, phase, total in (
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
    "Crew",
    "DemoResult",
    "Mapped",
    "Op",
    "Phase",
    "Race",
    "Setup",
    "Target",
    "buffered_writer",
    "naive_table",
    "naive_writer",
    "run_demo",
    "sharded_writer",
]
