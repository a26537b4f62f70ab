"""kit.map: every row of a table visited in key-range tasks that split as they go, over
every SQL store, and the signed specs in which jobs travel to other processes."""

from __future__ import annotations

import base64
import bisect
import gc
import json
import math
import random
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import cloudpickle
import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql

import shardkit
from backends import PREFIX, STORE_URLS, Target, require, wait_for
from executors import HeldExecutor
from shardkit.errors import (
    BackendError,
    ConfigurationError,
    JobFailed,
    JobNotFound,
    UntrustedPayload,
    ValidationError,
)
from shardkit.executor import LocalExecutor
from shardkit.mapper import Batch, Completion, Job, MapSpec, Signer, TableSource
from shardkit.mapper.keys import KeyRange, load_key
from shardkit.mapper.ledger import Child
from shardkit.mapper.planning import _targets
from shardkit.mapper.source import Statistics, StatisticsSource
from shardkit.mapper.spec import reference
from shardkit.mapper.tables import ledger_tables
from shardkit.mapper.task import TASK
from shardkit.store.sql import SqlStore

WAIT = 60.0  # seconds: a deadline, never a pause


@pytest.fixture(autouse=True)
def _no_ambient_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDKIT_SECRET", raising=False)


@pytest.fixture
def kit(store_url: str) -> Iterator[shardkit.Kit]:
    """A kit on each SQL store, with a private cache (the mapper uses none)."""
    with Target(store_url, "memory://").connect() as the_kit:
        yield the_kit


def sql_store(kit: shardkit.Kit) -> SqlStore:
    assert isinstance(kit.store, SqlStore)
    return kit.store


class Tables:
    """The source tables of one test, in the store's database."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.metadata = sa.MetaData()

    def create(self, what: str, *columns: sa.schema.SchemaItem) -> sa.Table:
        table = sa.Table(f"{PREFIX}{what}_{uuid4().hex[:8]}", self.metadata, *columns)
        table.create(self.engine)
        return table


@pytest.fixture
def tables(kit: shardkit.Kit) -> Iterator[Tables]:
    made = Tables(sql_store(kit).engine)
    yield made
    kit.executor.close()  # drained: no task still reads a table as it is dropped
    made.metadata.drop_all(made.engine)


# -- keys ----------------------------------------------------------------------------------


def _pk(name: str, type_: Any) -> sa.Column[Any]:
    return sa.Column(name, type_, primary_key=True, autoincrement=False)


# MySQL cannot index a BLOB whole: a bytes key is a VARBINARY there.
BINARY = sa.LargeBinary().with_variant(mysql.VARBINARY(16), "mysql", "mariadb")
# Collations may fold case and accents (MariaDB's utf8mb4_general_ci weighs every emoji
# alike): the numbered suffix keeps keys unique under any of them.
WORDS = ["ключ", "日本語", "émile", "Zürich", "zebra", "Ωmega", "😀", "🎉", "a", "A", "ß", "naïve"]


def _sequential(n: int, rng: random.Random) -> list[Any]:
    return list(range(1, n + 1))


def _sparse(n: int, rng: random.Random) -> list[Any]:
    return rng.sample(range(-(2**61), 2**61), n)


def _skewed(n: int, rng: random.Random) -> list[Any]:
    """90% of the keys in 1% of the key space [0, 1,000,000)."""
    dense = n * 9 // 10
    return rng.sample(range(10_000), dense) + rng.sample(range(10_000, 1_000_000), n - dense)


def _strings(n: int, rng: random.Random) -> list[Any]:
    return [f"{rng.choice(WORDS)}-{i:05d}" for i in range(n)]


def _bytes(n: int, rng: random.Random) -> list[Any]:
    found = {b"\x00", b"\x00\x00\x01", b"\xff", b"\xff" * 16, b"\x7f\x80"}
    while len(found) < n:
        found.add(rng.randbytes(rng.randint(1, 16)))
    keys = list(found)
    rng.shuffle(keys)
    return keys


def _uuids(n: int, rng: random.Random) -> list[Any]:
    return [UUID(int=rng.getrandbits(128), version=4) for _ in range(n)]


def _pairs(n: int, rng: random.Random) -> list[Any]:
    """Few first components, so splits fall inside a group of equal ones."""
    return [(a, b) for a in range(4) for b in rng.sample(range(-(10**6), 10**6), n // 4)]


@dataclass(frozen=True)
class KeyKind:
    columns: Callable[[], list[sa.Column[Any]]]
    keys: Callable[[int, random.Random], list[Any]]


KEY_KINDS = {
    "sequential": KeyKind(lambda: [_pk("k", sa.BigInteger)], _sequential),
    "sparse": KeyKind(lambda: [_pk("k", sa.BigInteger)], _sparse),
    "skewed": KeyKind(lambda: [_pk("k", sa.BigInteger)], _skewed),
    "string": KeyKind(lambda: [_pk("k", sa.String(40))], _strings),
    "bytes": KeyKind(lambda: [_pk("k", BINARY)], _bytes),
    "uuid": KeyKind(lambda: [_pk("k", sa.Uuid)], _uuids),
    "composite": KeyKind(lambda: [_pk("a", sa.Integer), _pk("b", sa.Integer)], _pairs),
}


def key_names(table: sa.Table) -> list[str]:
    return [column.name for column in table.primary_key.columns]


def key_arg(table: sa.Table) -> str | tuple[str, ...]:
    names = key_names(table)
    return names[0] if len(names) == 1 else tuple(names)


def key_of(row: Mapping[str, Any], names: list[str]) -> Any:
    return row[names[0]] if len(names) == 1 else tuple(row[name] for name in names)


def key_table(
    tables: Tables, kind: str, n: int, *extra: sa.Column[Any], seed: int = 0
) -> tuple[sa.Table, dict[Any, int]]:
    """A table of ``n`` rows keyed the ``kind`` way, each with ``v`` = its index; returns
    it and {key: v}."""
    spec = KEY_KINDS[kind]
    table = tables.create("acct", *spec.columns(), sa.Column("v", sa.Integer, nullable=False))
    names = key_names(table)
    keys = spec.keys(n, random.Random(seed))
    assert len(set(keys)) == len(keys) == n
    initial = {key: i for i, key in enumerate(keys)}
    rows = [
        {**dict(zip(names, key if len(names) > 1 else (key,), strict=True)), "v": v}
        for key, v in initial.items()
    ]
    with tables.engine.begin() as conn:
        conn.execute(table.insert(), rows)
    return table, initial


def values(kit: shardkit.Kit, table: sa.Table) -> dict[Any, int]:
    """{key: v} for every row of ``table``."""
    names = key_names(table)
    with sql_store(kit).engine.connect() as conn:
        rows = conn.execute(sa.select(*(table.c[name] for name in names), table.c.v))
        return {key_of(row._mapping, names): row.v for row in rows}


def plus(initial: dict[Any, int], delta: int) -> dict[Any, int]:
    return {key: v + delta for key, v in initial.items()}


def add_ten(table: sa.Table) -> Callable[[Batch], None]:
    """A transactional job's fn: adds 10 to ``v`` of every row of the page, through the
    page's transaction."""
    names = key_names(table)
    statement = (
        sa.update(table)
        .where(*(table.c[name] == sa.bindparam(f"key_{name}") for name in names))
        .values(v=table.c.v + 10)
    )

    def fn(batch: Batch) -> None:
        if batch.rows:
            params = [{f"key_{name}": row[name] for name in names} for row in batch.rows]
            batch.conn.execute(statement, params)

    return fn


def mark_table(tables: Tables) -> sa.Table:
    """Where on_complete records that it ran."""
    return tables.create(
        "done",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job", sa.String(64), nullable=False),
        sa.Column("total", sa.Integer, nullable=False),
    )


def marks_of(kit: shardkit.Kit, marks: sa.Table) -> list[tuple[str, int]]:
    with sql_store(kit).engine.connect() as conn:
        return [(row.job, row.total) for row in conn.execute(sa.select(marks))]


def range_ids(kit: shardkit.Kit, job: str) -> list[str]:
    ranges = ledger_tables(sql_store(kit).prefix).ranges
    with sql_store(kit).engine.connect() as conn:
        return list(conn.execute(sa.select(ranges.c.id).where(ranges.c.job == job)).scalars())


def ledger_rows(kit: shardkit.Kit) -> tuple[int, int]:
    """How many jobs and ranges the ledger holds (its tables made if missing, as the
    kit's mapper makes them)."""
    store = sql_store(kit)
    tables = kit.mapper.ledger.tables
    with store.engine.connect() as conn:
        jobs = conn.execute(sa.select(sa.func.count()).select_from(tables.jobs))
        ranges = conn.execute(sa.select(sa.func.count()).select_from(tables.ranges))
        return int(jobs.scalar_one()), int(ranges.scalar_one())


