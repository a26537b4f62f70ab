"""Servers restarted under load: a throwaway PostgreSQL (the store) and a throwaway Redis
or memcached (the cache) are stopped at once and started again on the same port while
eight writers count, and a mapping job runs while its database restarts.

What each test proves:

* Every acknowledged write is stored exactly once; a call that raised is counted apart
  (with idempotency keys, retried until it answers, so the total is exact).
* Calls during an outage raise ``BackendError`` (``BackendUnavailable`` when the server
  cannot be reached), never a driver's own exception.
* The same kit writes again, without anything done by its user, within 5 s of the server
  answering (measured from the first answer to each writer's first success).
* A cache restart loses only what a buffered counter had pending, ids never repeat, and
  an outage is logged in a handful of lines that count the failures.

Writers pause 5 ms after a failed call (a client does not spin on a dead server; it
leaves the machine's two cores to the server starting up). Everything else waits by
polling with a deadline.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

import shardkit
from conftest import PREFIX, store_url_for, wait_for
from servers import MemcachedServer, PostgresServer, RedisServer, Server, running
from shardkit.errors import BackendError, BackendUnavailable

pytestmark = pytest.mark.slow

WRITERS = 8
RECOVERY = 5.0  # seconds from a server's first answer to each writer's first success
DEADLINE = 60.0  # seconds anything else awaited may take
PAUSE = 0.005  # seconds a writer waits after a failed call


@pytest.fixture(scope="module")
def postgres() -> Iterator[Server]:
    with running(PostgresServer) as server:
        yield server


@pytest.fixture(scope="module", params=["redis", "memcached"])
def cache_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    kind = {"redis": RedisServer, "memcached": MemcachedServer}[request.param]
    with running(kind) as server:
        yield server


@pytest.fixture(scope="module")
def redis_server() -> Iterator[Server]:
    with running(RedisServer) as server:
        yield server


def _up(server: Server) -> Server:
    """``server``, started again if a failed test left it stopped."""
    if server.process is None or server.process.poll() is not None:
        server.start()
    return server


class Writers:
    """``WRITERS`` threads, each calling ``write(slot)`` again and again until stopped,
    recording what every call did: returned (when), or raised (what)."""

    def __init__(self, write: Callable[[int], object], pause: float = PAUSE) -> None:
        self.write = write
        self.pause = pause
        self.done = threading.Event()
        self.acked = [0] * WRITERS
        self.ok_at: list[list[float]] = [[] for _ in range(WRITERS)]
        self.errors: list[list[BaseException]] = [[] for _ in range(WRITERS)]
        self.threads = [threading.Thread(target=self._run, args=(s,)) for s in range(WRITERS)]

    def _run(self, slot: int) -> None:
        while not self.done.is_set():
            try:
                self.write(slot)
            except Exception as exc:  # recorded: the test checks what was raised
                self.errors[slot].append(exc)
                time.sleep(self.pause)
            else:
                self.acked[slot] += 1
                self.ok_at[slot].append(time.monotonic())

    def __enter__(self) -> Writers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(DEADLINE)
        assert not any(thread.is_alive() for thread in self.threads), "a writer hangs"

    def status(self) -> str:
        return f"(acked {self.acked}, errors {[len(e) for e in self.errors]})"

    def wait_acked(self, more: int) -> None:
        """Wait until every writer has had ``more`` more calls return."""
        wanted = [n + more for n in self.acked]
        wait_for(
            lambda: all(n >= w for n, w in zip(self.acked, wanted, strict=True)),
            f"{more} more writes of every writer",
            DEADLINE,
            self.status,
        )

    def wait_failed(self) -> None:
        """Wait until every writer has had a call raise since now."""
        seen = [len(e) for e in self.errors]
        wait_for(
            lambda: all(len(e) > n for e, n in zip(self.errors, seen, strict=True)),
            "a failed call of every writer",
            DEADLINE,
            self.status,
        )

    def raised(self) -> list[BaseException]:
        return [exc for errors in self.errors for exc in errors]

    def check_errors(self) -> None:
        """Every call that raised, raised a ``BackendError``, some ``BackendUnavailable``."""
        raised = self.raised()
        assert raised, "no call failed: the outage was not seen"
        wrong = [exc for exc in raised if not isinstance(exc, BackendError)]
        assert not wrong, f"{len(wrong)} calls raised something else, e.g. {wrong[0]!r}"
        assert any(isinstance(exc, BackendUnavailable) for exc in raised)

    def recovery(self, answered_at: float) -> list[float]:
        """Seconds from ``answered_at`` to each writer's first success after it."""
        return [next(t for t in times if t >= answered_at) - answered_at for times in self.ok_at]


