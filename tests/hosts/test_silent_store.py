"""A store that goes silent mid-call (its host cut off while the call waits for its
answer) fails the call within about 30 s, by the connection's keepalive probes, instead
of leaving it waiting for hours; the next call, once the host is back, works."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

import shardkit
from backends import PREFIX, wait_for
from deployment import Deployment

pytestmark = pytest.mark.slow

SILENCE = 90.0  # seconds a call may wait on a silent store: ~30 s, with room for load


def test_a_call_waiting_on_a_silent_store_fails_and_the_next_one_works(
    deployment: Deployment,
) -> None:
    name = f"test:hosts:silent:{uuid.uuid4().hex}"
    store_host = deployment.hosts[0]
    with shardkit.connect(deployment.store_url, "memory://", prefix=PREFIX) as kit:
        counter = kit.sharded(name, shards=1)
        counter.incr()
        shards = f"{PREFIX}shards"
        outcome: dict[str, Any] = {}
        locker = sa.create_engine(deployment.store_url).connect()
        try:
            locker.execute(sa.text(f"LOCK TABLE {shards} IN ACCESS EXCLUSIVE MODE"))

            def write() -> None:
                try:
                    outcome["result"] = counter.incr()
                except shardkit.ShardkitError as exc:
                    outcome["error"] = exc

            writer = threading.Thread(target=write, daemon=True)  # a hung one ends with us
            writer.start()

            def waits() -> bool:  # the write is at the server, queued behind the lock
                query = "SELECT count(*) FROM pg_locks WHERE NOT granted"
                return bool(locker.execute(sa.text(query)).scalar_one())

            wait_for(waits, "the write to wait for the table's lock", 30)
            store_host.partition()
            wait_for(lambda: not writer.is_alive(), "the write to fail", SILENCE)
            assert isinstance(outcome.get("error"), shardkit.BackendUnavailable), outcome
        finally:
            store_host.heal()
            locker.invalidate()  # its server session ends with the host's silence
            locker.close()
        assert counter.incr()
        assert counter.value(fresh=True) >= 2
