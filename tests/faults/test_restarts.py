"""Servers restarted under load: a throwaway PostgreSQL (the store) and a throwaway Redis
or memcached (the cache) are stopped at once and started again on the same port while
eight writers count, and a mapping job runs while its database restarts.

What each test proves:

* Every acknowledged write is stored exactly once; a call that raised is counted apart
  (with idempotency keys, retried until it answers, so the total is exact).
* Calls during an outage raise ``BackendUnavailable`` (the server could not be reached,
  or was lost mid-call), never a driver's own exception.
* The same kit writes again, without anything done by its user, once the server answers:
  of the calls each writer begins after the server's first answer, at most a few fail
  (those that drew a connection left idle from before the outage).
* A cache restart loses only what a buffered counter had pending, ids never repeat, and
  an outage is logged in a handful of lines that count the failures.

Writers pause 5 ms after a failed call (a client does not spin on a dead server; it
leaves the machine's two cores to the server starting up). Everything else waits by
polling with a deadline.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from redis import Redis

import shardkit
import shardkit.counters.ids
from backends import PREFIX, wait_for
from servers import (
    DEADLINE,
    WRITERS,
    MemcachedServer,
    PostgresServer,
    RedisServer,
    Server,
    Writers,
    running,
)
from shardkit.errors import BackendUnavailable

pytestmark = pytest.mark.slow

# Calls a writer may see fail after the server answers again: those that drew, from a
# pool, a connection made before the outage and idle through it. A client that backs
# off, or keeps dead connections, fails call after call instead (hundreds, at a writer's
# pace).
FAILED_AFTER_ANSWER = 5


def check_recovered(writers: Writers, answered_at: float) -> None:
    """Every writer wrote again once the server answered, after at most
    ``FAILED_AFTER_ANSWER`` failed calls begun since."""
    failed = writers.failed_after(answered_at)
    assert max(failed) <= FAILED_AFTER_ANSWER, f"calls failed after the answer: {failed}"


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[Server]:
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


# Each test gets the module's servers running, even if a failed test left one stopped.


@pytest.fixture
def postgres(postgres_server: Server) -> Server:
    return postgres_server.up()


@pytest.fixture
def cache(cache_server: Server) -> Server:
    return cache_server.up()


@pytest.fixture
def redis(redis_server: Server) -> Server:
    return redis_server.up()


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
    is exactly the number of keys, and the keys found applied are at most the calls that
    raised after connecting."""
    name = f"restart:{uuid.uuid4().hex}"
    kit = shardkit.connect(postgres.url, "memory://", prefix=PREFIX)
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
            postgres.stop()
            writers.wait_failed()
            answered_at = postgres.start()
            writers.wait_acked(20)
        writers.check_errors()
        check_recovered(writers, answered_at)

        stored = counter.value(fresh=True)
        acked = sum(writers.acked)
        unsent = [e for e in writers.raised() if "cannot reach" in str(e)]  # never connected
        maybe_applied = len(writers.raised()) - len(unsent)
        if keyed:
            assert stored == acked == sum(keys)
            assert sum(found_applied) <= maybe_applied
        else:
            assert acked <= stored <= acked + maybe_applied
    finally:
        kit.close()


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
def test_a_restart_while_idle_costs_at_most_one_failed_write(postgres: Server, keyed: bool) -> None:
    """PostgreSQL restarts while the kit is idle, every connection it holds or pools now
    dead: the first write finds one dead and fails (it cannot know whether its statement
    arrived), and so forgets all of them; every write after it succeeds."""
    name = f"restart:{uuid.uuid4().hex}"
    kit = shardkit.connect(postgres.url, "memory://", prefix=PREFIX)
    try:
        counter = kit.sharded(name, shards=WRITERS)
        calls = iter(range(1_000_000))

        def write(slot: int) -> None:
            counter.incr(key=f"{next(calls)}" if keyed else None)

        with Writers(write) as writers:  # every pooled and held connection in use
            writers.wait_acked(20)
        assert not writers.raised()
        postgres.restart()
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