class Recorder:
    """A non-transactional job's fn: records the keys it is given, and whether
    ``batch.conn`` was refused, thread-safely."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.keys: list[Any] = []
        self.conn_refused: list[bool] = []
        self._lock = threading.Lock()

    def __call__(self, batch: Batch) -> None:
        try:
            batch.conn  # noqa: B018
            refused = False
        except ConfigurationError:
            refused = True
        with self._lock:
            self.keys.extend(key_of(row, self.names) for row in batch.rows)
            self.conn_refused.append(refused)


# -- every row, exactly once -------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KEY_KINDS))
def test_transactional_map_visits_every_row_exactly_once(
    kit: shardkit.Kit, tables: Tables, kind: str
) -> None:
    table, initial = key_table(tables, kind, 1000)
    marks = mark_table(tables)
    calls: list[tuple[str, int]] = []

    def on_complete(done: Completion) -> None:
        calls.append((done.job, done.rows))
        done.conn.execute(marks.insert().values(job=done.job, total=done.rows))

    job = kit.map(
        table,
        add_ten(table),
        key=key_arg(table),
        transactional=True,
        page_size=50,
        on_complete=on_complete,
    )
    status = job.wait(WAIT)

    assert values(kit, table) == plus(initial, 10)
    assert (status.state, status.rows, status.pending, status.error) == ("complete", 1000, 0, None)
    assert_estimate(status, 1000, tables.engine)
    assert status.finished_at is not None
    assert calls == [(job.id, 1000)]
    assert marks_of(kit, marks) == [(job.id, 1000)]


def test_a_filtered_select_visits_only_its_rows(kit: shardkit.Kit, tables: Tables) -> None:
    table = tables.create(
        "acct",
        _pk("id", sa.Integer),
        sa.Column("v", sa.Integer, nullable=False),
        sa.Column("active", sa.Boolean, nullable=False),
    )
    with tables.engine.begin() as conn:
        conn.execute(
            table.insert(), [{"id": i, "v": 0, "active": i % 3 == 0} for i in range(1, 901)]
        )
    active = sa.select(table).where(table.c.active)
    with pytest.raises(ConfigurationError, match="key"):
        kit.map(active, add_ten(table))  # a select has no primary key to default to

    job = kit.map(active, add_ten(table), key="id", transactional=True, page_size=40)
    status = job.wait(WAIT)

    with tables.engine.connect() as conn:
        got = {row.id: row.v for row in conn.execute(sa.select(table.c.id, table.c.v))}
    assert got == {i: 10 if i % 3 == 0 else 0 for i in range(1, 901)}
    assert (status.state, status.rows) == ("complete", 300)
    assert_estimate(status, 300, tables.engine)


class Tenfold(sa.TypeDecorator[int]):
    """An integer column whose values a result gives ten times over."""

    impl = sa.Integer
    cache_ok = True

    def process_result_value(self, value: int | None, dialect: sa.Dialect) -> int | None:
        return None if value is None else 10 * value


def test_a_batch_holds_its_rows_as_read_and_as_dicts(kit: shardkit.Kit, tables: Tables) -> None:
    table = tables.create("rec", _pk("id", sa.Integer), sa.Column("v", Tenfold, nullable=False))
    with tables.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "v": 2 * i} for i in range(1, 51)])
        read = conn.execute(sa.select(table.c.v, table.c.id).order_by(table.c.id)).all()
    seen: list[tuple[int, int, int]] = []
    pages: list[list[sa.Row[Any]]] = []
    lock = threading.Lock()

    def fn(batch: Batch) -> None:
        assert all(isinstance(row, sa.Row) for row in batch.records)
        assert batch.records[0] == batch.records[0]  # made as read: equal each time
        assert batch.records[0]._fields == ("v", "id")
        assert batch.records[1:3] == list(batch.records)[1:3]
        rows = batch.rows  # dicts of the columns by name, whose columns are attributes too
        assert len(rows) == len(batch.records)
        assert rows[0] == dict(batch.records[0]._mapping) == batch.records[0]._asdict()
        assert rows[-1].id == batch.records[-1].id
        assert rows[1:3] == list(rows)[1:3]
        with lock:
            pages.append(list(batch.records))
            seen.extend(
                (row.id, row.v, mapped["v"])
                for row, mapped in zip(batch.records, batch.rows, strict=True)
            )

    # The key is not the first column: pages are cut at the key, wherever it is.
    job = kit.map(sa.select(table.c.v, table.c.id), fn, key="id", page_size=7)
    assert job.wait(WAIT).rows == 50
    # Each column's values converted by its type once, as the database's own result gives.
    assert sorted(seen) == [(i, 20 * i, 20 * i) for i in range(1, 51)]
    assert sorted(row for page in pages for row in page) == read


@pytest.mark.parametrize("column", [sa.Integer, Tenfold])
def test_a_table_sources_rows_are_keyed_as_its_results_rows(
    kit: shardkit.Kit, tables: Tables, column: type[sa.types.TypeEngine[Any]]
) -> None:
    """A page's rows, made of their values by SQLAlchemy's public ``result_tuple``, are
    keyed as the rows of the database's own result: by name, by position and by the
    table's columns — pages read through SQLAlchemy and past it (values that need no
    conversion: ``Integer``) alike."""
    table = tables.create("keyed", _pk("id", sa.Integer), sa.Column("v", column, nullable=False))
    with tables.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "v": i} for i in range(1, 31)])
        read = conn.execute(sa.select(table).order_by(table.c.id)).all()
    seen: list[tuple[Any, ...]] = []
    lock = threading.Lock()

    def fn(batch: Batch) -> None:
        with lock:
            seen.extend(
                (row, row._mapping[table.c.id], row._mapping[table.c.v], row._mapping["v"], row[0])
                for row in batch.records
            )

    assert kit.map(table, fn, page_size=7, fanout=1).wait(WAIT).rows == 30
    assert sorted(seen) == [(row, row.id, row.v, row.v, row.id) for row in read]


@pytest.mark.parametrize("columns", ["plain", "converted", "expanded"])
def test_pages_whose_values_need_no_conversion_are_read_past_sqlalchemy(
    kit: shardkit.Kit, tables: Tables, columns: str
) -> None:
    """A page statement runs through SQLAlchemy until a page has rows to show how they
    are made, then on the driver's cursor alone — unless a type converts values to or
    from the driver (a ``TypeDecorator``), or a parameter is expanded at execution (an
    ``IN`` list): then every page goes through SQLAlchemy. The pages are the same."""
    table = tables.create(
        "direct",
        _pk("id", sa.Integer),
        sa.Column("v", Tenfold if columns == "converted" else sa.Integer, nullable=False),
    )
    with tables.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "v": i} for i in range(1, 51)])
    source: Any = table
    if columns == "expanded":
        source = sa.select(table).where(table.c.id.in_(list(range(1, 51))))
    read: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "ORDER BY" in statement and "LIMIT" in statement:
            read.append(statement)

    seen: list[tuple[int, int]] = []
    sa.event.listen(tables.engine, "before_cursor_execute", count)
    try:

        def fn(batch: Batch) -> None:
            seen.extend((row.id, row.v) for row in batch.records)

        status = kit.map(source, fn, key="id", page_size=10, fanout=1).wait(WAIT)
    finally:
        sa.event.remove(tables.engine, "before_cursor_execute", count)
    tenfold = 10 if columns == "converted" else 1
    assert sorted(seen) == [(i, tenfold * i) for i in range(1, 51)]
    assert (status.rows, status.pages) == (50, 6)  # five full pages, then an empty one
    # Plain: the first page, and the first after a checkpoint (a statement of its own).
    assert len(read) == (2 if columns == "plain" else 6)


def test_a_page_held_through_fn_leaves_the_collector_none_of_its_rows(
    kit: shardkit.Kit, tables: Tables
) -> None:
    """A worker holds its page through fn and its checkpoint, as tuples of values, which
    CPython's collector stops tracking once it has looked at them, not as rows, which
    it would go through on every pass for as long as the page is held."""
    table = tables.create("held", _pk("id", sa.Integer), sa.Column("v", sa.Integer))
    with tables.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "v": i} for i in range(1, 2001)])
    tracked: dict[int, int] = {}
    rows: list[int] = []
    looked: set[str] = set()

    def fn(batch: Batch) -> None:
        if batch.job in looked:
            return  # a look at a job's first page: each goes through the whole heap
        looked.add(batch.job)
        gc.collect()
        objects = gc.get_objects()
        tracked[len(batch.records)] = len(objects)
        # By type: isinstance() asks each object its __class__, which a lazy proxy
        # (Django's, from tests run before in this process) may fail to give.
        rows.append(sum(issubclass(type(o), sa.Row) for o in objects))
        del objects

    # The first job makes what every job after it finds made (statements, caches).
    for page_size in (2000, 10, 2000):
        kit.map(table, fn, page_size=page_size, fanout=1).wait(WAIT)
    assert max(rows) < 100, rows  # held as rows, 2,000 of them
    assert sorted(tracked) == [10, 2000]
    assert tracked[2000] - tracked[10] < 500, tracked  # … and an object tracked a row


def assert_estimate(status: shardkit.mapper.JobStatus, rows: int, engine: sa.Engine) -> None:
    """The job's progress estimate: SQLite's count; PostgreSQL's planner, after its
    autovacuum or our ANALYZE, near the truth, and without them a guess from the table's
    size; MariaDB's, rows its plan reads (filters it cannot use an index for included)."""
    assert status.estimate is not None
    if engine.dialect.name == "sqlite":
        assert status.estimate == rows
    else:
        assert status.estimate > 0


def test_non_transactional_map_visits_every_key_and_refuses_batch_conn(
    kit: shardkit.Kit, tables: Tables
) -> None:
    table, initial = key_table(tables, "string", 800)
    record = Recorder(key_names(table))

    status = kit.map(table, record, page_size=60).wait(WAIT)

    assert set(record.keys) == set(initial)  # every key at least once, and no other
    assert len(record.keys) >= len(initial)
    assert record.conn_refused
    assert all(record.conn_refused)
    assert values(kit, table) == initial  # nothing written
    assert (status.state, status.rows) == ("complete", 800)


def test_fn_and_on_complete_given_as_import_paths(kit: shardkit.Kit, tables: Tables) -> None:
    table, initial = key_table(tables, "sparse", 500)

    job = kit.map(
        table,
        f"{__name__}:record_visit",
        on_complete=f"{__name__}:record_completion",
        page_size=50,
    )
    status = job.wait(WAIT)

    assert sorted(_VISITED[job.id]) == sorted(initial)
    assert _COMPLETED[job.id] == [500]
    assert status.rows == 500
    stored = json.loads(kit.mapper.ledger.spec(job.id) or "{}")
    assert stored["fn"] == f"{__name__}:record_visit"
    assert stored["on_complete"] == f"{__name__}:record_completion"
    assert stored["missing"] == []


# -- splitting -----------------------------------------------------------------------------


def test_skewed_keys_split_into_about_full_pages(kit: shardkit.Kit, tables: Tables) -> None:
    rows, page_size = 2000, 50
    table, initial = key_table(tables, "skewed", rows)
    analyze(tables.engine, table)

    status = kit.map(table, add_ten(table), transactional=True, page_size=page_size).wait(WAIT)

    assert values(kit, table) == plus(initial, 10)
    assert status.rows == rows
    assert status.depth >= 1
    assert status.done > 1
    # Split at the data's quantiles, not the key space's: hardly more pages than rows
    # need, though 90% of them sit in 1% of the keys.
    assert math.ceil(rows / page_size) <= status.pages <= 2 * math.ceil(rows / page_size)


