"""Through PgBouncer in transaction pooling mode, as most PostgreSQL sites run it.

Each transaction may run on another server session there, so a statement prepared in
one is missing (or there already) in the next: shardkit must not rely on named prepared
statements behind a pooler, and must keep them on a direct connection. PgBouncer (from
Debian's package) is started by the tests on a free port, in front of the test server.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import shardkit
import shardkit.aio
from backends import CACHE_URLS, PREFIX, ROOT, STORE_URLS, require, run_together
from servers import PgBouncerServer, running
from shardkit.cli import main
from shardkit.mapper import Batch
from shardkit.store.sql import SqlStore
from shardkit.store.sql.engines import _POOLED

WRITERS = 8
WAIT = 60.0  # seconds: a deadline, never a pause


@pytest.fixture(scope="module")
def bouncer() -> Iterator[str]:
    """The test server's URL through a PgBouncer in transaction pooling mode."""
    direct = STORE_URLS["postgres"]
    assert direct is not None
    require(direct)
    with running(PgBouncerServer, direct) as server:
        yield server.url


@pytest.fixture(params=["memory", "redis"])
def kit(request: pytest.FixtureRequest, bouncer: str) -> Iterator[shardkit.Kit]:
    cache = CACHE_URLS[request.param]
    if cache != "memory://":
        require(cache)
    with shardkit.connect(bouncer, cache, prefix=PREFIX) as the_kit:
        yield the_kit


def pooled(kit: shardkit.Kit) -> set[bool]:
    """What the store found out about each connection its pool checked out."""
    store = kit.store
    assert isinstance(store, SqlStore)
    with store.engine.connect() as conn:
        return {conn.info[_POOLED]}


def test_a_pooled_connection_is_told_from_a_direct_one(kit: shardkit.Kit) -> None:
    direct = STORE_URLS["postgres"]
    with shardkit.connect(direct, "memory://", prefix=PREFIX) as direct_kit:
        assert pooled(direct_kit) == {False}
    assert pooled(kit) == {True}


def test_a_statement_deallocated_under_the_hot_path_is_prepared_again(name: str) -> None:
    """psycopg runs DEALLOCATE ALL when it rolls back a transaction after preparing
    statements of its own; the hot path's prepared upsert is then prepared again."""
    direct = STORE_URLS["postgres"]
    assert direct is not None
    require(direct)
    with shardkit.connect(direct, "memory://", prefix=PREFIX) as kit:
        counter = kit.sharded(name, shards=2)
        assert counter.incr() is True  # prepared on the connection the store holds
        store = kit.store
        assert isinstance(store, SqlStore)
        held = []
        while not store._held.empty():
            held.append(store._held.get_nowait())
        assert held
        for conn, run in held:
            conn.exec_driver_sql("DEALLOCATE ALL")
            store._held.put((conn, run))
        assert counter.incr() is True
        assert counter.value(fresh=True) == 2


def test_every_counter_kind_counts_exactly_through_pgbouncer(kit: shardkit.Kit) -> None:
    tag = uuid.uuid4().hex
    sharded = kit.sharded(f"test:pgb:sharded:{tag}", shards=4)
    keyed = kit.sharded(f"test:pgb:keyed:{tag}", shards=4)
    buffered = kit.buffered(f"test:pgb:buffered:{tag}", interval=0.2)
    monotonic = kit.monotonic(f"test:pgb:monotonic:{tag}", shards=4, chance_to_write=0.5)
    ids = kit.ids(f"test:pgb:ids:{tag}", block=25)
    handed: list[list[int]] = [[] for _ in range(WRITERS)]
    repeats: list[bool] = []

    def write(index: int) -> None:
        for i in range(300):
            sharded.incr()
            buffered.incr(2)
            monotonic.incr()
            handed[index].append(ids.next())
            if i % 10 == 0:
                keyed.incr(3, key=f"{index}:{i}")
        handed[index].extend(ids.take(40))
        repeats.append(keyed.incr(3, key=f"{index}:0"))  # applied already

    run_together(WRITERS, write)
    kit.flush_all()

    every = [i for ids_of_one in handed for i in ids_of_one]
    assert sharded.value(fresh=True) == WRITERS * 300
    assert keyed.value(fresh=True) == WRITERS * 30 * 3
    assert repeats == [False] * WRITERS
    assert buffered.parts() == shardkit.Parts(stored=WRITERS * 600, pending=0)
    assert monotonic.value() == WRITERS * 300
    assert len(set(every)) == len(every) == WRITERS * 340
    assert sharded.grow(12) == 12
    assert sharded.value(fresh=True) == WRITERS * 300


def _accounts(engine: sa.Engine, rows: int) -> sa.Table:
    table = sa.Table(
        f"{PREFIX}pgb_{uuid.uuid4().hex[:8]}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("v", sa.Integer, nullable=False),
    )
    table.create(engine)
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "v": 0} for i in range(1, rows + 1)])
    return table


