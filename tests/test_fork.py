"""A kit opened before ``os.fork()`` keeps working in the children (pre-fork servers):
each child opens its own connections, and never touches the parent's."""

from __future__ import annotations

import os
import random
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import shardkit
import workers
from conftest import CACHE_URLS, Target, require, store_url_for

CHILDREN = 4
WRITES = {"sqlite": 100, "postgres": 300, "mysql": 300}  # per process
DEADLINE = 60.0


def _server_id(conn: sa.Connection) -> int | None:
    """The server's id for this connection (None on SQLite, which has no server)."""
    sql = {"postgresql": "SELECT pg_backend_pid()", "mysql": "SELECT CONNECTION_ID()"}
    query = sql.get(conn.dialect.name, sql["mysql"] if conn.dialect.name == "mariadb" else None)
    return None if query is None else int(conn.exec_driver_sql(query).scalar_one())


def _child(
    kit: shardkit.Kit, name: str, seed: int, count: int, parent_dbapi: Any, parent_id: Any
) -> str:
    """What a forked child does with the inherited kit; returns its server connection id."""
    engine: sa.Engine = kit.store.engine  # type: ignore[attr-defined]
    with engine.connect() as conn:
        assert conn.connection.dbapi_connection is not parent_dbapi, "reused the parent's"
        child_id = _server_id(conn)
    assert child_id is None or child_id != parent_id, "shares the parent's server session"
    counter = kit.get(name)
    assert counter.value(fresh=True) is not None  # a store read
    # A cache read: what the parent wrote, unless the cache is the process's own memory,
    # which a child starts empty.
    inherited = None if kit.cache.url == "memory://" else 1
    assert kit.cache.get(f"fork-test:{name}") == inherited
    for delta in workers.deltas(seed, count):
        assert counter.incr(delta) is True
    counter.value()  # a cached read, which may fill the cache
    kit.close()  # closes the child's connections only
    return str(child_id)


def _wait_exit(pid: int) -> int:
    """The exit status of child ``pid``, polled with a deadline (then killed)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"forked child {pid} did not finish within {DEADLINE:.0f} s")
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("store_kind", "cache_kind"),
    [("postgres", "redis"), ("mysql", "memcached"), ("sqlite", "memory"), ("postgres", "memory")],
    ids=lambda kind: str(kind),
)
def test_kit_opened_before_fork_keeps_working_in_children(
    store_kind: str, cache_kind: str, sqlite_url: str, name: str, tmp_path: Path
) -> None:
    cache_url = CACHE_URLS[cache_kind]
    if cache_url != "memory://":
        require(cache_url)
    target = Target(store_url_for(store_kind, sqlite_url), cache_url)
    count = WRITES[store_kind]
    seeds = [random.randrange(1 << 32) for _ in range(CHILDREN + 1)]
    with target.connect() as kit:
        # Use both backends before forking, so connections are open and pooled.
        counter = kit.sharded(name, shards=8)
        assert counter.value() == 0  # store read, then the cache filled
        assert counter.incr(7) is True  # store write, and the cached value adjusted
        assert counter.value() == 7  # served by the cache
        assert counter.value(fresh=True) == 7
        assert kit.cache.add(f"fork-test:{name}", 1, 60) is True
        assert kit.cache.get(f"fork-test:{name}") == 1
        engine: sa.Engine = kit.store.engine  # type: ignore[attr-defined]
        with engine.connect() as conn:
            parent_dbapi = conn.connection.dbapi_connection
            parent_id = _server_id(conn)

        pids = []
        for slot in range(CHILDREN):
            pid = os.fork()
            if pid == 0:  # the child: never return into pytest
                code = 1
                try:
                    report = _child(kit, name, seeds[slot], count, parent_dbapi, parent_id)
                    (tmp_path / f"child-{slot}").write_text(f"ok {report}")
                    code = 0
                except BaseException:
                    (tmp_path / f"child-{slot}").write_text(traceback.format_exc())
                finally:
                    os._exit(code)
            pids.append(pid)

        try:
            for delta in workers.deltas(seeds[-1], count):  # the parent writes meanwhile
                assert counter.incr(delta) is True
        finally:
            codes = [_wait_exit(pid) for pid in pids]
        reports = [(tmp_path / f"child-{slot}").read_text() for slot in range(CHILDREN)]
        assert codes == [0] * CHILDREN, "\n".join(reports)
        assert all(report.startswith("ok ") for report in reports)
        child_ids = {report.split()[1] for report in reports}
        if parent_id is not None:
            assert str(parent_id) not in child_ids
            assert len(child_ids) == CHILDREN  # each child its own session

        # The parent's connections survived the children (who closed their kits).
        with engine.connect() as conn:
            assert conn.connection.dbapi_connection is parent_dbapi
            assert _server_id(conn) == parent_id
        assert counter.incr(-7) is True
        assert kit.cache.get(f"fork-test:{name}") == 1

        expected = sum(sum(workers.deltas(seed, count)) for seed in seeds)
        assert counter.value(fresh=True) == expected

    with target.connect() as kit:
        assert kit.get(name).value(fresh=True) == expected
