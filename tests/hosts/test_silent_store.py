"""A store or a cache that goes silent mid-call (its host cut off while the call waits
for its answer) fails the call — the store's within about 30 s, by the connection's
keepalive probes; a Redis cache's in 5 s — instead of leaving it waiting for as long as
TCP retransmits (about 15 minutes); the next call, once the host is back, works."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import shardkit
from backends import NEVER, PREFIX, wait_for
from deployment import Deployment

pytestmark = pytest.mark.slow

SILENCE = 90.0  # seconds a call may wait on a silent store: ~30 s, with room for load


def _failing(call: Callable[[], object]) -> Callable[[], dict[str, Any]]:
    """Start ``call`` in a thread (a hung one ends with the test's process); the dict
    it leaves its ``result`` or ``error`` in."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except shardkit.ShardkitError as exc:
            outcome["error"] = exc

    threading.Thread(target=run, daemon=True).start()
    return lambda: outcome


def test_a_call_waiting_on_a_silent_store_fails_and_the_next_one_works(
    deployment: Deployment,
) -> None:
    name = f"test:hosts:silent:{uuid.uuid4().hex}"
    store_host = deployment.hosts[0]
    with shardkit.connect(deployment.store_url, "memory://", prefix=PREFIX) as kit:
        counter = kit.sharded(name, shards=1)
        counter.incr()
        shards = f"{PREFIX}shards"
        locker = sa.create_engine(deployment.store_url).connect()
        try:
            locker.execute(sa.text(f"LOCK TABLE {shards} IN ACCESS EXCLUSIVE MODE"))
            outcome = _failing(counter.incr)

            def waits() -> bool:  # the write is at the server, queued behind the lock
                query = "SELECT count(*) FROM pg_locks WHERE NOT granted"
                return bool(locker.execute(sa.text(query)).scalar_one())

            wait_for(waits, "the write to wait for the table's lock", 30)
            store_host.partition()
            wait_for(outcome, "the write to fail", SILENCE)
            assert isinstance(outcome().get("error"), shardkit.BackendUnavailable), outcome()
        finally:
            store_host.heal()
            locker.invalidate()  # its server session ends with the host's silence
            locker.close()
        assert counter.incr()
        assert counter.value(fresh=True) >= 2


def test_a_call_waiting_on_a_silent_redis_cache_fails_in_seconds(
    deployment: Deployment, tmp_path: Path
) -> None:
    """A buffered increment sent to a Redis server whose host is cut off (the connection
    it goes out on was made before) fails with ``BackendUnavailable`` once 5 s pass
    without a reply; without a read timeout it would wait for TCP to give up."""
    name = f"test:hosts:silent:{uuid.uuid4().hex}"
    cache_host = deployment.hosts[0]
    cache = deployment.broker.url.removesuffix("/0") + "/2"
    store = f"sqlite:///{tmp_path / 'store.db'}"  # here: only the cache's host is cut off
    with shardkit.connect(store, cache, prefix=PREFIX) as kit:
        counter = kit.buffered(name, interval=NEVER)
        assert counter.incr() is True  # a pooled connection to the server, made
        cache_host.partition()
        try:
            cut_at = time.monotonic()
            outcome = _failing(counter.incr)
            wait_for(outcome, "the increment to fail", SILENCE)
            waited = time.monotonic() - cut_at
            assert isinstance(outcome().get("error"), shardkit.BackendUnavailable), outcome()
            assert waited >= 5.0  # it waited for the reply, not for a connection refused
        finally:
            cache_host.heal()
        counter.incr()
        assert counter.value() in (2, 3)  # the failed one may have reached the server
