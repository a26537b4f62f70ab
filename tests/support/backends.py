"""Backends for the tests: real services, reached over real connections.

A service-backed test skips with the reason when its service is unreachable, and fails
instead when CI=true. Every URL comes from a SHARDKIT_TEST_* variable (the README lists
them). Every test session gets its own table prefix and cache namespace, so runs never
touch each other's data, and uses only the Redis databases the README gives the tests;
its tables are dropped at the end.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import socket
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import sqlalchemy as sa

import shardkit
from shardkit.cache import open_cache
from shardkit.cache.memory import MemoryCache
from shardkit.errors import BackendError
from shardkit.mapper.tables import ledger_tables
from shardkit.store import open_store
from shardkit.store.sql import SqlStore
from shardkit.validation import MAX_TTL

if TYPE_CHECKING:  # pytest is imported where a test calls for it, not by the children
    import pytest  # that import these modules

CI = os.environ.get("CI", "").lower() == "true"
SUPPORT = Path(__file__).resolve().parent  # these modules: on PYTHONPATH for child processes
ROOT = SUPPORT.parents[1]  # the repository

STORE_URLS = {
    "sqlite": None,  # a file in the session's temporary directory
    "postgres": os.environ.get(
        "SHARDKIT_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    ),
    # The tests' MariaDB serves no TLS: without ssl_disabled, PyMySQL would build a TLS
    # context (loading the system's CA certificates) for every connection, then fall back.
    "mysql": os.environ.get(
        "SHARDKIT_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test?ssl_disabled=true"
    ),
}
REDIS = os.environ.get("SHARDKIT_TEST_REDIS", "redis://127.0.0.1:6379/13")
# The databases of REDIS's server that the README gives to the tests (and benchmarks).
REDIS_DATABASES = range(8, 15)


def redis_database(number: int) -> str:
    """The URL of database ``number`` on the tests' Redis server (SHARDKIT_TEST_REDIS's),
    which must be one of the tests' own (REDIS_DATABASES)."""
    if number not in REDIS_DATABASES:
        raise ValueError(f"Redis database {number} is not the tests' own")
    return urlsplit(REDIS)._replace(path=f"/{number}").geturl()


CACHE_URLS = {
    "memory": "memory://",
    "redis": REDIS,
    "memcached": os.environ.get("SHARDKIT_TEST_MEMCACHED", "memcached://127.0.0.1:11211"),
}
CELERY_BROKERS = {
    # Database 14 is the Celery tests' broker; every test has its own queue.
    "redis": os.environ.get("SHARDKIT_TEST_CELERY_REDIS", redis_database(14)),
    "rabbitmq": os.environ.get("SHARDKIT_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//"),
}
SESSION = uuid.uuid4().hex[:8]
PREFIX = f"sk{SESSION}_"
# A buffered counter's scheduled flush comes due when its interval ends, counted from the
# epoch: with the longest interval there is, one ends during a test of a minute about
# once in 43,000 runs of it (one of an hour would end in one run of 60).
NEVER = float(MAX_TTL)


class RefusingCache(MemoryCache):
    """The in-memory cache, refusing to increment the first ``refusals`` keys containing
    ``part`` it is asked to, as a cache may (memcached 1.6.18 now and then refuses a key
    holding a number)."""

    def __init__(self, part: str, refusals: int) -> None:
        super().__init__()
        self.part = part
        self.refusals = refusals
        self.refused: list[str] = []

    def incr(self, key: str, delta: int) -> int | None:
        if self.part in key and len(self.refused) < self.refusals:
            self.refused.append(key)
            raise BackendError(f"cache {self.url} failed while incrementing: non-numeric value")
        return super().incr(key, delta)


@functools.cache
def _unreachable(url: str) -> str | None:
    """Why the service at ``url`` cannot be used, or None when it can."""
    try:
        if url.startswith(("redis", "memcached")):
            cache = open_cache(url)
            cache.get("shardkit-test:ping")
            cache.close()
        else:
            engine = sa.create_engine(url)
            with engine.connect():
                pass
            engine.dispose()
    except Exception as exc:
        return f"{url} unreachable: {type(exc).__name__}: {exc}"
    return None


def run_together(count: int, work: Callable[[int], object]) -> None:
    """Run ``work(0)`` … ``work(count - 1)`` in threads released together by a barrier;
    re-raise the first error any of them raised."""
    start = threading.Barrier(count)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        start.wait()
        try:
            work(index)
        except BaseException as exc:
            errors.append(exc)
        finally:
            if "django.db" in sys.modules:  # the thread's Django connections, if it made any
                sys.modules["django.db"].connections.close_all()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


POLL_CAP = 0.05  # seconds: the longest pause between two polls of wait_for


