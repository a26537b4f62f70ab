"""A kit opened before ``os.fork()`` keeps working in the children (pre-fork servers):
each child opens its own connections, and never touches the parent's."""

from __future__ import annotations

import faulthandler
import functools
import gc
import json
import logging
import os
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import shardkit
import workers
from backends import CACHE_URLS, PREFIX, Target, require, store_url_for

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
    """What a forked child does with the inherited kit; returns "ok" and its server
    connection id."""
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
    return f"ok {child_id}"


def _fork(folder: Path, slot: int, work: Callable[[], str]) -> int:
    """Fork a child that runs ``work`` and exits: 0 with what it returned in
    ``folder/child-{slot}``, 1 with its traceback there. On SIGUSR1 the child dumps every
    thread's stack into ``folder/{pid}`` (``_wait_exit`` asks one that misses its
    deadline)."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        faulthandler.register(
            signal.SIGUSR1, (folder / str(os.getpid())).open("w"), all_threads=True
        )
        code, report = 1, ""
        try:
            report = work()
            code = 0
        except BaseException:
            report = traceback.format_exc()
        finally:
            (folder / f"child-{slot}").write_text(report)
            os._exit(code)
    return pid


def _wait_exit(pid: int, stacks: Path) -> int:
    """The exit status of child ``pid`` (forked by ``_fork``), polled with a deadline;
    past it, the child's stacks are shown and it is killed."""
    deadline = time.monotonic() + DEADLINE
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            dump = stacks / str(pid)
            os.kill(pid, signal.SIGUSR1)
            until = time.monotonic() + 5
            while time.monotonic() < until and not dump.read_text():
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(
                f"forked child {pid} did not finish within {DEADLINE:.0f} s; its threads:\n"
                f"{dump.read_text()}"
            )
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
            work = (kit, name, seeds[slot], count, parent_dbapi, parent_id)
            pids.append(_fork(tmp_path, slot, functools.partial(_child, *work)))

        try:
            for delta in workers.deltas(seeds[-1], count):  # the parent writes meanwhile
                assert counter.incr(delta) is True
        finally:
            codes = [_wait_exit(pid, tmp_path) for pid in pids]
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


def test_a_fork_waits_for_other_threads_to_leave_sqlite(
    sqlite_url: str, name: str, tmp_path: Path
) -> None:
    """Children forked while another thread of the parent writes to SQLite without pause
    each open the database and write: none hangs or finds it locked (SQLite's locks are
    process memory, inherited held by a child forked mid-write), and every write counts."""
    forks, writes = 30, 5
    with shardkit.connect(sqlite_url, "memory://", prefix=PREFIX) as kit:
        counter = kit.sharded(name, shards=4)
        written = 0
        stop = threading.Event()

        def write() -> None:
            nonlocal written
            while not stop.is_set():
                assert counter.incr() is True
                written += 1

        def count_and_close() -> str:
            for _ in range(writes):
                assert counter.incr() is True
            kit.close()
            return "ok"

        writer = threading.Thread(target=write)
        writer.start()
        try:
            codes = []
            for slot in range(forks):
                codes.append(_wait_exit(_fork(tmp_path, slot, count_and_close), tmp_path))
        finally:
            stop.set()
            writer.join()
        reports = [(tmp_path / f"child-{slot}").read_text() for slot in range(forks)]
        assert codes == [0] * forks, "\n".join(reports)
        assert counter.value(fresh=True) == written + forks * writes


