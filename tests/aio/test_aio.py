"""The async kit (shardkit.aio): the sync kit's counters, awaited, on the same rows and
keys, with concurrent coroutines' writes combined and cancellation never half-applied."""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing
import random
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa

import shardkit
import shardkit.aio
import workers
from backends import CACHE_URLS, CLUSTER, NEVER, PREFIX, STORE_URLS, Target, cache_url_of, require
from received import increments_received, row_writes
from shardkit.counters.generations import scheduled_flush
from shardkit.errors import (
    BackendError,
    ConfigurationError,
    CounterNotFound,
    CounterOverflow,
    InvalidDelta,
    ValidationError,
)
from shardkit.store import open_store
from shardkit.store.sql import SqlStore
from shardkit.store.sql.engines import _POOLED
from shardkit.validation import INT64_MAX

T = TypeVar("T")
SPAWN = multiprocessing.get_context("spawn")  # a process of its own, not a copy of this one


@pytest.fixture(params=["memory", "redis", "memcached", CLUSTER])
def aio_cache_url(request: pytest.FixtureRequest) -> str:
    """The caches an async kit runs on (memcached's calls offloaded to threads)."""
    return cache_url_of(request, request.param)


def with_kit(
    store_url: str,
    cache_url: str,
    work: Callable[[shardkit.aio.AsyncKit], Awaitable[T]],
    prefix: str = PREFIX,
) -> T:
    """``work(kit)`` on an async kit on the tests' tables, in an event loop of its own."""

    async def main() -> T:
        async with shardkit.aio.connect(store_url, cache_url, prefix=prefix) as kit:
            return await work(kit)

    return asyncio.run(main())


def sync_process(target: Target, name: str, kind: str, rounds: int) -> Any:
    """A process of its own (spawned) counting into ``name`` with a sync kit."""
    where = (target.store_url, target.cache_url, target.prefix)
    process = SPAWN.Process(target=workers.sync_counter, args=(where, name, kind, rounds))
    process.start()
    return process


async def joined(process: Any) -> int:
    """The exit code of ``process``, waited for off the event loop."""
    await asyncio.to_thread(process.join, 120)
    return int(process.exitcode)


@pytest.mark.pairs
def test_sync_and_async_processes_count_into_the_same_counter_exactly(
    store_url: str, aio_cache_url: str, name: str
) -> None:
    """Increments from an async kit's coroutines and a sync kit's process, interleaved,
    sum exactly; each kit reads the other's."""
    target = Target(store_url, aio_cache_url)

    async def work(kit: shardkit.aio.AsyncKit) -> int:
        counter = await kit.sharded(name, shards=4)
        process = sync_process(target, name, "sharded", 200)
        for _ in range(10):
            await asyncio.gather(*(counter.incr(3) for _ in range(30)))
        assert await counter.incr(7, key="async-once")
        assert not await counter.incr(7, key="async-once")
        assert await joined(process) == 0
        return await counter.value(fresh=True)

    expected = 200 - 50 + 10 * 30 * 3 + 7
    assert with_kit(store_url, aio_cache_url, work) == expected
    with target.connect() as kit:
        assert kit.sharded(name).value(fresh=True) == expected
        assert kit.values([name], fresh=True) == {name: expected}


def test_concurrent_coroutines_share_one_statement(
    store_url: str, aio_cache_url: str, name: str
) -> None:
    """256 coroutines incrementing one counter at once: one upsert carries them all (as
    the database counts its writes of the shard row), and every one of them returns
    having counted."""
    engine = sa.create_engine(store_url)

    async def work(kit: shardkit.aio.AsyncKit) -> tuple[list[bool], int, int]:
        counter = await kit.sharded(name, shards=1)
        await counter.incr(0)  # the shard row and its table exist
        with row_writes(engine, f"{PREFIX}shards", name) as upserts:
            applied = await asyncio.gather(*(counter.incr() for _ in range(256)))
            written = upserts()
        return applied, written, await counter.value()

    try:
        applied, upserts, value = with_kit(store_url, aio_cache_url, work)
    finally:
        engine.dispose()
    assert applied == [True] * 256
    assert upserts == 1
    assert value == 256