def wait_for(
    condition: Callable[[], bool],
    what: str,
    timeout: float = 30.0,
    status: Callable[[], object] = lambda: "",
) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds, naming
    ``what`` it waited for and ``status()``. The pauses between polls grow from 5 ms to
    ``POLL_CAP``: a short wait ends within milliseconds, and a wait of seconds asks a
    few dozen times a second, not two hundred (a condition may read a database, scrape
    metrics or start a process)."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while not condition():
        if time.monotonic() > deadline:
            import pytest

            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} {status()}")
        time.sleep(pause)
        pause = min(pause * 1.5, POLL_CAP)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """The samples a Prometheus endpoint serves now, by name and labels (parsed by
    prometheus_client's own parser)."""
    with urllib.request.urlopen(url, timeout=60) as response:
        return parse_samples(response.read().decode())


def parse_samples(text: str) -> Samples:
    """The samples of a Prometheus exposition ``text``, by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 if absent: a labelled metric has no child until used)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


@contextlib.contextmanager
def numbered_table(engine: sa.Engine, what: str, rows: int) -> Iterator[sa.Table]:
    """A table of the session's own (``{PREFIX}{what}_…``) with an integer key ``id``
    holding 1 … ``rows``, dropped when the block exits."""
    metadata = sa.MetaData()
    table = sa.Table(
        f"{PREFIX}{what}_{uuid.uuid4().hex[:8]}",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    )
    metadata.create_all(engine)
    try:
        with engine.begin() as conn:
            conn.execute(table.insert(), [{"id": n} for n in range(1, rows + 1)])
        yield table
    finally:
        metadata.drop_all(engine)


def free_port() -> int:
    """A TCP port nobody listens on now (for a server a test starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _missing(reason: str | None) -> None:
    """Skip the calling test for ``reason`` (fail it under CI=true); None: nothing missing."""
    if reason is not None:
        import pytest

        if CI:
            pytest.fail(f"service required in CI: {reason}")
        pytest.skip(reason)


def require(url: str) -> None:
    """Skip (or fail, under CI=true) the calling test when ``url`` is unreachable."""
    _missing(_unreachable(url))


@functools.cache
def _broker_unreachable(url: str) -> str | None:
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:
        return f"broker unreachable: {type(exc).__name__}: {exc}"
    return None


def require_broker(url: str) -> None:
    """Skip (or fail, under CI=true) when the Celery broker at ``url`` is unreachable."""
    _missing(_unreachable(url) if url.startswith("redis") else _broker_unreachable(url))


def shard_values(kit: shardkit.Kit, table: str, name: str) -> dict[int, int]:
    """The rows of counter ``name`` in the SQL store's ``shards`` or ``maxima`` table,
    as {shard: value}."""
    store = kit.store
    assert isinstance(store, SqlStore)
    rows_of = {"shards": store.shards_table, "maxima": store.maxima_table}[table]
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(rows_of.c.shard, rows_of.c.value).where(rows_of.c.name == name)
        )
        return {int(shard): int(value) for shard, value in rows}


@dataclass(frozen=True)
class Target:
    """Where a test's counters live: what a subprocess needs to open the same kit."""

    store_url: str
    cache_url: str
    prefix: str = PREFIX

    def connect(self) -> shardkit.Kit:
        return shardkit.connect(self.store_url, self.cache_url, prefix=self.prefix)


_used_stores: set[str] = set()


def store_url_for(kind: str, sqlite_url: str) -> str:
    url = STORE_URLS[kind] or sqlite_url
    require(url)
    _used_stores.add(url)
    return url


# Beside CACHE_URLS: a Redis Cluster (3 primaries, 3 replicas) the session starts.
CLUSTER = "redis-cluster"


def cache_url_of(request: pytest.FixtureRequest, kind: str) -> str:
    if kind == CLUSTER:
        return str(request.getfixturevalue("redis_cluster").url)
    url = CACHE_URLS[kind]
    if url != "memory://":
        require(url)
    return url


def drop_tables(urls: Iterable[str], prefix: str) -> None:
    """Drop the tables kits made with ``prefix`` in the stores at ``urls`` (the
    counters' and the mapper's ledger)."""
    for url in urls:
        store = open_store(url, prefix=prefix)
        store.metadata.drop_all(store.engine)  # type: ignore[attr-defined]
        ledger_tables(prefix).metadata.drop_all(store.engine)  # type: ignore[attr-defined]
        store.close()


def documented_table(page: str, header: str) -> list[list[str]]:
    """The rows of the table of ``page`` (a path in the repository) whose header row
    starts with ``header``: each a list of its cells, stripped."""
    text = (ROOT / page).read_text(encoding="utf-8")
    lines = text[text.index(header) :].splitlines()[2:]
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in itertools.takewhile(lambda line: line.startswith("|"), lines)
    ]