def test_postgres_restart_under_load_loses_no_buffered_increment_and_repeats_no_id(
    postgres: Server, redis: Server
) -> None:
    """Four writers of a buffered counter (flushed every 0.2 s) and four of an id
    allocator (blocks of 50) while PostgreSQL dies and comes back. Buffered increments go
    to the cache and never fail; the flushes that fail leave their sums there for the
    next ones, so the stored value ends exact. Id writers fail while they need a new
    block, and write again once the server answers; no id repeats."""
    kit = shardkit.connect(postgres.url, redis.url, prefix=PREFIX)
    try:
        tag = uuid.uuid4().hex
        buffered = kit.buffered(f"restart:{tag}:b", interval=0.2)
        ids = kit.ids(f"restart:{tag}:i", block=50)
        handed: list[list[int]] = [[] for _ in range(WRITERS)]

        def write(slot: int) -> None:
            if slot < WRITERS // 2:
                buffered.incr()
            else:
                handed[slot].append(ids.next())

        with Writers(write) as writers:
            writers.wait_acked(20)
            wait_for(lambda: buffered.parts().stored > 0, "a flush", DEADLINE)
            postgres.stop()
            writers.wait_failed(range(WRITERS // 2, WRITERS))
            answered_at = postgres.start()
            writers.wait_acked(20)
        writers.check_errors()
        assert not any(writers.errors[: WRITERS // 2]), "a buffered increment failed"
        check_recovered(writers, answered_at)

        kit.flush_all()
        assert buffered.parts() == (sum(writers.acked[: WRITERS // 2]), 0)
        every = [i for ids_of in handed for i in ids_of]
        assert len(every) == len(set(every)) == sum(writers.acked[WRITERS // 2 :])
        assert all(ids_of == sorted(ids_of) for ids_of in handed)
    finally:
        kit.close()


def test_ids_need_no_wait_for_a_block_whose_reservation_failed(
    postgres: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the store down, the call that claimed the next block fails to reserve it; the
    next call must not wait for that claim (as it would for a live claimer: up to the
    claim wait, made an hour here), but try, and fail, at once. Else every writer waits
    out a claim after the store answers again."""
    monkeypatch.setattr(shardkit.counters.ids, "_CLAIM_WAIT", 3600.0)
    kit = shardkit.connect(postgres.url, "memory://", prefix=PREFIX)
    try:
        ids = kit.ids(f"restart:{uuid.uuid4().hex}", block=2)
        assert ids.take(2) == [1, 2]  # the block is used up: the next call reserves
        postgres.stop()
        with pytest.raises(BackendUnavailable):
            ids.next()
        second: dict[str, BaseException] = {}

        def take() -> None:
            try:
                ids.next()
            except BaseException as exc:
                second["raised"] = exc

        threading.Thread(target=take, daemon=True).start()
        wait_for(lambda: bool(second), "the next call to fail, not wait out the claim", DEADLINE)
        assert isinstance(second["raised"], BackendUnavailable)
        postgres.start()
        assert ids.next() == 3
    finally:
        kit.close()


# -- the mapper ------------------------------------------------------------------------------

ROWS = 20_000


def test_a_transactional_job_whose_database_restarts_adds_to_every_row_once(
    postgres: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A job adds 10 to every row of a table on the throwaway PostgreSQL. Once it is
    under way, every worker's page is held in fn while the server dies (immediate
    shutdown): their transactions roll back, and the store cannot even record the
    failures. The server comes back, and the job completes by itself, every row +10
    exactly once."""
    engine = sa.create_engine(postgres.url)
    table = sa.Table(
        f"{PREFIX}rows_{uuid.uuid4().hex[:8]}",
        sa.MetaData(),
        sa.Column("k", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("v", sa.Integer, nullable=False),
    )
    table.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"k": k, "v": 0} for k in range(ROWS)])
    engine.dispose()  # its connection would not outlive the restart
    add = table.update().where(table.c.k == sa.bindparam("key")).values(v=table.c.v + 10)
    pages = itertools.count()
    held: list[int] = []
    release = threading.Event()

    def fn(batch: shardkit.Batch) -> None:
        if batch.rows:
            batch.conn.execute(add, [{"key": row.k} for row in batch.rows])
        if next(pages) >= 20 and not release.is_set():
            held.append(1)
            release.wait(DEADLINE)

    kit = shardkit.connect(postgres.url, "memory://", prefix=PREFIX)
    try:
        job = kit.map(table, fn, transactional=True, page_size=100, fanout=4)
        workers = kit.executor.workers  # type: ignore[attr-defined]
        wait_for(lambda: len(held) == workers, "every worker to hold a page", DEADLINE)
        postgres.stop()
        release.set()
        wait_for(
            lambda: "recording that failed" in caplog.text,
            "a failure the store could not record",
            DEADLINE,
        )
        postgres.start()
        status = job.wait(timeout=DEADLINE)
        assert status.state == "complete"
        assert status.rows == ROWS
        with engine.connect() as conn:
            by_value = conn.execute(sa.select(table.c.v, sa.func.count()).group_by(table.c.v))
            assert dict(list(by_value)) == {10: ROWS}, "a row was visited twice, or missed"
    finally:
        release.set()
        kit.close()
        engine.dispose()


# -- the cache -------------------------------------------------------------------------------


class ByKind:
    """What each kind of counter did across a cache restart: each writer takes the three
    kinds in turn, one call each, recording when each call that returned started and
    ended."""

    KINDS = ("sharded", "buffered", "ids")

    def __init__(self, kit: shardkit.Kit) -> None:
        tag = uuid.uuid4().hex
        self.sharded = kit.sharded(f"restart:{tag}:s", shards=WRITERS)
        self.buffered = kit.buffered(f"restart:{tag}:b", interval=0.2)
        self.ids = kit.ids(f"restart:{tag}:i", block=100)
        self.turn = [0] * WRITERS
        self.acked: dict[str, list[tuple[float, float]]] = {kind: [] for kind in self.KINDS}
        self.raised: dict[str, list[BaseException]] = {kind: [] for kind in self.KINDS}
        self.handed: list[list[int]] = [[] for _ in range(WRITERS)]

    def write(self, slot: int) -> None:
        kind = self.KINDS[self.turn[slot] % 3]
        self.turn[slot] += 1
        started = time.monotonic()
        try:
            if kind == "sharded":
                self.sharded.incr()
            elif kind == "buffered":
                self.buffered.incr()
            else:
                self.handed[slot].append(self.ids.next())
        except Exception as exc:
            self.raised[kind].append(exc)
            raise
        self.acked[kind].append((started, time.monotonic()))


def test_a_cache_restart_under_load_loses_only_what_was_pending(
    postgres: Server, cache: Server
) -> None:
    """Redis (or memcached) dies (SIGKILL, no persistence: every key lost) and comes back
    under eight writers of a sharded counter, a buffered counter (flushed every 0.2 s)
    and an id allocator, all on one kit.

    * Sharded: the cache is only a read cache, so no write fails and the value is exact.
    * Buffered: what was pending in the cache when it died is lost, and only that; the
      loss is at most the pending part read just before the kill plus what was added
      after that read.
    * Ids: no id is handed out twice (a new block is reserved above every id handed out),
      and each writer's ids keep increasing.
    * The same kit writes every kind again once the cache answers.
    """
    kit = shardkit.connect(postgres.url, cache.url, prefix=PREFIX)
    try:
        counters = ByKind(kit)
        with Writers(counters.write) as writers:
            writers.wait_acked(60)
            flushed = lambda: counters.buffered.parts().stored > 0  # noqa: E731
            wait_for(flushed, "a flush of the buffered counter", DEADLINE)
            read_at = time.monotonic()
            before = counters.buffered.parts()
            cache.stop()
            writers.wait_failed()
            answered_at = cache.start()
            writers.wait_acked(60)
        writers.check_errors()
        check_recovered(writers, answered_at)

        assert not counters.raised["sharded"]
        assert counters.sharded.value(fresh=True) == len(counters.acked["sharded"])

        kit.flush_all()
        after = counters.buffered.parts()
        assert after.pending == 0
        acked = counters.acked["buffered"]
        lost = len(acked) - after.stored
        # Calls whose increment the read may have missed: those that ended after it
        # began, and started before the restarted cache answered (so could reach the old).
        missed = sum(1 for started, ended in acked if ended >= read_at and started < answered_at)
        assert 0 <= lost <= before.pending + missed
        assert after.stored >= before.stored, "a flushed increment was lost"

        handed = [i for ids in counters.handed for i in ids]
        assert len(handed) == len(set(handed)) == len(counters.acked["ids"])
        assert all(ids == sorted(ids) for ids in counters.handed)
        assert max(handed) <= counters.ids.reserved()
    finally:
        kit.close()


# -- logging during an outage ----------------------------------------------------------------

CALLS = 250  # calls each writer makes while the cache is down


def test_a_cache_outage_is_logged_in_a_few_lines_that_count_the_failures(
    postgres: Server, redis: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Eight writers of a sharded counter make 250 calls each while Redis is down: each
    call is stored, and the upkeep of the cached value, gathered and sent every
    ``adjust_delay``, fails while the outage lasts. The log shows the first failure,
    then, once Redis is back, one line saying it works again that counts them all (a
    line every 10 s in between, were the outage longer)."""
    kit = shardkit.connect(postgres.url, redis.url, prefix=PREFIX)
    phase = threading.Barrier(WRITERS + 1, timeout=DEADLINE)
    done = threading.Event()
    try:
        counter = kit.sharded(f"restart:{uuid.uuid4().hex}", shards=WRITERS)

        def write(slot: int) -> None:
            for _ in range(20):  # shard tickets taken, connections opened
                counter.incr()
            phase.wait()  # the cache stops
            phase.wait()
            for _ in range(CALLS):
                counter.incr()
            phase.wait()  # the cache starts
            phase.wait()
            while not done.is_set():
                counter.incr()

        threads = [threading.Thread(target=write, args=(slot,)) for slot in range(WRITERS)]
        for thread in threads:
            thread.start()
        phase.wait()
        counter.value()  # what the writers gathered so far is sent before the outage
        caplog.clear()
        redis.stop()
        phase.wait()
        phase.wait()
        # The writers may be done before the adjuster's first send (``adjust_delay``):
        # the cache stays down until that send has failed.
        wait_for(lambda: "failed while adjusting" in caplog.text, "the first failure", DEADLINE)
        redis.start()
        phase.wait()
        wait_for(lambda: "works again" in caplog.text, "the line saying it works again", DEADLINE)
        done.set()
        for thread in threads:
            thread.join(DEADLINE)

        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        adjusting = [line for line in lines if "adjusting cached values" in line]
        # A thread whose increments others always led takes its shard ticket when it
        # first leads a combined write, which may be during the outage: at most one line
        # says so (the others are held back), and it falls back to a random shard.
        tickets = [line for line in lines if "taking a shard ticket" in line]
        assert len(adjusting) + len(tickets) == len(lines), "\n".join(lines)
        assert len(tickets) <= 1, "\n".join(lines)
        assert len(adjusting) <= 3, "\n".join(lines)  # first, recovery, a 10 s line if slow
        assert "failed while adjusting cached values" in adjusting[0]
        again = re.fullmatch(
            r"adjusting cached values works again: (\d+) failures in [\d.]+ s "
            r"\((\d+) not logged until now\)",
            adjusting[-1],
        )
        assert again, adjusting[-1]
        held = [int(n) for n in re.findall(r"\(and (\d+) more not logged\)", "\n".join(adjusting))]
        # Each failure is a gathered batch of adjustments that the cache did not take
        # (a send every adjust_delay while writes come), and every one is accounted for.
        assert 1 <= int(again[1]) <= WRITERS * CALLS
        assert len(adjusting) - 1 + sum(held) + int(again[2]) == int(again[1])
    finally:
        done.set()
        kit.close()


def test_a_server_whose_free_port_another_took_starts_on_another(
    redis_server: Server,
) -> None:
    """A port found free is free only until someone binds it (another test worker may):
    a first start that finds its port taken by another server is made again on another
    port, and answers as itself, not as the server that took the port."""
    taken_by = redis_server.up()
    with contextlib.closing(RedisServer()) as server:
        server.port = taken_by.port  # as if another worker had bound it meanwhile
        server.start()
        assert server.port != taken_by.port
        assert server.process is not None
        client = Redis("127.0.0.1", server.port)
        try:
            assert int(client.info("server")["process_id"]) == server.process.pid
        finally:
            client.close()
