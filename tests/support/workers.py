"""Entry points of the processes the multi-process tests spawn (importable by a child).

Each takes plain strings for where the kit lives, so a spawned child needs neither
pytest nor conftest.
"""

from __future__ import annotations

import os
import random
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa

import shardkit
from backends import NEVER

Where = tuple[str, str, str]  # (store URL, cache URL, table prefix)
TIMEOUT = 60.0  # seconds any worker waits for its start signal
# A writer stops after CAP times its planned increments. SQLite's lock is not fair: a
# grow() may wait for it while the writers hammer, up to its 60 s busy timeout; CAP lets
# every writer outlast that (1,000 did not, now and then).
CAP = 20_000


def deltas(seed: int, count: int) -> Iterator[int]:
    """``count`` non-zero deltas of both signs, the same for the same seed, drawn as
    they are used."""
    rng = random.Random(seed)
    return (rng.choice((-1, 1)) * rng.randint(1, 1000) for _ in range(count))


def _connect(where: Where) -> shardkit.Kit:
    store_url, cache_url, prefix = where
    return shardkit.connect(store_url, cache_url, prefix=prefix)


def random_writer(
    where: Where,
    name: str,
    slot: int,
    seed: int,
    count: int,
    start: Any,
    stop: Any,
    progress: Any,
    results: Any,
) -> None:
    """Once ``start`` is set, apply ``deltas(seed, …)`` one by one, counting them in
    ``progress[slot]``, until at least ``count`` are done and ``stop`` is set (or CAP times
    ``count`` are done); put ``(slot, (increments done, their sum), error)`` on ``results``."""
    done = total = 0
    try:
        with _connect(where) as kit:
            counter = kit.get(name)
            if not start.wait(TIMEOUT):
                raise TimeoutError("never told to start")
            for delta in deltas(seed, CAP * count):
                if done >= count and stop.is_set():
                    break
                assert counter.incr(delta) is True
                done += 1
                total += delta
                progress[slot] = done
        results.put((slot, (done, total), None))
    except BaseException:
        results.put((slot, (done, total), traceback.format_exc()))


def keyed_racer(
    where: Where,
    name: str,
    slot: int,
    keys: dict[str, int],
    order_seed: int,
    barrier: Any,
    results: Any,
) -> None:
    """Try every key of ``keys`` (key -> delta) in a shuffled order, starting with the
    others at ``barrier``; put ``(slot, keys whose incr returned True, error)``."""
    applied: list[str] = []
    try:
        order = sorted(keys)
        random.Random(order_seed).shuffle(order)
        with _connect(where) as kit:
            counter = kit.get(name)
            barrier.wait(TIMEOUT)
            applied = [key for key in order if counter.incr(keys[key], key=key)]
        results.put((slot, applied, None))
    except BaseException:
        barrier.abort()  # the others fail at once rather than wait for this one
        results.put((slot, applied, traceback.format_exc()))


def logging_writer(
    where: Where, name: str, slot: int, seed: int, log_path: str, threads: int = 1
) -> None:
    """Write increments from ``threads`` threads (whose concurrent increments the counter
    combines) until killed (or for at most two minutes), logging to ``log_path`` with one
    unbuffered write per line:

    * ``conn <id>`` for every database connection opened (server-side id), before use;
    * ``intent <delta> <thread>`` before each ``incr``, ``done <delta> <thread>`` after it
      returned;
    * ``error <message>`` if anything fails.

    Every other increment of a sharded counter carries an idempotency key, so both write
    paths get killed. (A buffered counter takes no keys.)
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(line: str) -> None:
        os.write(fd, f"{line}\n".encode())

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        info = getattr(dbapi_connection, "info", None)
        if hasattr(info, "backend_pid"):  # psycopg
            log(f"conn {info.backend_pid}")
        elif hasattr(dbapi_connection, "thread_id"):  # PyMySQL
            log(f"conn {dbapi_connection.thread_id()}")

    def write(counter: Any, thread: int, deadline: float) -> None:
        rng = random.Random(seed + thread)
        step = 0
        try:
            while time.monotonic() < deadline:
                step += 1
                delta = rng.choice((-1, 1)) * rng.randint(1, 1000)
                log(f"intent {delta} {thread}")
                if counter.kind == "buffered":  # no keys; returns None
                    counter.incr(delta)
                else:
                    key = f"w{slot}-{thread}-{step}" if step % 2 else None
                    if not counter.incr(delta, key=key):
                        raise AssertionError(f"fresh key {key} reported as applied already")
                log(f"done {delta} {thread}")
        except BaseException as exc:
            log(f"error {type(exc).__name__}: {exc}".replace("\n", " "))
            raise

    try:
        sa.event.listen(sa.pool.Pool, "connect", on_connect)
        with _connect(where) as kit:
            counter = kit.get(name)
            log("ready")
            deadline = time.monotonic() + 120
            others = [
                threading.Thread(target=write, args=(counter, thread, deadline))
                for thread in range(1, threads)
            ]
            for other in others:
                other.start()
            write(counter, 0, deadline)
            for other in others:
                other.join()
    except BaseException as exc:
        log(f"error {type(exc).__name__}: {exc}".replace("\n", " "))
        raise
    finally:
        os.close(fd)


def sync_counter(where: Where, name: str, kind: str, rounds: int) -> None:
    """A sync kit's process counting into ``name`` while an async kit does (the async
    kit's tests): a sharded counter gets ``rounds`` increments of 1 and a keyed decrement
    of 50 made twice; a buffered one ``rounds`` increments of 2, flushed every 100."""
    with _connect(where) as kit:
        if kind == "sharded":
            counter = kit.sharded(name, shards=4)
            for _ in range(rounds):
                counter.incr()
            counter.decr(50, key="sync-once")
            counter.decr(50, key="sync-once")
        else:
            hits = kit.buffered(name, interval=NEVER)
            for index in range(rounds):
                hits.incr(2)
                if index % 100 == 0:
                    hits.flush()


def auto_writer(where: Where, name: str, seconds: float, start: Any, results: Any) -> None:
    """Once ``start`` is set, increment the automatic sharded counter ``name`` for
    ``seconds``; put ``(increments done, the shard count this process ends with, error)``
    on ``results``."""
    done, shards, error = 0, 0, None
    try:
        with _connect(where) as kit:
            counter = kit.sharded(name, shards="auto")
            if not start.wait(TIMEOUT):
                raise TimeoutError("never told to start")
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                counter.incr()
                done += 1
            shards = counter._shards  # what this process writes over now
    except BaseException:
        error = traceback.format_exc()
    results.put((done, shards, error))