@pytest.mark.parametrize("transactional", [True, False], ids=["transactional", "at-least-once"])
def test_a_map_through_pgbouncer_visits_every_row(kit: shardkit.Kit, transactional: bool) -> None:
    store = kit.store
    assert isinstance(store, SqlStore)
    table = _accounts(store.engine, 3000)
    seen: list[int] = []
    lock = threading.Lock()

    def add_ten(batch: Batch) -> None:
        keys = [row.id for row in batch.rows]
        with lock:
            seen.extend(keys)
        if transactional:
            batch.conn.execute(
                sa.update(table).where(table.c.id.in_(keys)).values(v=table.c.v + 10)
            )

    try:
        status = kit.map(table, add_ten, transactional=transactional, page_size=100).wait(WAIT)
        assert (status.state, status.rows, status.error) == ("complete", 3000, None)
        assert set(seen) == set(range(1, 3001))
        if transactional:
            with store.engine.connect() as conn:
                values = conn.execute(sa.select(table.c.v).distinct()).scalars().all()
            assert values == [10]
    finally:
        kit.executor.close()
        table.drop(store.engine)


def test_the_command_line_through_pgbouncer(bouncer: str) -> None:
    name = f"pgb:{uuid.uuid4().hex[:8]}"  # short: the list is a table, 80 columns wide
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(
            main, ["--store", bouncer, "--prefix", PREFIX, *args], catch_exceptions=False
        )
        assert (result.exit_code, result.stderr) == (0, "")
        return result.stdout

    for _ in range(10):  # past psycopg's default threshold for preparing a statement
        run("incr", name, "--by", "2", "--shards", "4")
    run("incr", name, "--by", "5", "--key", "k1")
    assert "applied already" in run("incr", name, "--by", "5", "--key", "k1")
    assert run("get", name, "--fresh") == "25\n"
    assert name in run("list")
    # The demo's naive writer runs its UPDATE through SQLAlchemy on an engine of its own.
    demo = run("demo", "--writers", "2", "--seconds", "0.3")
    assert "every row exactly" in demo
    assert "✗" not in demo


def test_the_django_app_through_pgbouncer(bouncer: str, tmp_path: Path) -> None:
    """The example site's PostgreSQL tests, with Django's connections (and so shardkit's
    store) going through PgBouncer."""
    test_run = uuid.uuid4().hex[:8]
    env = {
        **os.environ,
        "SHARDKIT_TEST_POSTGRES": bouncer,
        "SHARDKIT_DJANGO_TEST_RUN": test_run,
    }
    # Kept at the end (--reuse-db): PgBouncer holds server connections to the test
    # database, so Django could not drop it; it is dropped below, directly.
    command: list[Any] = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "0",  # in this worker: the run is one of the suite's tests
        "--reuse-db",
        "-k",
        "postgres",
        "tests/contrib/django/test_django_counts.py",
        "tests/contrib/django/test_django_mapping.py",
    ]
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        assert " passed" in done.stdout
        assert "skipped" not in done.stdout
    finally:
        direct = STORE_URLS["postgres"]
        assert direct is not None
        engine = sa.create_engine(direct, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.exec_driver_sql(
                f'DROP DATABASE IF EXISTS "test_shardkit_django_{test_run}" WITH (FORCE)'
            )
        engine.dispose()
        Path(tempfile.gettempdir(), f"shardkit-django-{test_run}.sqlite3").unlink(missing_ok=True)


def test_the_async_kit_counts_exactly_through_pgbouncer(bouncer: str) -> None:
    """The async kit (psycopg's async connection) through the pooler, eight coroutines
    writing and reading at once on connections of their own, each statement run far past
    psycopg's threshold for preparing it: exact (a statement prepared in one server
    session would be missing in the next transaction's)."""
    tag = uuid.uuid4().hex

    async def main() -> tuple[list[int], int, shardkit.Parts, list[int]]:
        async with shardkit.aio.connect(bouncer, CACHE_URLS["memory"], prefix=PREFIX) as kit:
            keyed = await kit.sharded(f"test:pgb:aio:keyed:{tag}", shards=4)
            buffered = await kit.buffered(f"test:pgb:aio:buffered:{tag}", interval=0.2)
            ids = await kit.ids(f"test:pgb:aio:ids:{tag}", block=5)
            handed: list[int] = []

            async def writer(index: int) -> int:
                own = await kit.sharded(f"test:pgb:aio:sharded:{tag}:{index}", shards=4)
                for i in range(40):
                    await own.incr()
                    await keyed.incr(3, key=f"{index}:{i}")
                    await buffered.incr(2)
                    handed.extend(await ids.take(2))
                    await own.value(fresh=True)
                return await own.value(fresh=True)

            values = await asyncio.gather(*(writer(index) for index in range(WRITERS)))
            await kit.flush_all()
            async with kit.store.engine.connect() as conn:  # told from a direct connection
                assert conn.sync_connection is not None
                assert conn.sync_connection.info[_POOLED] is True
            return values, await keyed.value(fresh=True), await buffered.parts(), handed

    values, keyed, parts, handed = asyncio.run(main())
    assert values == [40] * WRITERS
    assert keyed == WRITERS * 40 * 3
    assert parts == shardkit.Parts(WRITERS * 80, 0)
    assert len(set(handed)) == len(handed) == WRITERS * 80
