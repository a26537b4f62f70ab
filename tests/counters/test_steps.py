"""Rules whose work is one call (steps: ``shardkit._program.Steps``) on real servers: a
form's method makes the call itself, and ``run``/``arun`` make the same step as a
program of one call (``Blocking._carry_out``). Both give the same results and send the
same commands, as the servers count them (upserts by the database's row triggers,
``INCRBY`` by Redis's own statistics): the sharded and buffered counters' writes without
a key, the SQL store's ``add_many`` and the Redis cache's ``bump``, on the sync and the
async forms, with metrics off and on (which keep a step a step)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa

import shardkit
import shardkit.aio
from backends import NEVER, PREFIX, Target
from received import increments_received, row_writes
from shardkit import metrics
from shardkit._program import Call
from shardkit.cache.redis import RedisCore
from shardkit.counters.buffered import BufferedCore
from shardkit.counters.sharded import ShardedCore
from shardkit.errors import BackendError
from shardkit.store.sql import SqlCore

FORMS = ["sync", "async"]
METRICS = pytest.mark.parametrize("metered", [False, True], ids=["metrics-off", "metrics-on"])

Done = Callable[[Any], Any]


@contextlib.contextmanager
def opened(form: str, store_url: str, cache_url: str) -> Iterator[tuple[Any, Done]]:
    """A kit of ``form`` on the tests' tables, and ``done``: what a call of it returns
    (awaited on the kit's event loop, for the async form)."""
    if form == "sync":
        with Target(store_url, cache_url).connect() as sync_kit:
            yield sync_kit, lambda returned: returned
        return
    loop = asyncio.new_event_loop()
    try:
        kit: Any = loop.run_until_complete(
            shardkit.aio.connect(store_url, cache_url, prefix=PREFIX)
        )
        try:
            yield kit, loop.run_until_complete
        finally:
            loop.run_until_complete(kit.aclose())
    finally:
        loop.close()


@contextlib.contextmanager
def metered_as(on: bool) -> Iterator[None]:
    """Metrics on or off within the block (a kit turns them on when opened: enter the
    block after)."""
    was = metrics.meter.enabled
    metrics.enable() if on else metrics.disable()
    try:
        yield
    finally:
        metrics.enable() if was else metrics.disable()


@pytest.mark.parametrize("form", FORMS)
@METRICS
def test_a_sharded_write_without_a_key_is_one_upsert_as_a_step_and_as_a_program(
    form: str, metered: bool, store_url: str, name: str
) -> None:
    engine = sa.create_engine(store_url)
    try:
        with opened(form, store_url, "memory://") as (kit, done):
            counter = done(kit.sharded(name, shards=1))
            done(counter.incr(0))  # the shard row and its table exist
            with metered_as(metered), row_writes(engine, f"{PREFIX}shards", name) as upserts:
                assert type(ShardedCore.incr.program(counter, 1)) is Call  # made, not sent
                assert type(ShardedCore.decr.program(counter, 1)) is Call
                applied = [
                    done(counter.incr(3)),
                    done(counter._carry_out(ShardedCore.incr.program(counter, 4))),
                    done(counter.decr(2)),
                    done(counter._carry_out(ShardedCore.decr.program(counter, 1))),
                ]
                written = upserts()
            value = done(counter.value(fresh=True))
    finally:
        engine.dispose()
    assert applied == [True] * 4
    assert written == 4
    assert value == 3 + 4 - 2 - 1


@pytest.mark.parametrize("form", FORMS)
@METRICS
def test_a_buffered_increment_without_a_key_is_one_incrby_as_a_step_and_as_a_program(
    form: str, metered: bool, sqlite_url: str, own_redis: str, name: str
) -> None:
    received = increments_received(own_redis)
    assert received is not None
    with opened(form, sqlite_url, own_redis) as (kit, done):
        hits = done(kit.buffered(name, interval=NEVER))
        done(hits.incr())  # its generation exists, its flush is scheduled: bumps only now
        with metered_as(metered):
            assert type(BufferedCore.incr.program(hits, 1)) is Call  # made, not sent
            before = received()
            counted = [
                done(hits.incr(3)),
                done(hits._carry_out(BufferedCore.incr.program(hits, 4))),
                done(hits.decr(2)),
                done(hits._carry_out(BufferedCore.decr.program(hits, 1))),
            ]
            sent = received() - before
        value = done(hits.value())
    assert counted == [True] * 4
    assert sent == 4
    assert value == 1 + 3 + 4 - 2 - 1


@pytest.mark.parametrize("form", FORMS)
def test_a_stores_add_many_without_keys_is_one_upsert_as_a_step_and_as_a_program(
    form: str, store_url: str, name: str
) -> None:
    engine = sa.create_engine(store_url)
    try:
        with opened(form, store_url, "memory://") as (kit, done):
            store = kit.store
            done(kit.sharded(name, shards=1))
            writes = [(2, None), (3, None)]
            assert type(SqlCore.add_many.program(store, name, 0, writes)) is Call
            with row_writes(engine, f"{PREFIX}shards", name) as upserts:
                applied = [
                    done(store.add_many(name, 0, writes)),
                    done(store._carry_out(SqlCore.add_many.program(store, name, 0, [(5, None)]))),
                ]
                written = upserts()
            total = done(store.total(name))
    finally:
        engine.dispose()
    assert applied == [[True, True], [True]]
    assert written == 2
    assert total == 10


@pytest.mark.parametrize("form", FORMS)
def test_a_caches_bump_is_one_incrby_and_fails_as_ours_as_a_step_and_as_a_program(
    form: str, sqlite_url: str, own_redis: str, name: str
) -> None:
    """The same sums and commands; a command the server refuses (the key holds no
    number) raises ``BackendError`` from the client's error either way, and changes
    nothing."""
    received = increments_received(own_redis)
    assert received is not None
    client = redis.Redis.from_url(own_redis)
    key, refused = f"{name}:bumped", f"{name}:word"
    client.set(refused, "word")
    try:
        with opened(form, sqlite_url, own_redis) as (kit, done):
            cache = kit.cache
            assert type(RedisCore.bump.program(cache, key, 1)) is Call  # made, not sent
            before = received()
            sums = [
                done(cache.bump(key, 5)),
                done(cache._carry_out(RedisCore.bump.program(cache, key, 7))),
            ]
            sent = received() - before
            made: list[Callable[[], Any]] = [
                lambda: cache.bump(refused, 1),
                lambda: cache._carry_out(RedisCore.bump.program(cache, refused, 1)),
            ]
            for bump in made:
                with pytest.raises(BackendError, match="incrementing") as raised:
                    done(bump())
                assert isinstance(raised.value.__cause__, redis.ResponseError)
        assert client.get(refused) == b"word"
    finally:
        client.delete(key, refused)
        client.close()
    assert sums == [5, 12]
    assert sent == 2