def test_keys_keep_their_exact_once_promise_inside_combined_writes(
    store_url: str, aio_cache_url: str, name: str
) -> None:
    """Combined keyed writes: a key repeated in the batch, or applied before, applies
    once, and only its first caller gets True."""

    async def work(kit: shardkit.aio.AsyncKit) -> tuple[list[bool], int]:
        counter = await kit.sharded(name)
        assert await counter.incr(100, key="k-0")
        keys = [f"k-{i % 50}" for i in range(200)]  # k-0 applied before; each 4 times
        applied = await asyncio.gather(*(counter.incr(1, key=key) for key in keys))
        return applied, await counter.value(fresh=True)

    applied, value = with_kit(store_url, aio_cache_url, work)
    assert applied == [0 < index < 50 for index in range(200)]  # each key's first, but k-0
    assert value == 100 + 49


def test_a_failed_combined_write_raises_for_every_caller_and_applies_for_none(
    store_url: str, aio_cache_url: str, name: str
) -> None:
    """Five increments combined into one statement that takes the shard past signed
    64-bit: each caller gets CounterOverflow, and the value is unchanged."""

    async def work(kit: shardkit.aio.AsyncKit) -> tuple[list[Any], int]:
        counter = await kit.sharded(name, shards=1)
        await counter.incr(INT64_MAX - 10)
        outcomes = await asyncio.gather(
            *(counter.incr(5) for _ in range(5)), return_exceptions=True
        )
        return outcomes, await counter.value(fresh=True)

    # On tables of its own: its huge value would widen other tests' `shardkit list`.
    prefix = f"{PREFIX}aio_big_"
    try:
        outcomes, value = with_kit(store_url, aio_cache_url, work, prefix)
    finally:
        store = open_store(store_url, prefix=prefix)
        assert isinstance(store, SqlStore)
        store.metadata.drop_all(store.engine)
        store.close()
    assert all(isinstance(outcome, CounterOverflow) for outcome in outcomes), outcomes
    assert value == INT64_MAX - 10


@pytest.mark.pairs
def test_cancelled_increments_apply_or_not_and_keyed_retries_make_them_exact(
    store_url: str, aio_cache_url: str, name: str
) -> None:
    """Thousands of keyed increments, started in waves and each cancelled at a random
    moment (before it runs, while queued, while its batch is written, or after), then
    retried with their keys: the value is exactly one per key, the cached value agrees
    (no write applied without its adjustment), and no connection is left checked out."""
    count = 2000

    async def work(kit: shardkit.aio.AsyncKit) -> tuple[int, int, int, int]:
        counter = await kit.sharded(name, shards=4)
        assert await counter.value() == 0  # cached from here on
        loop = asyncio.get_running_loop()
        moments = random.Random(7)
        tasks = []
        for wave in range(20):
            for i in range(wave * 100, wave * 100 + 100):
                task = asyncio.create_task(counter.incr(1, key=f"c-{i}"))
                loop.call_later(moments.uniform(0, 0.05), task.cancel)
                tasks.append(task)
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks, return_exceptions=True)
        cancelled = sum(task.cancelled() for task in tasks)
        await asyncio.gather(*(counter.incr(1, key=f"c-{i}") for i in range(count)))
        fresh = await counter.value(fresh=True)
        return cancelled, fresh, await counter.value(), kit.store.engine.pool.checkedout()

    cancelled, fresh, cached, checked_out = with_kit(store_url, aio_cache_url, work)
    assert cancelled > 0
    assert fresh == cached == count
    assert checked_out == 0


def test_values_and_cached_reads_include_the_process_own_writes(
    store_url: str, aio_cache_url: str, name: str
) -> None:
    async def work(kit: shardkit.aio.AsyncKit) -> list[int]:
        counter = await kit.sharded(name)
        seen = [await counter.value()]
        await counter.incr(5)
        seen.append(await counter.value())  # cached, then adjusted by the write
        seen.append((await kit.values([name]))[name])
        await counter.grow(30)
        seen.append(await counter.read_shards())
        return seen

    assert with_kit(store_url, aio_cache_url, work) == [0, 5, 5, 30]


FACES = [
    (shardkit.ShardedCounter, shardkit.aio.AsyncShardedCounter),
    (shardkit.BufferedCounter, shardkit.aio.AsyncBufferedCounter),
    (shardkit.MonotonicCounter, shardkit.aio.AsyncMonotonicCounter),
    (shardkit.IdAllocator, shardkit.aio.AsyncIdAllocator),
]
LOCAL = {"size_automatically"}  # no I/O: a plain method on both faces


