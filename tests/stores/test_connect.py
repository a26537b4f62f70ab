"""connect(): URLs, live objects and the environment."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

import shardkit
from backends import CACHE_URLS, PREFIX, STORE_URLS, free_port, require, run_together
from shardkit.aio.store import async_engine_from_url
from shardkit.errors import BackendUnavailable
from shardkit.executor import LocalExecutor
from shardkit.store.sql import SqlStore
from shardkit.store.sql.engines import engine_from_url


def test_live_engine_and_redis_client_are_used_and_left_open(name: str) -> None:
    redis = pytest.importorskip("redis")
    require(STORE_URLS["postgres"] or "")
    require(CACHE_URLS["redis"])
    engine = sa.create_engine(STORE_URLS["postgres"] or "")
    client = redis.Redis.from_url(CACHE_URLS["redis"])
    with shardkit.connect(engine, client, prefix=PREFIX) as kit:
        votes = kit.sharded(name)
        votes.incr(4)
        assert votes.value() == 4
        assert kit.store.url == engine.url.render_as_string(hide_password=True)
    with engine.connect() as conn:  # the kit closed neither
        assert conn.execute(sa.text("select 1")).scalar() == 1
    assert client.ping()
    client.close()
    engine.dispose()


def test_live_pymemcache_client(sqlite_url: str, name: str) -> None:
    base = pytest.importorskip("pymemcache.client.base")
    require(CACHE_URLS["memcached"])
    host, port = CACHE_URLS["memcached"].removeprefix("memcached://").split(":")
    client = base.PooledClient((host, int(port)))
    with shardkit.connect(sqlite_url, client, prefix=PREFIX) as kit:
        votes = kit.sharded(name)
        votes.decr(3)
        assert votes.value() == -3
        assert votes.value() == -3  # now from memcached, negative included
    client.close()


def test_defaults_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, sqlite_url: str, name: str
) -> None:
    monkeypatch.setenv("SHARDKIT_STORE", sqlite_url)
    monkeypatch.setenv("SHARDKIT_CACHE", "memory://")
    with shardkit.connect(prefix=PREFIX) as kit:
        kit.sharded(name).incr(2)
        assert kit.store.url == sqlite_url
    with shardkit.connect(sqlite_url, prefix=PREFIX) as kit:
        assert kit.get(name).value(fresh=True) == 2


def test_the_prefix_comes_from_the_environment_unless_given(
    monkeypatch: pytest.MonkeyPatch, sqlite_url: str, name: str
) -> None:
    monkeypatch.setenv("SHARDKIT_PREFIX", f"{PREFIX}env_")
    with shardkit.connect(sqlite_url) as kit:
        kit.sharded(name).incr(3)
    with shardkit.connect(sqlite_url, prefix=f"{PREFIX}env_") as kit:
        assert kit.get(name).value(fresh=True) == 3
    with shardkit.connect(sqlite_url, prefix=PREFIX) as kit:  # given: the variable is not read
        assert kit.values([name]) == {name: 0}
    monkeypatch.setenv("SHARDKIT_PREFIX", "no spaces")
    with pytest.raises(shardkit.ConfigurationError):
        shardkit.connect(sqlite_url)


def test_the_embedded_default_is_a_sqlite_file_and_the_memory_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.delenv("SHARDKIT_STORE", raising=False)
    monkeypatch.delenv("SHARDKIT_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)  # type: ignore[arg-type]
    with shardkit.connect(prefix=PREFIX) as kit:
        assert kit.store.url == "sqlite:///shardkit.db"
        assert kit.cache.url == "memory://"
        kit.sharded("hello").incr()
    assert (tmp_path / "shardkit.db").exists()  # type: ignore[operator]


def test_a_url_store_keeps_a_connection_open_for_each_local_worker(sqlite_url: str) -> None:
    workers = 12
    kit = shardkit.connect(sqlite_url, prefix=PREFIX, executor=LocalExecutor(workers=workers))
    with kit:
        store = kit.store
        assert isinstance(store, SqlStore)
        together = threading.Barrier(workers + 1)

        def hold() -> None:  # what a range task does: one connection per worker, at once
            with store.engine.connect() as conn:
                conn.execute(sa.select(sa.literal(1)))
                together.wait(timeout=30)

        run_together(workers + 1, lambda _: hold())
        # Past SQLAlchemy's default pool of 5, returned connections would be closed.
        assert store.engine.pool.checkedin() == workers + 1


def test_a_handed_in_engine_smaller_than_the_local_workers_is_warned_of(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    for pool_size, warned in ((5, True), (9, False)):
        engine = sa.create_engine(sqlite_url, pool_size=pool_size)
        caplog.clear()
        with shardkit.connect(engine, prefix=PREFIX, executor=LocalExecutor(workers=8)):
            pass
        engine.dispose()
        said = [r.getMessage() for r in caplog.records if r.name == "shardkit"]
        assert any("pool_size=9" in message for message in said) is warned, said


def test_kits_opened_and_closed_leave_nothing_behind(store_url: str) -> None:
    """A kit opened and closed, its schema checked, a counter written and a job mapped,
    leaves no object behind: no engine's dialect is kept (SQLAlchemy's PostgreSQL
    dialect keeps the queries of its ``has_table`` and ``get_columns`` per dialect, in
    caches of 128, which shardkit does not call: a kit kept that way holds about 830
    objects), and the objects the collector tracks do not grow with the kits opened."""
    engine = sa.create_engine(store_url)
    table = sa.Table(
        f"{PREFIX}leftover_{uuid.uuid4().hex[:8]}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
    )
    table.create(engine)
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i} for i in range(1, 21)])

    def kit_round() -> None:
        with shardkit.connect(store_url, "memory://", prefix=PREFIX) as kit:
            kit.sharded("leftover").incr()
            assert kit.map(table, lambda batch: None, page_size=10, fanout=1).wait(60).rows == 20

    def dialects() -> int:
        # type(), not isinstance(): isinstance reads a lazy object's __class__, which
        # evaluates it (Django's, left by the Django tests, then fail on their settings).
        return sum(issubclass(type(o), sa.engine.Dialect) for o in gc.get_objects())

    try:
        for _ in range(2):  # what the first kits make once per process
            kit_round()
        gc.collect()
        kept, tracked = dialects(), len(gc.get_objects())
        for _ in range(6):
            kit_round()
        gc.collect()
        grown = len(gc.get_objects()) - tracked
        assert (dialects(), grown < 1000) == (kept, True), grown  # 6 kits kept: about 5,000
    finally:
        table.drop(engine)
        engine.dispose()


def test_a_store_opened_to_read_creates_nothing(store_url: str, name: str) -> None:
    """``create=False`` on a prefix without tables raises ``StoreNotFound`` naming the
    URL and the prefix, and leaves the database without a table of that prefix; on a
    store that exists it reads what is there."""
    prefix = f"{PREFIX}ro{uuid.uuid4().hex[:6]}_"
    engine = sa.create_engine(store_url)
    try:
        with pytest.raises(shardkit.StoreNotFound, match=f"prefix {prefix!r} in "):
            shardkit.connect(store_url, prefix=prefix, create=False)
        assert not [t for t in sa.inspect(engine).get_table_names() if t.startswith(prefix)]
    finally:
        engine.dispose()
    with shardkit.connect(store_url, prefix=PREFIX) as kit:
        kit.sharded(name).incr(3)
    with shardkit.connect(store_url, prefix=PREFIX, create=False) as kit:
        assert kit.get(name).value(fresh=True) == 3


def test_postgres_connections_send_keepalives_unless_the_url_says_otherwise() -> None:
    """The libpq settings of the sync and the async kit's connections: keepalives and
    a user timeout by default, each replaced by the URL's own."""
    url = STORE_URLS["postgres"] or ""
    require(url)
    given = url + ("&" if "?" in url else "?") + "keepalives_idle=20"

    def dsn(info: Any) -> dict[str, str]:
        return dict(part.split("=", 1) for part in info.dsn.split())

    async def async_dsn(store: str) -> dict[str, str]:
        engine = async_engine_from_url(store)
        async with engine.connect() as conn:
            raw = await conn.get_raw_connection()
            found = dsn(raw.driver_connection.info)
        await engine.dispose()
        return found

    for store, idle in ((url, "10"), (given, "20")):
        engine = engine_from_url(store)
        with engine.connect() as conn:
            sync = dsn(conn.connection.dbapi_connection.info)  # type: ignore[union-attr]
        engine.dispose()
        for found in (sync, asyncio.run(async_dsn(store))):
            assert found["keepalives"] == "1"
            assert found["keepalives_idle"] == idle
            assert (found["keepalives_interval"], found["keepalives_count"]) == ("5", "3")
            assert found["tcp_user_timeout"] == "30000"


def test_pymysql_connections_send_keepalives() -> None:
    """The options of a PyMySQL connection's socket, read from the live connection:
    keepalive probes after 10 s of silence, 3 more 5 s apart, and a request
    unacknowledged for 30 s given up (PyMySQL's own leave the kernel's 2 hours). A server
    that cannot be reached is still one error naming the URL without its password."""
    url = STORE_URLS["mysql"] or ""
    require(url)
    engine = engine_from_url(url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
            sock = conn.connection.dbapi_connection._sock  # type: ignore[union-attr]
            tcp = [socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT]
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert [sock.getsockopt(socket.IPPROTO_TCP, option) for option in tcp] == [10, 5, 3]
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 30_000
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        engine.dispose()
    port = free_port()  # where nothing listens
    with pytest.raises(BackendUnavailable, match=rf"reach .*app:\*\*\*@127.0.0.1:{port}") as raised:
        shardkit.connect(f"mysql://app:s3cret@127.0.0.1:{port}/db", prefix=PREFIX)
    assert "s3cret" not in str(raised.value)