def analyze(engine: sa.Engine, table: sa.Table) -> None:
    """Have the database gather the table's statistics (PostgreSQL: its histograms)."""
    name = engine.dialect.identifier_preparer.format_table(table)
    verb = "ANALYZE" if engine.dialect.name in ("postgresql", "sqlite") else "ANALYZE TABLE"
    with engine.begin() as conn:
        conn.execute(sa.text(f"{verb} {name}"))


class ReadCounter(TableSource):
    """A table source that counts the rows and keys it reads, and its statistics reads."""

    def __init__(self, table: sa.Table, key: Any) -> None:
        super().__init__(table, key)
        self.read = 0
        self.statistics_read = 0
        self.estimates = 0  # planning steps: each reads two bounds, and cuts if it splits
        self._count = threading.Lock()

    def _add(self, rows: int, statistics: int = 0) -> None:
        with self._count:
            self.read += rows
            self.statistics_read += statistics

    def page(self, conn: Any, rng: KeyRange, after: Any, limit: int) -> list[Any]:
        rows = super().page(conn, rng, after, limit)
        self._add(len(rows))
        return rows

    def bounds(self, conn: Any, rng: KeyRange, after: Any) -> Any:
        with self._count:
            self.estimates += 1
        self._add(2)
        return super().bounds(conn, rng, after)

    def statistics(self, conn: Any) -> Statistics:
        self._add(0, 1)
        return super().statistics(conn)


@pytest.mark.parametrize("kind", ["sequential", "skewed", "string"])
def test_planning_reads_a_few_keys_per_split_never_a_range(
    kit: shardkit.Kit, tables: Tables, kind: str
) -> None:
    rows, page_size, fanout = 6000, 50, 4
    table, initial = key_table(tables, kind, rows)
    analyze(tables.engine, table)
    source = ReadCounter(table, "k")

    job = kit.map(source, add_ten(table), transactional=True, page_size=page_size, fanout=fanout)
    status = job.wait(WAIT)

    assert values(kit, table) == plus(initial, 10)
    assert status.rows == rows
    ranges = status.done
    # Every row is read once, by its page; each planning step reads two bounds, and
    # fanout - 1 cuts if it splits; the statistics are read once. (Steps outnumber
    # ranges where a range passes its plan and is estimated again: strings without a
    # histogram, on MySQL, about two a range.)
    assert source.read - rows <= (fanout + 1) * source.estimates
    assert source.read <= 1.25 * rows
    assert source.statistics_read == 1
    assert status.depth >= 1
    if tables.engine.dialect.name == "postgresql":
        # Cut at its histogram's bounds, the leaves hold about rows / fanout**2 each.
        assert ranges <= 1 + fanout + fanout**2 + fanout
    else:  # cut by key arithmetic: uneven where the keys are, yet pages to a range
        assert ranges < status.pages / 2
    assert status.estimate is not None
    assert abs(status.estimate - rows) <= rows // 10