@pytest.mark.parametrize(("sync", "awaited"), FACES, ids=lambda form: form.__name__)
def test_every_read_of_a_sync_counter_is_a_method_of_the_async_one(
    sync: type[Any], awaited: type[Any]
) -> None:
    """Each method of a sync counter is a coroutine method of the async one, and a
    property that reads the store is the shorthand of a ``read_`` method both have."""
    names = [name for name in dir(sync) if not name.startswith("_")]
    methods = [name for name in names if inspect.isfunction(inspect.getattr_static(sync, name))]
    properties = [
        name for name in names if isinstance(inspect.getattr_static(sync, name), property)
    ]
    assert methods
    for name in set(methods) - LOCAL:
        assert inspect.iscoroutinefunction(getattr(awaited, name, None)), name
    for name in properties:
        assert name not in dir(awaited), name
        assert f"read_{name}" in methods, name
        assert inspect.iscoroutinefunction(getattr(awaited, f"read_{name}")), name


def test_both_faces_read_a_growth_made_elsewhere_with_read_shards(
    sqlite_url: str, name: str
) -> None:
    with Target(sqlite_url, "memory://").connect() as kit:
        counter = kit.sharded(name, shards=2)

        async def work(kit: shardkit.aio.AsyncKit) -> list[int]:
            awaited = await kit.sharded(name)
            seen = [await awaited.read_shards()]
            counter.grow(5)  # by the sync kit: elsewhere, as the async kit sees it
            seen.append(await awaited.read_shards())
            await awaited.grow(7)
            return seen

        assert with_kit(sqlite_url, "memory://", work) == [2, 5]
        assert (counter.read_shards(), counter.shards) == (7, 7)


def test_closing_sends_the_adjustments_still_gathering(name: str, sqlite_url: str) -> None:
    """With a long adjust delay, the cached value another process reads has the async
    kit's writes once that kit is closed."""
    cache_url = CACHE_URLS["redis"]
    require(cache_url)

    async def main() -> None:
        kit = await shardkit.aio.connect(sqlite_url, cache_url, prefix=PREFIX, adjust_delay=60)
        counter = await kit.sharded(name)
        assert await counter.value() == 0  # cached
        await counter.incr(3)
        await kit.aclose()

    asyncio.run(main())
    with Target(sqlite_url, cache_url).connect() as kit:
        assert kit.cache.get(kit.settings.cache_key(name, "sharded:value")) == 3


def test_bad_input_is_refused_before_anything_is_written(sqlite_url: str, name: str) -> None:
    async def work(kit: shardkit.aio.AsyncKit) -> int:
        counter = await kit.sharded(name)
        with pytest.raises(InvalidDelta):
            await counter.incr(2**64)
        with pytest.raises(InvalidDelta):
            await counter.incr(True)
        with pytest.raises(shardkit.errors.InvalidName):
            await counter.incr(1, key="")
        with pytest.raises(shardkit.errors.InvalidName):
            await kit.sharded("")
        return await counter.value(fresh=True)

    assert with_kit(sqlite_url, "memory://", work) == 0


def test_an_unknown_cache_is_a_configuration_error(sqlite_url: str) -> None:
    async def main() -> None:
        await shardkit.aio.connect(sqlite_url, "mongodb://127.0.0.1:27017", prefix=PREFIX)

    with pytest.raises(ConfigurationError, match=r"unix://, redis\+cluster:// or memcached://"):
        asyncio.run(main())


# -- buffered counters --------------------------------------------------------------------


def record_bumps(kit: shardkit.aio.AsyncKit) -> list[int]:
    """The amounts of the cache's bumps (one per command) from now on, as they are sent."""
    sent: list[int] = []
    real = kit.cache.bump

    def bump(key: str, delta: int) -> Any:
        sent.append(delta)
        return real(key, delta)

    kit.cache.bump = bump
    return sent