# -- PostgreSQL ------------------------------------------------------------------------------


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
def test_postgres_restart_under_load_keeps_every_acknowledged_increment(
    postgres: Server, keyed: bool
) -> None:
    """Eight writers on one sharded counter while PostgreSQL dies (immediate shutdown)
    and comes back. Without keys, a call that raised after its statement may have reached
    the server is applied or not (a commit can land just before the server dies, the
    answer never sent): so ``acked <= stored <= acked + raised-after-connecting``; a call
    that could not connect sent nothing. With keys, each writer retries a key until a
    call answers (True, or False when an earlier raised attempt had applied it): the total
    is exactly the number of keys."""
    server = _up(postgres)
    name = f"restart:{uuid.uuid4().hex}"
    kit = shardkit.connect(server.url, "memory://", prefix=PREFIX)
    try:
        counter = kit.sharded(name, shards=WRITERS)
        keys = [0] * WRITERS
        found_applied = [0] * WRITERS

        def write(slot: int) -> None:
            if not keyed:
                counter.incr()
                return
            key = f"{slot}:{keys[slot]}"
            if not counter.incr(key=key):
                found_applied[slot] += 1  # an earlier attempt that raised had applied it
            keys[slot] += 1

        with Writers(write) as writers:
            writers.wait_acked(20)
            server.stop()
            writers.wait_failed()
            answered_at = server.start()
            writers.wait_acked(20)
        writers.check_errors()
        recovery = writers.recovery(answered_at)
        assert max(recovery) < RECOVERY, f"writers wrote again after {recovery} s"

        stored = counter.value(fresh=True)
        acked = sum(writers.acked)
        if keyed:
            assert stored == acked == sum(keys)
        else:
            unsent = [e for e in writers.raised() if "cannot reach" in str(e)]
            maybe_applied = len(writers.raised()) - len(unsent)
            assert acked <= stored <= acked + maybe_applied
    finally:
        kit.close()


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
def test_a_restart_while_idle_costs_at_most_one_failed_write(postgres: Server, keyed: bool) -> None:
    """PostgreSQL restarts while the kit is idle, every connection it holds or pools now
    dead: the first write finds one dead and fails (it cannot know whether its statement
    arrived), and so forgets all of them; every write after it succeeds."""
    server = _up(postgres)
    name = f"restart:{uuid.uuid4().hex}"
    kit = shardkit.connect(server.url, "memory://", prefix=PREFIX)
    try:
        counter = kit.sharded(name, shards=WRITERS)
        calls = iter(range(1_000_000))

        def write(slot: int) -> None:
            counter.incr(key=f"{next(calls)}" if keyed else None)

        with Writers(write) as writers:  # every pooled and held connection in use
            writers.wait_acked(20)
        server.restart()
        failed = 0
        for call in range(20):
            try:
                counter.incr(key=f"after:{call}" if keyed else None)
            except BackendUnavailable:
                failed += 1
        assert failed <= 1, f"{failed} writes failed after the server answered"
        assert counter.value(fresh=True) == sum(writers.acked) + 20 - failed
    finally:
        kit.close()