def test_a_range_planned_at_a_leaf_goes_on_in_place(
    kit: shardkit.Kit, tables: Tables, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No worker counts as idle: ranges split by their plans alone (the next test splits
    # one for an idle worker).
    monkeypatch.setattr(LocalExecutor, "idle", property(lambda self: 0))
    rows, page_size, fanout = 6000, 20, 4
    table, initial = key_table(tables, "skewed", rows)
    job = kit.map(table, add_ten(table), transactional=True, page_size=page_size, fanout=fanout)
    status = job.wait(WAIT)

    assert values(kit, table) == plus(initial, 10)
    assert status.rows == rows
    r = ledger_tables(sql_store(kit).prefix).ranges
    with sql_store(kit).engine.connect() as conn:
        ranges = {
            row.id: row
            for row in conn.execute(
                sa.select(
                    r.c.id, r.c.parent, r.c.lo, r.c.hi, r.c.after, r.c.planned, r.c.pages
                ).where(r.c.job == job.id)
            )
        }
    parents = {row.parent for row in ranges.values()}
    assert isinstance(kit.executor, LocalExecutor)
    assert status.estimate is not None
    leaf = max(fanout * page_size, status.estimate // kit.executor.workers)  # one per worker
    few = [row for row in ranges.values() if (row.planned or 1e9) <= leaf + page_size]
    # Visited in place, page after page.
    assert any(row.pages > 2 for row in few)
    for row in few:
        if row.id in parents:  # split all the same: only once past its plan
            parent = ranges[row.parent]
            start = load_key(parent.after) if row.lo == parent.lo else None  # inherited
            rng = KeyRange(load_key(row.lo), load_key(row.hi))
            held = [key for key in initial if rng.contains(key) and (start is None or key > start)]
            assert len(held) > row.planned


def test_a_range_within_its_plan_splits_for_an_idle_worker(store_url: str) -> None:
    rows, page_size = 4000, 50
    with shardkit.connect(store_url, prefix=PREFIX, executor=LocalExecutor(workers=2)) as kit:
        made = Tables(sql_store(kit).engine)
        try:
            table, initial = key_table(made, "sequential", rows)
            source = Misinformed(table, "k")
            source.rows = rows  # two leaves of 2,000 planned rows, one per worker
            seen: list[int] = []  # outside any transaction: SQLite's would block the other
            high_done = threading.Event()

            def fn(batch: Batch) -> None:
                keys = [record.k for record in batch.records]
                seen.extend(keys)
                if keys[-1] == rows:  # the high leaf's last page
                    high_done.set()
                elif keys[0] == page_size + 1:  # the low leaf's first (the root took 1…50)
                    # Held until the high leaf has ended and its worker waits for work.
                    assert high_done.wait(WAIT)
                    executor = kit.executor
                    assert isinstance(executor, LocalExecutor)
                    wait_for(lambda: executor.idle == 1, "the high leaf's worker to idle", WAIT)

            job = kit.map(source, fn, page_size=page_size, fanout=2)
            status = job.wait(WAIT)

            assert sorted(seen) == sorted(initial)
            assert status.rows == rows
            r = ledger_tables(sql_store(kit).prefix).ranges
            with sql_store(kit).engine.connect() as conn:
                ranges = list(conn.execute(sa.select(r).where(r.c.job == job.id)))
            root = KeyRange().id(job.id)
            leaves = [row for row in ranges if row.parent == root]
            assert len(leaves) == 2
            low, high = sorted(leaves, key=lambda row: row.hi is None)  # high: unbounded
            children = {row.parent for row in ranges}
            # Both leaves held what they were planned at; only the one that ran on while a
            # worker was idle split, in two (never below fanout pages each).
            low_range = KeyRange(None, load_key(low.hi))
            held = sum(1 for key in initial if key > page_size and low_range.contains(key))
            assert held <= low.planned
            assert low.id in children
            assert high.id not in children
            halves = [row for row in ranges if row.parent == low.id]
            assert len(halves) == 2
            assert all(row.planned >= 2 * page_size for row in halves)
        finally:
            kit.executor.close()
            made.metadata.drop_all(made.engine)


@pytest.mark.parametrize("planned", [True, False])
def test_a_fanout_of_one_is_a_single_cursor(
    kit: shardkit.Kit, tables: Tables, planned: bool
) -> None:
    table, initial = key_table(tables, "sparse", 600)
    source = TableSource(table, "k") if planned else Unplanned(table, "k")

    status = kit.map(source, add_ten(table), transactional=True, page_size=50, fanout=1).wait(WAIT)

    assert values(kit, table) == plus(initial, 10)
    assert (status.rows, status.done, status.depth, status.pages) == (600, 1, 0, 13)


class _WatchedPage(list[Any]):
    """A page that a weak reference can follow."""


class Watched(TableSource):
    """A table source that records, as it reads each page, whether the page it read
    before is still held by someone."""

    def __init__(self, table: sa.Table, key: str) -> None:
        super().__init__(table, key)
        self.pages: list[weakref.ref[_WatchedPage]] = []
        self.held_at_read: list[bool] = []

    def page(self, conn: Any, rng: KeyRange, after: Any, limit: int) -> list[Any]:
        if self.pages:
            self.held_at_read.append(self.pages[-1]() is not None)
        rows = _WatchedPage(super().page(conn, rng, after, limit))
        self.pages.append(weakref.ref(rows))
        return rows


def test_a_page_is_let_go_when_the_next_is_read_and_when_its_range_ends(
    kit: shardkit.Kit, tables: Tables
) -> None:
    """Not when its step ends: CPython's collector counts objects made less those freed,
    so a page freed just after the next was made keeps that count from growing."""
    table, initial = key_table(tables, "sequential", 200)
    source = Watched(table, "k")
    add = add_ten(table)
    # While fn works on a page, which of the pages read before it are still held.
    held_in_fn: list[list[bool]] = []

    def fn(batch: Batch) -> None:
        held_in_fn.append([page() is not None for page in source.pages[:-1]])
        add(batch)

    status = kit.map(source, fn, transactional=True, page_size=50, fanout=1).wait(WAIT)

    assert values(kit, table) == plus(initial, 10)
    assert (status.rows, status.pages) == (200, 5)  # four full pages, then an empty one
    assert source.held_at_read == [True] * 4  # the page before is let go after the read
    assert held_in_fn == [[], [False], [False] * 2, [False] * 3]  # … not when the job ends
    wait_for(
        lambda: all(page() is None for page in source.pages), "the last page to be let go", WAIT
    )


def test_a_key_declared_unique_needs_no_probe_for_ties(kit: shardkit.Kit, tables: Tables) -> None:
    table, _ = key_table(tables, "string", 30)
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(args[2])

    partial = tables.create(
        "partial",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("k", sa.String(40)),
        sa.Index(None, "k", unique=True, sqlite_where=sa.text("id > 0")),
    )
    assert TableSource(partial, "k")._unique is False  # a partial index holds some rows
    sa.event.listen(tables.engine, "before_cursor_execute", count)
    try:
        with tables.engine.connect() as conn:
            for source in (TableSource(table, "k"), TableSource(sa.select(table), "k")):
                statements.clear()
                assert len(source.page(conn, KeyRange(), None, 10)) == 10
                # The primary key: one statement; a select's column may tie: a probe.
                assert len(statements) == (1 if source.selectable is table else 2)
    finally:
        sa.event.remove(tables.engine, "before_cursor_execute", count)


@pytest.mark.parametrize("kind", ["sequential", "skewed", "string"])
def test_postgresql_reads_each_row_about_once_over_a_job(kind: str) -> None:
    """What PostgreSQL counts as read from the table over a whole job, fn doing nothing
    (``seq_tup_read + idx_tup_fetch``): each row by its page, and a few keys probed to
    plan the splits — at most 1.25 per row (a planner that sampled ranges read 3 to 4).
    The counts are read once every backend of the job has exited, which is after each
    reported its counts. (Rows are stored in key order: see the README on string keys
    in random heap order.)"""
    url = STORE_URLS["postgres"] or ""
    require(url)
    rows, app = 10_000, f"shardkit-tuples-{uuid4().hex[:8]}"
    setup = sa.create_engine(url)
    tables = Tables(setup)
    try:
        keys = sorted(KEY_KINDS[kind].keys(rows, random.Random(0)))
        table = tables.create("acct", *KEY_KINDS[kind].columns(), sa.Column("v", sa.Integer))
        with setup.begin() as conn:
            conn.execute(table.insert(), [{"k": key, "v": 0} for key in keys])
        analyze(setup, table)
        before = tuples_read(setup, table)
        engine = sa.create_engine(url, connect_args={"application_name": app})
        try:
            with shardkit.connect(
                engine, "memory://", prefix=PREFIX, executor=LocalExecutor(workers=4)
            ) as kit:
                status = kit.map(table, lambda batch: None, page_size=50).wait(WAIT)
        finally:
            engine.dispose()
        wait_for(lambda: backends(setup, app) == 0, "the job's connections to close", 30)
        read = tuples_read(setup, table) - before
    finally:
        tables.metadata.drop_all(setup)
        setup.dispose()
    assert status.rows == rows
    assert rows <= read <= 1.25 * rows


def tuples_read(engine: sa.Engine, table: sa.Table) -> int:
    """The table's tuples read so far, as PostgreSQL's statistics count them."""
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        statement = sa.text(
            "SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables "
            "WHERE relid = to_regclass(:name)"
        )
        return int(conn.execute(statement, {"name": table.name}).scalar_one())


def backends(engine: sa.Engine, application: str) -> int:
    with engine.connect() as conn:
        statement = sa.text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :a")
        return int(conn.execute(statement, {"a": application}).scalar_one())


def test_composite_keys_with_few_leading_values_make_a_shallow_tree(
    kit: shardkit.Kit, tables: Tables
) -> None:
    """(tenant, id) keys of four tenants: key arithmetic has no room between adjacent
    tenants, so ranges are cut where the tenant steps, then inside each tenant."""
    table = tables.create(
        "tenants", _pk("a", sa.Integer), _pk("b", sa.Integer), sa.Column("v", sa.Integer)
    )
    initial = {(a, b): 0 for a in range(4) for b in range(2000)}
    with tables.engine.begin() as conn:
        conn.execute(table.insert(), [{"a": a, "b": b, "v": 0} for a, b in initial])

    status = kit.map(table, add_ten(table), transactional=True, page_size=50).wait(WAIT)

    assert values(kit, table) == plus(initial, 10)
    assert status.rows == len(initial)
    assert 4 < status.done < status.pages / 4
    assert status.depth <= 4


def test_cuts_never_pile_up_nor_hold_nul() -> None:
    # No room between adjacent ints: no cut rather than several on one key.
    assert _targets([1, 2], 8) == []
    assert _targets([(0, 5), (1, 3)], 8) == []  # (1, 5) is past (1, 3)
    assert _targets([(0, 1), (1, 9)], 8) == [(1, 1)]
    # Arithmetic between 'item1' and 'item1999' pads with NUL: PostgreSQL's text has none.
    cuts = _targets(["item1", "item1999"], 64)
    assert cuts == sorted(set(cuts))
    assert not any("\0" in cut for cut in cuts)


def test_cuts_inside_a_histograms_buckets_follow_its_alphabet() -> None:
    """Cuts that fall inside the buckets of a histogram of hex strings are placed over the
    hex digits, where the rows are: each within 0.05 % of the rows from where it aims
    (over code points, up to 0.4 % off)."""
    rng = random.Random(5)
    keys = sorted(f"{rng.getrandbits(128):032x}" for _ in range(100_000))
    edges = [keys[min(len(keys) - 1, i * len(keys) // 100)] for i in range(101)]
    cuts = _targets(edges, 8)
    below = [bisect.bisect_left(keys, cut) / len(keys) for cut in cuts]
    assert len(cuts) == 7
    assert all(abs(share - k / 8) < 0.0005 for k, share in enumerate(below, 1))


class Misinformed(TableSource):
    """A table source whose statistics are wrong (``rows``) or fail (None)."""

    rows: int | None

    def statistics(self, conn: Any) -> Statistics:
        if self.rows is None:
            raise RuntimeError("no statistics here")
        return Statistics(self.rows)


@pytest.mark.parametrize("told", [None, 1])
def test_a_job_splits_whatever_its_statistics_say(
    kit: shardkit.Kit, tables: Tables, told: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    table, initial = key_table(tables, "sequential", 3000)
    source = Misinformed(table, "k")
    source.rows = told

    status = kit.map(source, add_ten(table), transactional=True, page_size=50).wait(WAIT)

    assert values(kit, table) == plus(initial, 10)
    assert status.rows == 3000
    assert status.done > 4  # split once past what it was told
    assert status.estimate == told
    assert ("no statistics of its source" in caplog.text) == (told is None)


class Unplanned:
    """A source without statistics (only ``Source``'s methods): its ranges are split by
    key arithmetic between their bounds, planned by the density of their pages."""

    def __init__(self, table: sa.Table | sa.Select[Any], key: Any) -> None:
        self.inner = TableSource(table, key)

    def page(self, conn: Any, rng: KeyRange, after: Any, limit: int) -> list[Any]:
        return self.inner.page(conn, rng, after, limit)

    def key_of(self, row: Any) -> Any:
        return self.inner.key_of(row)

    def bounds(self, conn: Any, rng: KeyRange, after: Any) -> Any:
        return self.inner.bounds(conn, rng, after)

    def portable(self) -> None:
        return None


@pytest.mark.parametrize("kind", ["sparse", "skewed", "string", "bytes", "uuid", "composite"])
def test_a_source_without_statistics_is_split_by_key_arithmetic(
    kit: shardkit.Kit, tables: Tables, kind: str
) -> None:
    table, initial = key_table(tables, kind, 1000)
    source = Unplanned(table, key_arg(table))
    assert not isinstance(source, StatisticsSource)

    job = kit.map(source, add_ten(table), transactional=True, page_size=50)
    status = job.wait(WAIT)

    assert values(kit, table) == plus(initial, 10)
    assert (status.state, status.rows, status.estimate) == ("complete", 1000, None)
    assert status.depth >= 1
    assert status.done > 1


def test_statistics_come_from_the_catalog_not_the_rows(kit: shardkit.Kit, tables: Tables) -> None:
    rows = 3000
    table, initial = key_table(tables, "sparse", rows)
    analyze(tables.engine, table)
    source = TableSource(table, "k")
    with tables.engine.connect() as conn:
        stats = source.statistics(conn)
        filtered = TableSource(sa.select(table).where(table.c.v < 1000), "k").statistics(conn)
    assert stats.rows is not None
    assert abs(stats.rows - rows) <= rows // 10
    assert filtered.rows is not None
    assert filtered.rows <= stats.rows  # MariaDB's plan reads every row for this filter
    assert list(filtered.bounds) == []
    if tables.engine.dialect.name == "postgresql":  # a histogram: equi-depth, ascending
        keys = sorted(initial)
        assert len(stats.bounds) > 50
        assert list(stats.bounds) == sorted(stats.bounds)
        assert stats.bounds[0] == keys[0]
        assert stats.bounds[-1] == keys[-1]
        ranks = [keys.index(bound) for bound in stats.bounds]
        step = rows / (len(ranks) - 1)
        assert all(abs(rank - i * step) <= step for i, rank in enumerate(ranks))
    else:
        assert list(stats.bounds) == []


def test_a_stale_histogram_still_visits_every_row_once(kit: shardkit.Kit, tables: Tables) -> None:
    """Statistics taken before the table tripled (and lost a third of its first rows):
    cuts aimed by the old histogram still partition it, and ranges past their plan split
    again."""
    table, initial = key_table(tables, "sequential", 1500)
    analyze(tables.engine, table)
    more = dict.fromkeys(range(10000, 14500), 0)
    with tables.engine.begin() as conn:
        conn.execute(table.delete().where(table.c.k % 3 == 0))
        conn.execute(table.insert(), [{"k": key, "v": 0} for key in more])
    expected = {key: v + 10 for key, v in {**initial, **more}.items() if key >= 10_000 or key % 3}

    job = kit.map(table, add_ten(table), transactional=True, page_size=50, fanout=4)
    status = job.wait(WAIT)

    assert values(kit, table) == expected
    assert status.rows == len(expected)
    assert status.depth >= 2


def test_a_finishing_range_holds_another_pending_range_until_it_commits(
    kit: shardkit.Kit,
) -> None:
    store, ledger = sql_store(kit), kit.mapper.ledger
    ranges, job = ledger.ranges, f"held-{uuid4().hex[:8]}"
    assert ledger.create(job, "{}")
    root = KeyRange().id(job)
    with store.engine.begin() as conn:
        taken = ledger.take(conn, job, root)
        assert taken is not None
        thirds = [Child(KeyRange(None, 10)), Child(KeyRange(10, 20)), Child(KeyRange(20))]
        done = ledger.checkpoint(
            conn, job, taken, after=None, rows=0, children=thirds, count_page=False
        )
    assert done is not None
    first, *others = done[0]
    unlocked = (
        sa.select(ranges.c.id)
        .where(ranges.c.job == job, ranges.c.state == "pending")
        .with_for_update(skip_locked=True)
    )
    with store.engine.connect() as one, store.engine.connect() as two:
        with one.begin():
            row = ledger.take(one, job, first)
            assert row is not None
            assert ledger.checkpoint(
                one, job, row, after=None, rows=0, children=[], count_page=False
            ) == ([], True)
            if store.dialect.name != "sqlite":  # one writer at a time there: no row locks
                with two.begin():  # the finished range and the held one are both locked
                    free = list(two.execute(unlocked).scalars())
                    assert len(free) == 1
                    assert free[0] in others
        with two.begin():
            assert sorted(two.execute(unlocked).scalars()) == sorted(others)


def test_a_page_whose_checkpoint_moved_on_is_rolled_back_with_fn(
    kit: shardkit.Kit, tables: Tables
) -> None:
    """A run goes on from the checkpoint it left in memory; if another run moved the
    range's checkpoint meanwhile, its page's compare-and-set fails and fn's writes roll
    back with it: each row once."""
    table, initial = key_table(tables, "sequential", 100)
    spec = MapSpec(TableSource(table, "k"), add_ten(table), None, 10, 1, True, 0)
    mapper, job = kit.mapper, f"moved-{uuid4().hex[:8]}"
    assert mapper.ledger.create(job, spec.dumps(None)[0])
    mapper._hold(job, spec)
    root = KeyRange().id(job)

    first = mapper._step(job, root, spec, None)  # keys 1…10, from the ledger
    assert first is not None
    assert first.row is not None
    second = mapper._step(job, root, spec, first.row)  # 11…20, from memory
    assert second is not None
    assert second.state == "pending"
    assert mapper._step(job, root, spec, first.row) is None  # 11…20 again: moved on

    assert values(kit, table) == {k: v + 10 if k <= 20 else v for k, v in initial.items()}
    assert job_row(kit, job, root)[:2] == ("20", 20)


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)  # a check deferred to COMMIT
@pytest.mark.parametrize("pooled", [False, True])
def test_a_page_whose_commit_fails_says_so_and_keeps_nothing(
    kit: shardkit.Kit, tables: Tables, pooled: bool
) -> None:
    """A transactional page whose COMMIT fails (here on a constraint checked only then)
    raises ``BackendError`` saying that its COMMIT failed, the database's error chained
    as SQLAlchemy's naming the COMMIT (sent with the checkpoint in one round trip on a
    direct connection; on its own behind a pooler), not the checkpoint; a job of no
    retries fails with that message. No password anywhere, and neither fn's writes nor
    the checkpoint are kept."""
    import psycopg

    url = sql_store(kit).engine.url
    url = url.set(password=url.password or "s3cret-pw")  # ignored by a server that trusts
    password = url.password
    assert password is not None
    table, initial = key_table(tables, "sequential", 100)
    marks = tables.create(
        "marks",
        sa.Column("n", sa.Integer),
        sa.UniqueConstraint("n", deferrable=True, initially="DEFERRED"),
    )
    add = add_ten(table)

    def fn(batch: Batch) -> None:
        add(batch)
        batch.conn.execute(marks.insert(), [{"n": 1}, {"n": 1}])  # refused at COMMIT

    def configure(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        if pooled:  # as behind a transaction pooler: nothing prepared, the COMMIT alone
            dbapi_connection.prepare_threshold = None

    spec = MapSpec(TableSource(table, "k"), fn, None, 10, 1, True, 0)
    with Target(url.render_as_string(hide_password=False), "memory://").connect() as secret:
        mapper, job = secret.mapper, f"refused-{uuid4().hex[:8]}"
        sa.event.listen(sql_store(secret).engine, "checkout", configure)
        assert mapper.ledger.create(job, spec.dumps(None)[0])
        mapper._hold(job, spec)
        root = KeyRange().id(job)
        with pytest.raises(BackendError) as raised:
            mapper._step(job, root, spec, None)
        said = (
            f"store {secret.store.url} failed while committing (mapping a range of job {job!r}): "
            "duplicate key value violates unique constraint"
        )
        assert str(raised.value).startswith(said)
        cause = raised.value.__cause__
        assert isinstance(cause, sa.exc.IntegrityError)
        assert isinstance(cause.orig, psycopg.errors.UniqueViolation)
        # SQLAlchemy names the statement that failed: the COMMIT (its own has none).
        assert (cause.statement, cause.params) == (None if pooled else "COMMIT", None)
        assert "UPDATE" not in str(cause)  # the checkpoint's
        mapper.run_range(job, root)  # fails the job: no retries
        with pytest.raises(JobFailed) as failed:
            secret.job(job).wait(WAIT)
        assert f"BackendError: {said}" in str(failed.value)
        told = [str(raised.value), repr(raised.value), str(cause), str(failed.value)]
        assert not [text for text in told if password in text]
    assert values(kit, table) == initial
    assert job_row(kit, job, root) == (None, 0, 0)
    with tables.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(marks)).scalar_one() == 0


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)  # prepared statements
def test_a_page_whose_checkpoint_the_session_forgot_is_visited_again(
    kit: shardkit.Kit, tables: Tables
) -> None:
    """A page's checkpoint runs as a statement prepared in the session. If the session
    loses it (``DEALLOCATE ALL``, which psycopg runs when it rolls back after preparing
    statements of its own), the page rolls back with fn's writes and is visited again,
    the statement prepared again: each row once."""
    table, initial = key_table(tables, "sequential", 100)
    add = add_ten(table)
    mapper, job = kit.mapper, f"forgot-{uuid4().hex[:8]}"
    checkpoint = (mapper.ledger._direct[False, True], True)  # a page's after the first
    firsts: list[Any] = []
    forgot: list[Any] = []

    def fn(batch: Batch) -> None:
        firsts.append(batch.rows[0]["k"])
        add(batch)
        if not forgot and checkpoint in batch.conn.info:  # prepared in this session
            forgot.append(firsts[-1])
            batch.conn.exec_driver_sql("DEALLOCATE ALL")

    spec = MapSpec(TableSource(table, "k"), fn, None, 10, 1, True, 0)
    assert mapper.ledger.create(job, spec.dumps(None)[0])
    mapper._hold(job, spec)
    root = KeyRange().id(job)
    row, rolled_back = None, 0
    for _ in range(20):  # as run_range steps: from the ledger again after a rollback
        step = mapper._step(job, root, spec, row)
        rolled_back += step is None
        if step is not None and step.state != "pending":
            break
        row = None if step is None else step.row
    assert step is not None
    assert step.state == "done"
    assert rolled_back == 1
    assert len(forgot) == 1
    assert firsts == sorted(firsts)
    assert [k for k in firsts if firsts.count(k) > 1] == [forgot[0]] * 2
    assert values(kit, table) == plus(initial, 10)
    assert job_row(kit, job, root)[1] == 100


def round_trips(engine: sa.Engine, action: Callable[[], object], path: Path) -> list[list[str]]:
    """The round trips to PostgreSQL that ``action`` makes on connections it checks out of
    ``engine`` (libpq's trace): in each, what each statement sent is — the first word of
    its text; PREPARE for a statement prepared under a name, EXECUTE for one run by
    its name."""
    from psycopg import pq

    traced: list[Any] = []
    with path.open("a") as out:

        def trace(dbapi_connection: Any, record: Any, proxy: Any) -> None:
            pgconn = dbapi_connection.pgconn
            pgconn.trace(out.fileno())
            pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
            traced.append(pgconn)

        sa.event.listen(engine, "checkout", trace)
        try:
            action()
        finally:
            sa.event.remove(engine, "checkout", trace)
            for pgconn in traced:
                pgconn.untrace()
    trips: list[list[str]] = []
    statements: list[str] = []
    # A message per line, but a statement's own line breaks go into the trace as they are.
    for message in re.split(r"\n(?=[FB]\t)", path.read_text()):
        sender, _, kind, *rest = message.split("\t", 3)
        if sender != "F":
            continue
        text = rest[0] if rest else ""
        if kind == "Parse":  # an extended-protocol statement: sent on the next Sync
            _, name, _, sql, *_ = text.split('"')
            statements.append(sql.split()[0] if name == "" else "PREPARE")
        elif kind == "Bind" and text.split('"')[3] != "":
            statements.append("EXECUTE")
        elif kind == "Sync":
            trips.append(statements)
            statements = []
        elif kind == "Query":  # the simple protocol: a round trip of its own
            trips.append([part.split()[0] for part in text.strip(' "\n').split(";")])
    return trips


def third_page_trips(
    kit: shardkit.Kit, tables: Tables, transactional: bool, path: Path, *, pooled: bool
) -> list[list[str]]:
    """The round trips of the third page of a range (its first read the ledger's row, its
    second the first to count itself): as behind a transaction pooler (``pooled``:
    psycopg's ``prepare_threshold`` None, no statement prepared), or on a direct
    connection. Every page runs on the same connection: the pool's idle ones are closed
    first, and the source's statistics, which the first page would read on a connection
    of their own, are read before it."""
    assert sql_store(kit).dialect.name == "postgresql"  # libpq's trace
    engine = sql_store(kit).engine
    table, initial = key_table(tables, "sequential", 100)
    fn = add_ten(table) if transactional else lambda batch: None
    spec = MapSpec(TableSource(table, "k"), fn, None, 10, 1, transactional, 0)
    mapper, job = kit.mapper, f"trips-{uuid4().hex[:8]}"

    def configure(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        if pooled:
            dbapi_connection.prepare_threshold = None

    sa.event.listen(engine, "checkout", configure)
    try:
        assert mapper.ledger.create(job, spec.dumps(None)[0])
        mapper._hold(job, spec)
        engine.pool.dispose()
        mapper._statistics(job, spec)
        root, row, steps = KeyRange().id(job), None, []
        for _ in range(2):
            steps.append(mapper._step(job, root, spec, row))
            row = steps[-1].row
        trips = round_trips(engine, lambda: steps.append(mapper._step(job, root, spec, row)), path)
    finally:
        sa.event.remove(engine, "checkout", configure)
    assert [step.state for step in steps] == ["pending"] * 3
    assert job_row(kit, job, root)[:2] == ("30", 30)
    if transactional:
        assert values(kit, table) == {k: v + 10 if k <= 30 else v for k, v in initial.items()}
    return trips


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)  # its block counts
def test_a_page_past_a_checkpoint_walks_a_composite_keys_index_from_there(
    tables: Tables,
) -> None:
    """PostgreSQL keeps the tighter of two bounds on one column, not of two row values:
    given the range's start and the checkpoint, it walks a composite key's index from
    the start. Read past the checkpoint (``KeyRange.past``), a page starts there."""
    table = tables.create("wide", _pk("tenant", sa.Integer), _pk("n", sa.Integer))
    with tables.engine.begin() as conn:
        conn.execute(table.insert(), [{"tenant": t, "n": n} for t in (1, 2) for n in range(5000)])
        conn.exec_driver_sql(f"ANALYZE {table.name}")
    source = TableSource(table, ("tenant", "n"))
    rng, after = KeyRange((1, 0), (2, 100)), (1, 4900)
    fetched = sa.text("SELECT pg_stat_get_xact_blocks_fetched(CAST(:index AS regclass))")
    with tables.engine.begin() as conn:

        def blocks(read: Callable[[], list[Any]]) -> tuple[list[Any], int]:
            before = conn.execute(fetched, {"index": f"{table.name}_pkey"}).scalar_one()
            rows = read()
            after_read = conn.execute(fetched, {"index": f"{table.name}_pkey"}).scalar_one()
            return rows, after_read - before

        past, from_there = blocks(lambda: source.page(conn, rng.past(after), after, 20))
        bounded, from_start = blocks(lambda: source.page(conn, rng, after, 20))
    assert list(past) == list(bounded)  # the same page: (1, 4901) … (1, 4920)
    assert [tuple(row) for row in past][:2] == [(1, 4901), (1, 4902)]
    assert from_there <= 4 < from_start


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)  # libpq's trace
def test_a_transactional_page_commits_with_its_checkpoint(
    kit: shardkit.Kit, tables: Tables, tmp_path: Path
) -> None:
    """A transactional page that keeps its range pending: BEGIN, the page, fn's
    statements (prepared by psycopg's ``executemany``), and its checkpoint with the
    COMMIT in one round trip (the checkpoint prepared on the connection by a page
    before)."""
    trips = third_page_trips(kit, tables, True, tmp_path / "trace", pooled=False)
    assert trips == [["BEGIN"], ["SELECT"], ["EXECUTE"] * 10, ["EXECUTE", "COMMIT"]]


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)  # libpq's trace
def test_a_transactional_page_behind_a_pooler_commits_after_its_checkpoint(
    kit: shardkit.Kit, tables: Tables, tmp_path: Path
) -> None:
    """Behind a transaction pooler, where a session's prepared statements are not its
    own, the checkpoint is sent whole and the COMMIT after it."""
    trips = third_page_trips(kit, tables, True, tmp_path / "trace", pooled=True)
    assert trips == [["BEGIN"], ["SELECT"], ["UPDATE"] * 10, ["WITH"], ["COMMIT"]]


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)  # libpq's trace
@pytest.mark.parametrize(("pooled", "checkpoint"), [(False, "EXECUTE"), (True, "WITH")])
def test_an_at_least_once_page_reads_and_checkpoints_outside_transactions(
    kit: shardkit.Kit, tables: Tables, tmp_path: Path, pooled: bool, checkpoint: str
) -> None:
    """A page of a job that is not transactional is two round trips: its read and its
    checkpoint, each autocommitted (no BEGIN, COMMIT or ROLLBACK)."""
    trips = third_page_trips(kit, tables, False, tmp_path / "trace", pooled=pooled)
    assert trips == [["SELECT"], [checkpoint]]


def test_standalone_statements_commit_as_they_run_where_that_is_free(kit: shardkit.Kit) -> None:
    """``standalone`` runs autocommitted where that is free: another connection sees its
    write before it returns (not on MySQL, where it is a transaction); after, always."""
    store = sql_store(kit)
    name = f"standalone-{uuid4().hex[:8]}"
    kit.sharded(name, shards=1)
    shards = store.shards_table
    total = sa.select(sa.func.coalesce(sa.func.sum(shards.c.value), 0)).where(shards.c.name == name)

    def seen() -> int:
        with store.engine.connect() as other:
            return int(other.execute(total).scalar_one())

    def work(conn: sa.Connection) -> int:
        conn.execute(sa.insert(shards).values(name=name, shard=0, value=5))
        return seen()

    assert store.standalone("a test", work) == (5 if store.autocommits_free else 0)
    assert store.autocommits_free == (store.dialect.name != "mysql")
    assert seen() == 5


def job_row(kit: shardkit.Kit, job: str, range_id: str) -> tuple[str, int, int]:
    """A range's checkpoint, rows and pages in the ledger."""
    r = ledger_tables(sql_store(kit).prefix).ranges
    with sql_store(kit).engine.connect() as conn:
        row = conn.execute(
            sa.select(r.c.after, r.c.rows, r.c.pages).where(r.c.job == job, r.c.id == range_id)
        ).one()
    return row.after, row.rows, row.pages


def test_finished_ranges_leave_completing_the_job_to_the_last(
    kit: shardkit.Kit, tables: Tables, monkeypatch: pytest.MonkeyPatch
) -> None:
    table, initial = key_table(tables, "sequential", 2000)
    engine, ledger = sql_store(kit).engine, kit.mapper.ledger
    commits: list[object] = []
    looked: list[str] = []
    look = ledger.any_pending

    def count(conn: sa.Connection) -> None:
        commits.append(conn)

    def any_pending(job: str) -> bool:
        looked.append(job)
        return look(job)

    monkeypatch.setattr(ledger, "any_pending", any_pending)
    sa.event.listen(engine, "commit", count)
    try:
        # No statistics: split by key arithmetic into ranges of a few pages, many of them.
        job = kit.map(Unplanned(table, "k"), add_ten(table), transactional=True, page_size=10)
        status = job.wait(WAIT)
    finally:
        sa.event.remove(engine, "commit", count)

    assert values(kit, table) == plus(initial, 10)
    assert status.state == "complete"
    assert isinstance(kit.executor, LocalExecutor)
    workers = kit.executor.workers
    assert status.done > 4 * workers  # many ranges finished
    # A range that finishes while it can hold another pending range leaves completing
    # the job to it; only those that finish with every other one in flight look for
    # pending ranges (outside any transaction), and only those that find none open the
    # transaction that completes the job. Commits: the job, its estimate, the pages,
    # those transactions, and where autocommits are not free the count of each run
    # begun. (How many ranges finish last of those in flight depends on the machine's
    # load: about ``workers`` on a quiet one, 9 for 4 workers seen on a busy one; never
    # most of them.)
    assert len(looked) <= status.done // 2
    runs = sum(r.runs for r in job.ranges(10_000))
    assert runs >= status.done
    started = 0 if sql_store(kit).autocommits_free else runs
    assert len(commits) <= 2 + status.pages + len(looked) + started


# -- idempotency, failure, resume, cancel ---------------------------------------------------


def test_running_finished_ranges_again_changes_nothing(kit: shardkit.Kit, tables: Tables) -> None:
    table, initial = key_table(tables, "sequential", 600)
    calls: list[int] = []
    job = kit.map(
        table,
        add_ten(table),
        transactional=True,
        page_size=50,
        on_complete=lambda done: calls.append(done.rows),
    )
    before = job.wait(WAIT)
    ids = range_ids(kit, job.id)
    assert len(ids) > 1

    for range_id in ids:
        kit.mapper.run_range(job.id, range_id)
    kit.job(job.id).resume()  # a complete job: nothing to do

    assert values(kit, table) == plus(initial, 10)
    assert job.status() == before
    assert calls == [600]


def test_retries_count_the_failures_of_one_page_not_of_a_whole_range(
    kit: shardkit.Kit, tables: Tables
) -> None:
    table, initial = key_table(tables, "sequential", 600)
    failed: set[Any] = set()
    apply = add_ten(table)

    def fn(batch: Batch) -> None:
        first = batch.records[0].k
        if first not in failed:  # every page fails once, then goes through
            failed.add(first)
            raise RuntimeError(f"the page at {first} failed once")
        apply(batch)

    # One range of 20 pages (fanout 1): 20 failures, never two in a row.
    job = kit.map(table, fn, transactional=True, page_size=30, fanout=1, retries=1)
    status = job.wait(WAIT)

    assert values(kit, table) == plus(initial, 10)
    assert (status.state, status.rows, status.failures) == ("complete", 600, 20)
    assert status.taken_over == 0  # every run after the first follows a recorded failure


class _Died(BaseException):
    """Ends a range's run as its worker's death would: nothing catches or records it."""


def test_a_range_run_again_after_its_run_died_is_counted_taken_over(
    tables: Tables, store_url: str
) -> None:
    table, initial = key_table(tables, "sequential", 600)
    apply = add_ten(table)
    pages = 0

    def fn(batch: Batch) -> None:
        nonlocal pages
        pages += 1
        apply(batch)
        if pages == 3:
            raise _Died  # mid-page: its update is rolled back with it

    held = HeldExecutor()  # the range's task, delivered by hand below
    with shardkit.connect(
        store_url, "memory://", prefix=PREFIX, executor=held, secret="s3cret"
    ) as here:
        job = here.map(table, fn, transactional=True, page_size=30, fanout=1)
        [(_, task)] = held.submitted
        with pytest.raises(_Died):
            here.mapper.run_range(job.id, task["range"])
        status = job.status()
        assert (status.rows, status.failures, status.taken_over) == (60, 0, 0)
        here.mapper.run_range(job.id, task["range"])  # delivered again
        status = job.status()
        [root] = job.ranges()
        assert values(here, table) == plus(initial, 10)
    assert (status.state, status.rows, status.failures, status.taken_over) == (
        "complete",
        600,
        0,
        1,
    )
    assert (root.runs, root.failures) == (2, 0)


def test_a_range_delivered_twice_while_it_runs_is_counted_taken_over(
    tables: Tables, store_url: str
) -> None:
    """The stated limit: a range's task delivered again while its first run still runs
    (a broker's visibility timeout shorter than the run) begins a second run while no
    failure is recorded, which the ledger counts as a takeover, as for a run that died;
    it stays counted after the first run ends well. Both runs visit the page the first
    holds; the rows are counted once."""
    table, _ = key_table(tables, "sequential", 60)
    entered, release = threading.Event(), threading.Event()
    visits: list[int] = []

    def fn(batch: Batch) -> None:
        visits.append(batch.records[0].k)
        if len(visits) == 1:  # the first run holds its first page
            entered.set()
            assert release.wait(WAIT)

    executor = LocalExecutor(workers=2)
    with shardkit.connect(store_url, "memory://", prefix=PREFIX, executor=executor) as here:
        job = here.map(table, fn, page_size=30, fanout=1)
        assert entered.wait(WAIT)
        root = KeyRange().id(job.id)
        executor.submit(TASK, {"job": job.id, "range": root})  # delivered again
        during = job.wait(WAIT)  # the second run visits the range to its end
        release.set()
        executor.close()  # drained: the first run has ended too
        after = job.status()
        [ranged] = job.ranges()
    assert (during.state, during.rows, during.failures, during.taken_over) == (
        "complete",
        60,
        0,
        1,
    )
    assert after == during
    assert (ranged.runs, ranged.failures) == (2, 0)
    assert sorted(visits) == [1, 1, 31]  # the first page by both runs


def test_a_failed_job_resumes_where_it_stopped(kit: shardkit.Kit, tables: Tables) -> None:
    table, initial = key_table(tables, "sequential", 1000)
    bad = 777
    broken = threading.Event()
    broken.set()
    apply = add_ten(table)

    def fn(batch: Batch) -> None:
        if broken.is_set() and any(row["k"] == bad for row in batch.rows):
            raise RuntimeError(f"row {bad} is broken")
        apply(batch)

    job = kit.map(table, fn, transactional=True, page_size=50, retries=1)
    with pytest.raises(JobFailed, match=f"row {bad} is broken"):
        job.wait(WAIT)

    def applied() -> dict[Any, int]:
        return {k: v - initial[k] for k, v in values(kit, table).items()}

    # Each page's writes commit with its checkpoint: the rows counted are the rows applied.
    wait_for(
        lambda: sum(1 for d in applied().values() if d) == job.status().rows,
        "the ledger to agree with the rows applied",
        status=job.status,
    )
    deltas = applied()
    assert set(deltas.values()) <= {0, 10}  # none applied twice
    assert deltas[bad] == 0
    assert deltas[1] == 10  # the first page was applied
    failed = job.status()
    assert failed.state == "failed"
    assert f"row {bad} is broken" in (failed.error or "")
    assert 50 <= failed.rows < 1000
    assert failed.pending >= 1

    broken.clear()
    assert job.resume() >= 1
    status = job.wait(WAIT)

    assert values(kit, table) == plus(initial, 10)
    assert (status.state, status.rows, status.pending) == ("complete", 1000, 0)


def test_waiting_polls_the_jobs_state_and_counts_its_ranges_once(
    kit: shardkit.Kit, tables: Tables, monkeypatch: pytest.MonkeyPatch
) -> None:
    table, initial = key_table(tables, "sequential", 300)
    store, polled, reads = sql_store(kit), threading.Event(), []
    read, add = store.read, add_ten(table)

    def reading(action: str, statement: Any, **options: Any) -> list[Any]:
        if threading.current_thread() is threading.main_thread():  # the waiter's
            reads.append(action)
            polled.set()
        return read(action, statement, **options)

    def fn(batch: Batch) -> None:
        assert polled.wait(WAIT)  # the job runs while it is waited for
        add(batch)

    job = kit.map(table, fn, transactional=True, page_size=50)
    monkeypatch.setattr(store, "read", reading)
    done = job.wait(WAIT, poll=0.01)

    assert (done.state, done.rows) == ("complete", 300)
    # Polled by its state alone (one row by its key); its ranges counted once, at the end.
    *polls, last = reads
    assert polls
    assert set(polls) == {f"reading job {job.id!r}"}
    assert last == "reading job status"
    assert values(kit, table) == plus(initial, 10)


def test_waiting_wakes_when_the_kit_finishes_the_job(kit: shardkit.Kit, tables: Tables) -> None:
    table, initial = key_table(tables, "sequential", 300)
    job = kit.map(table, add_ten(table), transactional=True, page_size=50)
    # Read once an hour, for at most an hour: only the news of the job's end, from its
    # kit, ends the wait before then.
    waited: dict[str, shardkit.mapper.JobStatus] = {}
    threading.Thread(
        target=lambda: waited.update(done=job.wait(3600, poll=3600)), daemon=True
    ).start()
    wait_for(lambda: bool(waited), "the wait to end with the job", WAIT)

    done = waited["done"]
    assert (done.state, done.rows) == ("complete", 300)
    assert values(kit, table) == plus(initial, 10)


def test_a_page_outside_any_transaction_holds_no_connection_while_fn_runs(
    kit: shardkit.Kit, tables: Tables, store_url: str
) -> None:
    table, _ = key_table(tables, "sequential", 200)
    held: list[int] = []
    one = shardkit.connect(store_url, "memory://", prefix=PREFIX, executor=LocalExecutor(1))
    with one:
        pool = sql_store(one).engine.pool

        def fn(batch: Batch) -> None:
            held.append(pool.checkedout())

        completed = threading.Event()  # waited for without polling: no other reads
        job = one.map(table, fn, page_size=50, on_complete=lambda _: completed.set())
        assert completed.wait(WAIT)
        assert job.wait(WAIT).rows == 200
    # The read's connection went back to the pool before fn ran: a non-transactional
    # job's worker uses one connection at a time, however long fn takes.
    assert held
    assert set(held) == {0}


def test_a_ledger_made_before_planned_rows_and_tries_gains_the_columns(
    kit: shardkit.Kit, tables: Tables, store_url: str
) -> None:
    prefix = f"{PREFIX}v0{uuid4().hex[:6]}_"
    engine = sa.create_engine(store_url)
    earlier = SqlStore(engine, prefix=prefix)
    try:
        earlier.create_schema()
        ledger_tables(prefix).create(earlier)
        with engine.begin() as conn:  # as the tables were made before `planned` and `tries`
            conn.exec_driver_sql(f"ALTER TABLE {prefix}ranges DROP COLUMN planned")
            conn.exec_driver_sql(f"ALTER TABLE {prefix}ranges DROP COLUMN tries")
        table, initial = key_table(tables, "sequential", 300)
        with shardkit.connect(store_url, "memory://", prefix=prefix) as later:
            job = later.map(table, add_ten(table), transactional=True, page_size=20, fanout=2)
            assert job.wait(WAIT).rows == 300
        assert values(kit, table) == plus(initial, 10)
    finally:
        ledger_tables(prefix).metadata.drop_all(engine)
        earlier.metadata.drop_all(engine)
        engine.dispose()


def test_a_cancelled_job_stops_taking_ranges(kit: shardkit.Kit, tables: Tables) -> None:
    table, _ = key_table(tables, "sequential", 1000)
    entered, release = threading.Event(), threading.Event()
    record = Recorder(["k"])

    def fn(batch: Batch) -> None:
        record(batch)
        entered.set()
        release.wait(WAIT)

    job = kit.map(table, fn, page_size=50)
    try:
        assert entered.wait(WAIT)
        assert job.cancel()
        assert not job.cancel()  # already stopped
    finally:
        release.set()
    with pytest.raises(JobFailed, match="cancelled"):
        job.wait(WAIT)

    kit.executor.close()  # every task it was given has run
    status = job.status()
    assert status.state == "cancelled"
    assert record.keys == list(range(1, 51))  # the page in flight, and nothing after it
    assert status.rows in (0, 50)
    assert status.pending >= 1
    pending = kit.mapper.ledger.pending(job.id)
    assert len(pending) == status.pending

    assert job.resume() == 0  # a cancelled job stays cancelled
    for range_id in pending:
        kit.mapper.run_range(job.id, range_id)
    assert record.keys == list(range(1, 51))
    assert job.status() == status
    assert sorted(kit.mapper.ledger.pending(job.id)) == sorted(pending)


def closure_job(table: sa.Table, fail: threading.Event | None = None) -> Callable[[Batch], None]:
    """A job's fn that only this process has: a fresh closure (weakly referenceable), which
    raises while ``fail`` is set."""
    apply = add_ten(table)

    def fn(batch: Batch) -> None:
        if fail is not None and fail.is_set():
            raise RuntimeError("failing on purpose")
        apply(batch)

    return fn


def collected(*refs: weakref.ref[Any]) -> bool:
    """Whether every object of ``refs`` is gone, after one full collection (a pass over
    the whole heap of a worker that has run many tests)."""
    gc.collect()
    return all(ref() is None for ref in refs)


def test_finished_jobs_release_their_functions(kit: shardkit.Kit, tables: Tables) -> None:
    table, initial = key_table(tables, "sequential", 120)
    done = []
    for _ in range(5):
        fn = closure_job(table)
        done.append(weakref.ref(fn))
        kit.map(table, fn, transactional=True, page_size=50).wait(WAIT)
        del fn
    assert values(kit, table) == plus(initial, 50)
    assert collected(*done)  # complete: released

    fail = threading.Event()
    fail.set()
    fn = closure_job(table, fail)
    failing, job = weakref.ref(fn), kit.map(table, fn, transactional=True, retries=0)
    del fn
    with pytest.raises(JobFailed, match="failing on purpose"):
        job.wait(WAIT)
    # Failed, and only this process has its function: kept for resume().
    assert not collected(failing)
    fail.clear()
    job.resume()
    assert job.wait(WAIT).state == "complete"
    assert collected(failing)
    assert values(kit, table) == plus(initial, 60)


def test_a_job_finished_elsewhere_is_released_when_the_next_starts(
    kit: shardkit.Kit, tables: Tables, store_url: str
) -> None:
    table, _ = key_table(tables, "sequential", 100)
    held = HeldExecutor()  # the job's first range waits here: it runs nowhere
    with shardkit.connect(
        store_url, "memory://", prefix=PREFIX, executor=held, secret="s3cret"
    ) as here:
        fn = closure_job(table)
        started, job = weakref.ref(fn), here.map(table, fn, transactional=True)
        del fn
        assert kit.job(job.id).cancel()  # another kit (another process) stops it
        assert not collected(started)  # nothing here has seen it finish yet
        here.map(table, closure_job(table), transactional=True)
        assert collected(started)


# -- jobs ----------------------------------------------------------------------------------


def test_jobs_are_found_by_id_and_a_job_id_runs_once(kit: shardkit.Kit, tables: Tables) -> None:
    with pytest.raises(JobNotFound):
        kit.job("nope")
    table, initial = key_table(tables, "sequential", 600)
    calls: list[int] = []
    job_id = f"fixed-{uuid4().hex[:8]}"

    def start() -> Job:
        return kit.map(
            table,
            add_ten(table),
            transactional=True,
            page_size=50,
            on_complete=lambda done: calls.append(done.rows),
            job=job_id,
        )

    first = start()
    second = start()  # the same job, resumed while it runs
    assert first.id == second.id == job_id
    assert job_id in [status.id for status in kit.jobs()]
    assert kit.job(job_id).status().state in ("running", "complete")
    second.wait(WAIT)
    status = first.wait(WAIT)
    third = start()  # the same job, complete: nothing to do
    assert third.wait(WAIT) == status

    assert values(kit, table) == plus(initial, 10)
    assert (status.state, status.rows) == ("complete", 600)
    assert calls == [600]
    assert [s for s in kit.jobs() if s.id == job_id] == [status]
    assert kit.job(job_id).status() == status


BAD_INPUT = [
    ({"page_size": 0}, ValidationError),
    ({"page_size": True}, ValidationError),
    ({"page_size": 100_001}, ValidationError),
    ({"fanout": 0}, ValidationError),
    ({"fanout": 65}, ValidationError),
    ({"retries": -1}, ValidationError),
    ({"job": "a b"}, ValidationError),
    ({"job": ""}, ValidationError),
    ({"job": "x" * 65}, ValidationError),
    ({"job": 7}, ValidationError),
    ({"key": "nope"}, ConfigurationError),
    ({"source": [1, 2, 3]}, ConfigurationError),
    ({"fn": 42}, ConfigurationError),
    ({"fn": "no.such:thing"}, ConfigurationError),
    ({"fn": "not-a-path"}, ConfigurationError),
    ({"on_complete": "no.such:thing"}, ConfigurationError),
    ({"on_complete": 3}, ConfigurationError),
]


def test_bad_input_raises_before_anything_is_written(kit: shardkit.Kit, tables: Tables) -> None:
    table, initial = key_table(tables, "sequential", 20)
    good: dict[str, Any] = {"source": table, "fn": add_ten(table), "transactional": True}
    before = ledger_rows(kit)

    for bad, error in BAD_INPUT:
        with pytest.raises(error):
            kit.map(**{**good, **bad})
        assert ledger_rows(kit) == before, bad

    # The same call without the bad option writes a job and its root range.
    job = kit.map(**good, job="x" * 64)
    job.wait(WAIT)
    assert values(kit, table) == plus(initial, 10)
    assert ledger_rows(kit)[0] == before[0] + 1


# -- specs that travel ---------------------------------------------------------------------

_VISITED: dict[str, list[Any]] = {}
_COMPLETED: dict[str, list[int]] = {}
_LOCK = threading.Lock()


def record_visit(batch: Batch) -> None:
    """A module-level fn: travels by import path."""
    with _LOCK:
        _VISITED.setdefault(batch.job, []).extend(row["k"] for row in batch.rows)


def record_completion(done: Completion) -> None:
    with _LOCK:
        _COMPLETED.setdefault(done.job, []).append(done.rows)


class CreatesFile:
    """Unpickling this creates a file: what a forged payload could do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def forge(signed: str, payload: bytes) -> str:
    """A signed text whose payload is replaced, its signature kept."""
    raw = base64.b64decode(signed)
    return base64.b64encode(raw[:32] + payload).decode()


def test_signed_payloads_round_trip_and_forged_ones_are_never_unpickled(tmp_path: Path) -> None:
    control = tmp_path / "control"
    cloudpickle.loads(cloudpickle.dumps(CreatesFile(control)))
    assert control.exists()  # the payload used below does have a side effect

    ours, theirs = Signer("our secret"), Signer(b"their secret")
    step = 3
    text = ours.dumps({"fn": lambda x: x + step, "n": 1})
    loaded = ours.loads(text)
    assert loaded["fn"](1) == 4
    assert loaded["n"] == 1
    assert "our secret" not in repr(ours)

    target = tmp_path / "target"
    with pytest.raises(UntrustedPayload):
        ours.loads(theirs.dumps(CreatesFile(target)))
    with pytest.raises(UntrustedPayload):
        ours.loads(forge(text, cloudpickle.dumps(CreatesFile(target))))
    with pytest.raises(UntrustedPayload):
        theirs.loads(text)
    with pytest.raises(UntrustedPayload):
        ours.loads("not base64 at all!")
    with pytest.raises(UntrustedPayload):
        ours.loads(base64.b64encode(b"short").decode())
    assert not target.exists()
    with pytest.raises(ConfigurationError):
        Signer("")


@pytest.fixture
def spec_engine(tmp_path: Path) -> Iterator[tuple[sa.Engine, sa.Table]]:
    """A database of its own holding one table, for specs to rebuild sources from."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'spec.db'}")
    table = sa.Table(
        "accounts",
        sa.MetaData(),
        _pk("k", sa.Integer),
        sa.Column("v", sa.Integer, nullable=False),
    )
    table.create(engine)
    yield engine, table
    engine.dispose()


def spec_of(source: Any, fn: Any, on_complete: Any = None) -> MapSpec:
    return MapSpec(
        source=source,
        fn=fn,
        on_complete=on_complete,
        page_size=70,
        fanout=5,
        transactional=True,
        retries=2,
    )


def test_a_closure_travels_only_signed(
    spec_engine: tuple[sa.Engine, sa.Table], tmp_path: Path
) -> None:
    engine, table = spec_engine
    offset = 7

    def shifted(batch: Batch) -> list[int]:
        return [row["v"] + offset for row in batch.rows]

    spec = spec_of(TableSource(table, None), shifted)
    assert reference(shifted) is None

    text, missing = spec.dumps(None)
    assert missing == ["fn"]
    assert json.loads(text)["fn"] is None
    with pytest.raises(ConfigurationError, match="fn"):
        MapSpec.loads(text, engine, None)
    with pytest.raises(ConfigurationError, match="fn"):
        MapSpec.loads(text, engine, Signer("s"))  # a secret now cannot bring it back

    signer = Signer("s")
    text, missing = spec.dumps(signer)
    assert missing == []
    rebuilt = MapSpec.loads(text, engine, signer)
    assert rebuilt.fn is not shifted
    assert rebuilt.fn(Batch([{"v": 1}, {"v": 5}], "job", "range")) == [8, 12]
    assert isinstance(rebuilt.source, TableSource)
    assert rebuilt.source.key == ("k",)
    assert (rebuilt.page_size, rebuilt.fanout, rebuilt.transactional, rebuilt.retries) == (
        70,
        5,
        True,
        2,
    )
    with pytest.raises(UntrustedPayload):
        MapSpec.loads(text, engine, Signer("another"))
    with pytest.raises(ConfigurationError, match="secret"):
        MapSpec.loads(text, engine, None)

    # A payload forged by someone who can write to the store is refused unopened.
    target = tmp_path / "target"
    data = json.loads(text)
    data["pickled"] = forge(data["pickled"], cloudpickle.dumps({"fn": CreatesFile(target)}))
    with pytest.raises(UntrustedPayload):
        MapSpec.loads(json.dumps(data), engine, signer)
    assert not target.exists()


def test_a_select_source_travels_signed(spec_engine: tuple[sa.Engine, sa.Table]) -> None:
    engine, table = spec_engine
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"k": i, "v": i} for i in range(10)])
    spec = spec_of(TableSource(sa.select(table).where(table.c.v >= 5), "k"), record_visit)

    text, missing = spec.dumps(None)
    assert missing == ["source"]
    signer = Signer("s")
    text, missing = spec.dumps(signer)
    assert missing == []
    rebuilt = MapSpec.loads(text, engine, signer)
    with engine.connect() as conn:
        rows = rebuilt.source.page(conn, KeyRange(), None, 100)
    assert [row.k for row in rows] == [5, 6, 7, 8, 9]