def test_buffered_sync_and_async_processes_count_and_flush_each_other_exactly(
    store_url: str, name: str
) -> None:
    """A buffered counter written by an async kit's coroutines and a sync kit's process,
    each kit flushing what the other counted: exact (on Redis, which both share)."""
    cache_url = CACHE_URLS["redis"]
    require(cache_url)
    target = Target(store_url, cache_url)

    async def work(kit: shardkit.aio.AsyncKit) -> tuple[int, Any]:
        hits = await kit.buffered(name, interval=NEVER)
        process = sync_process(target, name, "buffered", 300)
        for round_ in range(10):
            await asyncio.gather(*(hits.incr() for _ in range(40)))
            await hits.decr(5)
            if round_ % 3 == 0:
                await hits.flush()
        assert await joined(process) == 0
        await kit.flush_all()
        return await hits.value(), await hits.parts()

    expected = 300 * 2 + 10 * (40 - 5)
    value, parts = with_kit(store_url, cache_url, work)
    assert value == expected
    assert parts == (expected, 0)
    with target.connect() as kit:
        assert kit.buffered(name).parts() == (expected, 0)


def test_concurrent_coroutines_share_one_cache_command(
    store_url: str, own_cache_url: str, name: str
) -> None:
    """256 coroutines incrementing a buffered counter at once are one cache command (as
    the cache server counts them)."""

    async def work(kit: shardkit.aio.AsyncKit) -> tuple[int, int]:
        hits = await kit.buffered(name, interval=NEVER)
        await hits.incr()  # its generation exists: what follows is bumps only
        sent = record_bumps(kit)  # memory://, which has no server: its calls
        received = increments_received(own_cache_url) or (lambda: len(sent))
        before = await asyncio.to_thread(received)
        await asyncio.gather(*(hits.incr() for _ in range(256)))
        return await asyncio.to_thread(received) - before, await hits.value()

    sent, value = with_kit(store_url, own_cache_url, work)
    assert sent == 1
    assert value == 257


@pytest.mark.pairs
def test_cancelled_buffered_increments_counted_or_not_never_half(
    store_url: str, aio_cache_url: str, name: str
) -> None:
    """Increments cancelled at random moments: the counter holds exactly what its cache
    commands carried — every completed increment, and a cancelled one only if its
    command was sent — and a flush moves exactly that."""

    async def work(kit: shardkit.aio.AsyncKit) -> tuple[int, int, int, Any]:
        hits = await kit.buffered(name, interval=NEVER)
        await hits.incr()
        sent = record_bumps(kit)
        loop = asyncio.get_running_loop()
        moments = random.Random(11)
        tasks = []
        for _ in range(20):
            for _ in range(50):
                task = asyncio.create_task(hits.incr(3))
                loop.call_later(moments.uniform(0, 0.02), task.cancel)
                tasks.append(task)
            await asyncio.sleep(0.001)
        await asyncio.gather(*tasks, return_exceptions=True)
        completed = sum(not task.cancelled() for task in tasks)
        await hits.flush()
        return 1 + sum(sent), completed, await hits.value(), await hits.parts()

    carried, completed, value, parts = with_kit(store_url, aio_cache_url, work)
    assert value == carried
    assert 1 + 3 * completed <= value <= 1 + 3 * 1000
    assert parts == (value, 0)


def test_a_flush_moves_a_cancelled_increment_whose_command_is_on_its_way(
    sqlite_url: str, name: str
) -> None:
    """An increment cancelled while its cache command is being sent counts; a flush
    begun before that command lands waits for it and moves it, leaving nothing behind."""

    async def work(kit: shardkit.aio.AsyncKit) -> tuple[int, Any]:
        hits = await kit.buffered(name, interval=NEVER)
        await hits.incr()
        sending, landing = asyncio.Event(), asyncio.Event()
        real = kit.cache.bump

        async def slow_bump(key: str, delta: int) -> Any:
            sending.set()
            await landing.wait()
            return await real(key, delta)

        kit.cache.bump = slow_bump
        increment = asyncio.create_task(hits.incr(5))
        await sending.wait()
        increment.cancel()
        flush = asyncio.create_task(hits.flush())
        asyncio.get_running_loop().call_later(0.05, landing.set)  # the flush has begun
        moved = await flush
        assert increment.cancelled()
        return moved, await hits.parts()

    assert with_kit(sqlite_url, "memory://", work) == (6, (6, 0))