def test_a_fork_waits_for_sqlite_at_most_fork_wait_and_never_for_its_own_thread(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The forking thread's own connection holds no fork back; another thread's, held
    past ``FORK_WAIT``, holds it that long, then the fork goes on with a warning."""
    from shardkit import _fork as hooks

    monkeypatch.setattr(hooks, "FORK_WAIT", 60.0)
    with shardkit.connect(sqlite_url, "memory://", prefix=PREFIX) as kit:
        engine: sa.Engine = kit.store.engine  # type: ignore[attr-defined]
        with engine.connect() as conn, caplog.at_level(logging.WARNING, "shardkit"):
            conn.exec_driver_sql("SELECT 1")
            assert _wait_exit(_fork(tmp_path, 0, lambda: "ok"), tmp_path) == 0
        assert not caplog.records  # within 60 s, and without a warning

        monkeypatch.setattr(hooks, "FORK_WAIT", 0.2)
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
                held.set()
                release.wait(60)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert held.wait(60)
            with caplog.at_level(logging.WARNING, "shardkit"):
                assert _wait_exit(_fork(tmp_path, 1, lambda: "ok"), tmp_path) == 0
        finally:
            release.set()
            holder.join()
        assert [r.getMessage() for r in caplog.records] == [
            f"forking while another thread uses the SQLite database "
            f"{engine.url.database!r}: the child may find it locked"
        ]


def _live(cache_kind: str) -> Any:
    """A live client of the test cache ``cache_kind``, as an application hands one in."""
    url = CACHE_URLS[cache_kind]
    if cache_kind == "redis":
        import redis

        return redis.Redis.from_url(url)
    from pymemcache.client.base import PooledClient

    return PooledClient(url.removeprefix("memcached://"), connect_timeout=10, timeout=10)


def _every_kind(kit: shardkit.Kit, name: str, count: int) -> dict[str, list[int]]:
    """``count`` writes to each kind of counter ``name:*``: the monotonic values and ids
    handed out."""
    sharded = kit.sharded(f"{name}:sharded")
    buffered = kit.buffered(f"{name}:buffered", interval=0.2)
    monotonic = kit.monotonic(f"{name}:monotonic", chance_to_write=0.5)
    ids = kit.ids(f"{name}:ids", block=16)
    handed: dict[str, list[int]] = {"monotonic": [], "ids": []}
    for _ in range(count):
        assert sharded.incr() is True
        buffered.incr()
        handed["monotonic"].append(monotonic.incr())
        handed["ids"].append(ids.next())
    return handed


@pytest.mark.slow
@pytest.mark.parametrize(
    ("store_kind", "cache_kind", "live"),
    [
        ("sqlite", "memory", False),
        ("postgres", "memory", True),
        ("postgres", "redis", False),
        ("postgres", "redis", True),
        ("mysql", "memcached", False),
        ("postgres", "memcached", True),
    ],
    ids=lambda kind: str(kind),
)
def test_every_kind_keeps_its_promise_across_fork(
    store_kind: str, cache_kind: str, live: bool, sqlite_url: str, name: str, tmp_path: Path
) -> None:
    """Children of a kit (URLs, or a live engine and client) count on every kind and close
    their kits while the parent counts on, before and after: nothing lost, nothing handed
    out twice."""
    store_url = store_url_for(store_kind, sqlite_url)
    cache_url = CACHE_URLS[cache_kind]
    if cache_url != "memory://":
        require(cache_url)
    store: Any = sa.create_engine(store_url) if live else store_url
    cache: Any = _live(cache_kind) if live and cache_kind != "memory" else cache_url
    count = 150
    with shardkit.connect(store, cache, prefix=PREFIX) as kit:
        handed = [_every_kind(kit, name, 10)]  # connections open and pooled before forking
        pids = []

        def count_and_close() -> str:
            report = json.dumps(_every_kind(kit, name, count))
            kit.close()
            return report

        for slot in range(CHILDREN):
            pids.append(_fork(tmp_path, slot, count_and_close))
        try:
            handed.append(_every_kind(kit, name, count))  # the parent counts meanwhile
        finally:
            codes = [_wait_exit(pid, tmp_path) for pid in pids]
        reports = [(tmp_path / f"child-{slot}").read_text() for slot in range(CHILDREN)]
        assert codes == [0] * CHILDREN, "\n".join(reports)
        handed += [json.loads(report) for report in reports]
        handed.append(_every_kind(kit, name, 10))  # after the children closed their kits
        kit.flush_all()

        total = 20 + (CHILDREN + 1) * count
        assert kit.sharded(f"{name}:sharded").value(fresh=True) == total
        assert kit.buffered(f"{name}:buffered").parts() == shardkit.Parts(total, 0)
        ids = [i for one in handed for i in one["ids"]]
        assert len(set(ids)) == len(ids) == total
        for one in handed:  # within a process, monotonic values grow
            assert one["monotonic"] == sorted(set(one["monotonic"]))
        if kit.cache.shared:  # and one cache hands each value out once
            values = [v for one in handed for v in one["monotonic"]]
            assert sorted(values) == list(range(1, total + 1))
    if live:
        store.dispose()
        if cache_kind != "memory":
            cache.close()


@pytest.mark.parametrize(
    ("store_kind", "cache_kind"), [("sqlite", "memory"), ("postgres", "redis")], ids=str
)
def test_a_forked_child_takes_ids_of_its_own_without_waiting_on_its_parents_guard(
    store_kind: str, cache_kind: str, sqlite_url: str, name: str, tmp_path: Path
) -> None:
    """A child forked while its parent holds the rest of a sub-block, and while the
    allocator's guard is held (as by another thread of the parent, mid-refill), hands
    out none of its parent's ids, and takes its own without waiting for a lock that no
    thread of it will release."""
    cache_url = CACHE_URLS[cache_kind]
    if cache_url != "memory://":
        require(cache_url)
    with Target(store_url_for(store_kind, sqlite_url), cache_url).connect() as kit:
        ids = kit.ids(name, block=100, sub_block=10)
        parent = [ids.next()]  # 2 … 10 are in hand
        guard = ids.roles.guard._lock
        assert guard.acquire(blocking=False)
        try:
            pid = _fork(
                tmp_path, 0, lambda: json.dumps(kit.ids(name, block=100, sub_block=10).take(15))
            )
        finally:
            guard.release()
        parent += ids.take(15)
        assert _wait_exit(pid, tmp_path) == 0, (tmp_path / "child-0").read_text()
    child = json.loads((tmp_path / "child-0").read_text())
    assert parent[:10] == list(range(1, 11))  # the parent hands out its sub-block
    assert len(child) == 15
    assert not set(parent) & set(child)


def test_kits_opened_and_closed_for_weeks_leave_no_fork_or_exit_hooks(sqlite_url: str) -> None:
    """One at-fork and one at-exit hook serve every live object, weakly held: a closed
    kit leaves nothing registered, and fork does not slow down as kits come and go."""
    from shardkit import _fork
    from shardkit.executor import local

    def registered() -> tuple[int, int]:
        gc.collect()
        return len(_fork._OWNERS), len(local._OPEN)

    before = registered()
    for _ in range(300):
        shardkit.connect(sqlite_url, "memory://", prefix=PREFIX).close()
    after = registered()
    assert after[0] <= before[0]
    assert after[1] <= before[1]
    with shardkit.connect(sqlite_url, "memory://", prefix=PREFIX) as kit:
        assert kit.store in _fork._OWNERS
        assert kit.cache in _fork._OWNERS
        assert kit.executor in _fork._OWNERS
        assert kit.executor in local._OPEN


class _Held:
    """An object registered for a reset in forked children (``reset_in_child``)."""

    reset = False


def test_a_reset_that_raises_in_a_forked_child_leaves_the_others_to_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A child runs every registered reset, though one before it raised (logged)."""
    from shardkit import _fork as hooks

    def fail(_: object) -> None:
        raise RuntimeError("this reset fails")

    def mark(owner: _Held) -> None:
        owner.reset = True

    failing, held = _Held(), _Held()
    hooks.reset_in_child(failing, fail)  # registered first: it runs first
    hooks.reset_in_child(held, mark)

    def work() -> str:
        logged = [r.getMessage() for r in caplog.records if r.name == "shardkit"]
        return json.dumps({"reset": held.reset, "logged": logged})

    with caplog.at_level(logging.ERROR, logger="shardkit"):
        pid = _fork(tmp_path, 0, work)
        assert _wait_exit(pid, tmp_path) == 0, (tmp_path / "child-0").read_text()
    report = json.loads((tmp_path / "child-0").read_text())
    assert report == {
        "reset": True,
        "logged": ["a forked child failed to reset its _Held"],
    }
    assert held.reset is False  # the parent's own object is left alone