def test_an_importable_function_travels_by_reference(
    spec_engine: tuple[sa.Engine, sa.Table],
) -> None:
    engine, table = spec_engine
    spec = spec_of(TableSource(table, None), record_visit, record_completion)

    text, missing = spec.dumps(None)
    data = json.loads(text)

    assert reference(record_visit) == f"{__name__}:record_visit"
    assert data["fn"] == reference(record_visit)
    assert data["on_complete"] == f"{__name__}:record_completion"
    assert (missing, data["pickled"]) == ([], None)
    assert data["source"] == {"table": "accounts", "schema": None, "key": ["k"]}
    rebuilt = MapSpec.loads(text, engine, None)
    assert rebuilt.fn is record_visit
    assert rebuilt.on_complete is record_completion


def test_a_closure_job_runs_in_another_kit_only_with_the_secret(
    kit: shardkit.Kit, tables: Tables, store_url: str
) -> None:
    table, initial = key_table(tables, "sequential", 300)
    name, step = table.name, 7

    def bump(batch: Batch) -> None:
        if batch.rows:
            update = sa.text(f"UPDATE {name} SET v = v + :step WHERE k = :k")
            batch.conn.execute(update, [{"step": step, "k": row["k"]} for row in batch.rows])

    def open_kit(secret: str | None, executor: Any = None) -> shardkit.Kit:
        return shardkit.connect(
            store_url, "memory://", prefix=PREFIX, executor=executor, secret=secret
        )

    job_id = f"travel-{uuid4().hex[:8]}"
    root = KeyRange().id(job_id)
    held = HeldExecutor()
    with open_kit(None, held) as unsigned:
        with pytest.raises(ConfigurationError, match="secret"):
            unsigned.map(table, bump, transactional=True, page_size=50, job=job_id)
        assert held.submitted == []
    with pytest.raises(JobNotFound):
        kit.job(job_id)

    with open_kit("s3cret", held) as signed:
        signed.map(table, bump, transactional=True, page_size=50, job=job_id)
    assert held.submitted == [("map_range", {"job": job_id, "range": root})]

    with open_kit("wrong") as wrong:
        wrong.mapper.run_range(job_id, root)  # refused, logged: the range stays pending
        with pytest.raises(UntrustedPayload):
            wrong.job(job_id).resume()
    assert values(kit, table) == initial
    assert (kit.job(job_id).status().rows, kit.job(job_id).status().pending) == (0, 1)

    with open_kit("s3cret") as worker:
        worker.mapper.run_range(job_id, root)
        status = worker.job(job_id).wait(WAIT)
    assert values(kit, table) == plus(initial, step)
    assert (status.state, status.rows) == ("complete", 300)