def test_scheduled_flushes_run_on_the_event_loop(sqlite_url: str, name: str) -> None:
    """The interval's flush comes due as a task of the kit's loop: the store has the
    counts without any call to flush."""

    async def work(kit: shardkit.aio.AsyncKit) -> Any:
        hits = await kit.buffered(name, interval=0.05)
        await asyncio.gather(*(hits.incr() for _ in range(30)))
        deadline = asyncio.get_running_loop().time() + 30
        while (await hits.parts()).stored != 30:
            assert asyncio.get_running_loop().time() < deadline, "the scheduled flush"
            await asyncio.sleep(0.01)
        return await hits.parts()

    assert with_kit(sqlite_url, "memory://", work) == (30, 0)


def test_flushes_due_while_one_of_their_counter_waits_are_taken_into_it(
    sqlite_url: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The loop executor's one worker held by a task: a hundred flushes of each of two
    counters due meanwhile leave one of each waiting, and the store receives two
    flushes, which move everything; once one has started, the next waits again (it is
    news to the running one)."""
    names = [f"{name}:a", f"{name}:b"]
    total = sum(range(100))

    async def work(kit: shardkit.aio.AsyncKit) -> list[dict[str, int]]:
        holding, release = asyncio.Event(), asyncio.Event()
        flushed: list[dict[str, int]] = []

        async def hold(args: Mapping[str, Any]) -> None:
            holding.set()
            await release.wait()

        async def flush(args: Mapping[str, Any]) -> None:
            flushed.append(await kit._carry_out(scheduled_flush(kit.settings, args)))

        async def flushes(count: int) -> None:
            while len(flushed) < count:
                await asyncio.sleep(0.01)

        executor = shardkit.aio.LoopExecutor(kit.settings.marks, workers=1)
        executor.bind({"hold": hold, "flush": flush})
        counters = [await kit.buffered(each, interval=NEVER) for each in names]
        await executor.submit("hold", {})
        try:
            await asyncio.wait_for(holding.wait(), 60)
            with caplog.at_level(logging.WARNING, logger="shardkit"):
                for n in range(100):
                    for counter in counters:
                        await counter.incr(n)
                        assert await executor.submit(
                            "flush", {"name": counter.name}, merge=f"flush:{counter.name}"
                        )
                assert executor.queued == 2
            assert len(caplog.records) == 1  # one line, not one per merged flush
            assert "fall behind" in caplog.text
            release.set()
            await asyncio.wait_for(flushes(2), 60)
            assert [await counter.parts() for counter in counters] == [(total, 0)] * 2
            await counters[0].incr(7)
            await executor.submit("flush", {"name": names[0]}, merge=f"flush:{names[0]}")
            await asyncio.wait_for(flushes(3), 60)
        finally:
            release.set()
            await executor.close()
        return flushed

    assert with_kit(sqlite_url, "memory://", work) == [
        {names[0]: total},
        {names[1]: total},
        {names[0]: 7},
    ]


def test_closing_flushes_what_is_pending(store_url: str, aio_cache_url: str, name: str) -> None:
    """``aclose()`` runs the flushes waiting on the loop: the store has every count."""

    async def work(kit: shardkit.aio.AsyncKit) -> None:
        hits = await kit.buffered(name, interval=NEVER)
        await hits.incr(41)
        await hits.decr()

    with_kit(store_url, aio_cache_url, work)
    with Target(store_url, "memory://").connect() as kit:
        assert kit.store.total(name) == 40


@pytest.mark.pairs
def test_async_delete_and_reset_end_every_kind(
    store_url: str, aio_cache_url: str, name: str
) -> None:
    """The async kit's delete and reset: what the sync kit's do (``test_lifecycle``),
    awaited; its objects of the old incarnation move to the new one."""

    async def work(kit: shardkit.aio.AsyncKit) -> None:
        votes = await kit.sharded(f"{name}:s")
        await votes.incr(5)
        hits = await kit.buffered(f"{name}:b", interval=NEVER)
        await hits.incr(3)
        sequence = await kit.monotonic(f"{name}:m", chance_to_write=1.0)
        await sequence.incr(9)
        ids = await kit.ids(f"{name}:i", block=10)
        first = await ids.take(2)
        for suffix in "sbm":
            was = await kit.reset(f"{name}:{suffix}")
            assert was.name == f"{name}:{suffix}"
        assert await votes.value(fresh=True) == 0
        assert await hits.value() == 0
        assert await sequence.incr() == 1
        with pytest.raises(ValidationError, match="id allocator"):
            await kit.reset(f"{name}:i")
        await kit.delete(f"{name}:i")
        with pytest.raises(CounterNotFound):
            await kit.get(f"{name}:i")
        later = await (await kit.ids(f"{name}:i", block=10)).take(2)
        assert min(later) > 10 >= max(first)
        await hits.incr(2)
        assert await hits.value() == 2

    with_kit(store_url, aio_cache_url, work)


# -- monotonic counters and id allocators -------------------------------------------------


@pytest.mark.pairs
def test_ids_from_sync_and_async_processes_never_repeat(
    store_url: str, aio_cache_url: str, name: str
) -> None:
    """Coroutines of an async kit and a thread of a sync kit take ids from one allocator,
    small blocks used up again and again: no id twice."""
    target = Target(store_url, aio_cache_url)
    synced: list[int] = []

    def sync_taker() -> None:
        with target.connect() as kit:
            synced.extend(kit.ids(name, block=7).take(300))

    async def work(kit: shardkit.aio.AsyncKit) -> list[int]:
        ids = await kit.ids(name, block=7)
        thread = threading.Thread(target=sync_taker)
        thread.start()
        batches = await asyncio.gather(*(ids.take(10) for _ in range(30)))
        await asyncio.to_thread(thread.join)
        for batch in batches:
            assert batch == sorted(batch)
        assert await ids.reserved() >= max(max(batch) for batch in batches)
        return [i for batch in batches for i in batch]

    taken = with_kit(store_url, aio_cache_url, work)
    assert len(synced) == 300
    assert len(set(taken) | set(synced)) == len(taken) + len(synced) == 600


@pytest.mark.pairs
def test_cancelled_id_takers_leave_no_lock_held_and_no_id_twice(
    store_url: str, aio_cache_url: str, name: str
) -> None:
    """Takers cancelled at random moments, some while one of them moves the allocator to
    a new block: the ids the others got are distinct, and the allocator goes on."""

    async def work(kit: shardkit.aio.AsyncKit) -> list[int]:
        ids = await kit.ids(name, block=5)
        loop = asyncio.get_running_loop()
        moments = random.Random(3)
        tasks = []
        for _ in range(400):
            task = asyncio.create_task(ids.next())
            loop.call_later(moments.uniform(0, 0.01), task.cancel)
            tasks.append(task)
        await asyncio.gather(*tasks, return_exceptions=True)
        got = [task.result() for task in tasks if not task.cancelled()]
        return got + await asyncio.wait_for(ids.take(50), 30)

    taken = with_kit(store_url, aio_cache_url, work)
    assert len(taken) == len(set(taken)) >= 50


def test_a_cancelled_callers_transaction_finishes_and_holds_no_lock(
    store_url: str, name: str
) -> None:
    """A caller cancelled while its transaction runs stops waiting at once; the
    transaction is not interrupted midway (which left aiosqlite's connection holding the
    database's write lock): it commits, and the next writer writes."""
    inserted, release = threading.Event(), threading.Event()

    def work(conn: sa.Connection) -> None:
        conn.execute(sa.text(f"INSERT INTO {table} (name) VALUES ('{name}')"))
        inserted.set()
        while not release.is_set():  # each statement lets the event loop run
            conn.execute(sa.text("SELECT 1"))

    async def main(kit: shardkit.aio.AsyncKit) -> list[str]:
        store = kit.store
        await store.transaction("making a table", create)
        caller = asyncio.create_task(store.transaction("inserting", work))
        await poll(inserted.is_set)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        release.set()
        await store.transaction("inserting again", again)
        rows = await store.read("reading", sa.text(f"SELECT name FROM {table} ORDER BY name"))
        return [row[0] for row in rows]

    table = f"{PREFIX}cancelled_{name[-8:]}"

    def create(conn: sa.Connection) -> None:
        conn.execute(sa.text(f"CREATE TABLE IF NOT EXISTS {table} (name VARCHAR(100))"))

    def again(conn: sa.Connection) -> None:
        conn.execute(sa.text(f"INSERT INTO {table} (name) VALUES ('{name}:again')"))

    try:
        assert with_kit(store_url, "memory://", main) == [name, f"{name}:again"]
    finally:
        with_kit(store_url, "memory://", drop(table))


async def poll(done: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait (letting the loop run) until ``done()``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def drop(table: str) -> Callable[[shardkit.aio.AsyncKit], Awaitable[None]]:
    async def dropping(kit: shardkit.aio.AsyncKit) -> None:
        await kit.store.transaction(
            "dropping", lambda conn: conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
        )

    return dropping


@pytest.mark.pairs
def test_monotonic_values_from_coroutines_are_distinct_and_persisted(
    store_url: str, aio_cache_url: str, name: str
) -> None:
    async def work(kit: shardkit.aio.AsyncKit) -> tuple[list[int], int, int]:
        pages = await kit.monotonic(name, shards=4, chance_to_write=0.5)
        values = await asyncio.gather(*(pages.incr() for _ in range(200)))
        await pages.checkpoint()
        return values, await pages.value(), await pages.persisted()

    values, value, persisted = with_kit(store_url, aio_cache_url, work)
    assert sorted(values) == list(range(1, 201))
    assert value == persisted == 200


# -- mapping jobs --------------------------------------------------------------------------


def test_a_job_is_read_and_waited_for_without_blocking_the_loop(store_url: str, name: str) -> None:
    """A job started by a sync kit (its pages held until the async waiter has polled):
    the async kit reads its status and waits for its end while the loop goes on."""
    target = Target(store_url, "memory://")
    table = sa.Table(
        f"{PREFIX}aio_rows_{name[-8:]}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("n", sa.Integer, nullable=False),
    )
    polled = threading.Event()

    def fn(batch: shardkit.Batch) -> None:
        assert polled.wait(60)  # the job runs while it is waited for
        ids = [row["id"] for row in batch.rows]
        batch.conn.execute(sa.update(table).where(table.c.id.in_(ids)).values(n=table.c.n + 1))

    with target.connect() as kit:
        engine = kit.store.engine  # type: ignore[attr-defined]
        table.create(engine)
        try:
            with engine.begin() as conn:
                conn.execute(sa.insert(table), [{"id": i, "n": 0} for i in range(1, 301)])
            job = kit.map(table, fn, transactional=True, page_size=50)

            async def work(akit: shardkit.aio.AsyncKit) -> tuple[Any, Any, int]:
                handle = await akit.job(job.id)
                first = await handle.status()
                ticks = 0

                async def ticker() -> None:
                    nonlocal ticks
                    while True:
                        await asyncio.sleep(0.005)
                        ticks += 1
                        polled.set()

                beat = asyncio.create_task(ticker())
                done = await handle.wait(60, poll=0.01)
                beat.cancel()
                listed = [status.id for status in await akit.jobs()]
                assert job.id in listed
                with pytest.raises(shardkit.JobNotFound):
                    await akit.job("no-such-job")
                return first, done, ticks

            first, done, ticks = with_kit(store_url, "memory://", work)
            assert first.state == "running"
            assert (done.state, done.rows) == ("complete", 300)
            assert ticks > 0  # the loop ran while the job was waited for
            with engine.connect() as conn:
                assert conn.execute(sa.select(sa.func.sum(table.c.n))).scalar_one() == 300
        finally:
            table.drop(engine)


def test_a_direct_postgresql_connection_keeps_prepared_statements() -> None:
    """Without a pooler in front, the async store's psycopg connections are left to
    prepare their statements (only a pooler's are told not to)."""
    store_url = STORE_URLS["postgres"]
    assert store_url is not None
    require(store_url)

    async def work(kit: shardkit.aio.AsyncKit) -> tuple[bool, Any]:
        async with kit.store.engine.connect() as conn:
            assert conn.sync_connection is not None
            raw = await conn.get_raw_connection()
            return conn.sync_connection.info[_POOLED], raw.driver_connection.prepare_threshold

    assert with_kit(store_url, "memory://", work) == (False, 5)


def test_a_transaction_whose_commit_fails_says_so_in_either_store() -> None:
    """A transaction whose COMMIT fails (on a constraint checked only then) raises
    ``BackendError`` "failed while committing (…)" with the database's error chained,
    from the async store as from the sync one; nothing of it is kept."""
    store_url = STORE_URLS["postgres"]
    assert store_url is not None
    require(store_url)
    engine = sa.create_engine(store_url)
    marks = sa.Table(
        f"{PREFIX}marks_{random.getrandbits(32):08x}",
        sa.MetaData(),
        sa.Column("n", sa.Integer),
        sa.UniqueConstraint("n", deferrable=True, initially="DEFERRED"),
    )
    marks.create(engine)

    def mark(conn: sa.Connection) -> None:
        conn.execute(marks.insert(), [{"n": 1}, {"n": 1}])  # refused at COMMIT

    async def work(kit: shardkit.aio.AsyncKit) -> tuple[str, BaseException]:
        with pytest.raises(BackendError) as raised:
            await kit.store.transaction("marking", mark)
        return kit.store.url, raised.value

    try:
        sync = open_store(store_url, prefix=PREFIX)
        assert isinstance(sync, SqlStore)
        with pytest.raises(BackendError) as raised:
            sync.transaction("marking", mark)
        sync.close()
        failures = [(sync.url, raised.value), with_kit(store_url, "memory://", work)]
        for url, error in failures:
            said = f"store {url} failed while committing (marking): duplicate key value"
            assert str(error).startswith(said)
            assert isinstance(error.__cause__, sa.exc.IntegrityError)
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(marks)).scalar_one() == 0
    finally:
        marks.drop(engine)
        engine.dispose()


def test_purging_keys_lets_a_key_apply_again(sqlite_url: str, name: str) -> None:
    """With no retention, ``purge_keys()`` deletes the recorded keys: the same key then
    applies once more (as the sync kit's does)."""

    async def main() -> tuple[int, bool, int]:
        kit = await shardkit.aio.connect(sqlite_url, "memory://", prefix=PREFIX, key_retention=0)
        async with kit:
            views = await kit.sharded(name)
            assert await views.incr(1, key="once")
            assert not await views.incr(1, key="once")
            purged = await kit.purge_keys()
            again = await views.incr(1, key="once")
            return purged, again, await views.value(fresh=True)

    purged, again, value = asyncio.run(main())
    assert purged >= 1
    assert again
    assert value == 2


def test_get_opens_an_existing_counter_of_whatever_kind(sqlite_url: str, name: str) -> None:
    async def work(kit: shardkit.aio.AsyncKit) -> list[str]:
        await (await kit.buffered(f"{name}:b")).incr(2)
        await (await kit.ids(f"{name}:i")).next()
        await (await kit.monotonic(f"{name}:m")).incr()
        await (await kit.sharded(f"{name}:s")).incr()
        with pytest.raises(shardkit.CounterNotFound):
            await kit.get(f"{name}:none")
        return [type(await kit.get(f"{name}:{k}")).__name__ for k in "bims"]

    assert with_kit(sqlite_url, "memory://", work) == [
        "AsyncBufferedCounter",
        "AsyncIdAllocator",
        "AsyncMonotonicCounter",
        "AsyncShardedCounter",
    ]

    async def fresh(kit: shardkit.aio.AsyncKit) -> list[str]:  # not opened in this kit
        return [(await kit.get(f"{name}:{k}")).kind for k in "bims"]

    assert with_kit(sqlite_url, "memory://", fresh) == ["buffered", "ids", "monotonic", "sharded"]


def test_coroutines_past_a_cluster_nodes_connections_wait_for_one(
    redis_cluster: Any, name: str
) -> None:
    """300 coroutines reading one key while its node holds every command (``CLIENT
    PAUSE``): the asyncio cluster client would open a connection for each and fail the
    101st at once; the cache keeps the rest waiting, and every read answers."""
    import redis

    from shardkit.aio.cluster import AsyncRedisClusterCache

    key = f"{name}:paused"

    async def main() -> list[Any]:
        cache = AsyncRedisClusterCache.from_url(redis_cluster.url)
        try:
            assert await cache.add(key, 7, 60)
            for node in redis_cluster.primaries():
                with redis.Redis(port=node.port) as client:
                    client.execute_command("CLIENT", "PAUSE", 300)
            return list(await asyncio.gather(*(cache.get(key) for _ in range(300))))
        finally:
            await cache.close()

    assert asyncio.run(main()) == [7] * 300
