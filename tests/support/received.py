"""What the servers themselves received: rows a database wrote (counted by a trigger of
the test's own) and increment commands a cache ran (its own statistics). A test that
asserts on these fails when a write really reached the server twice, whatever the
client's code did to get there."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import redis
import sqlalchemy as sa
from pymemcache.client.base import Client as MemcacheClient

import shardkit
from shardkit.cache.cluster import RedisClusterCache
from shardkit.counters.generations import BASE
from shardkit.store.base import RETIRED


def _trigger_ddl(dialect: str, table: str, log: str, value: str) -> tuple[list[str], list[str]]:
    """The statements that make, and drop, row triggers logging the ``name`` of every row
    of ``table`` inserted or updated, and ``value`` (an integer expression of the row,
    ``NEW``), into ``log``."""
    create_log = f"CREATE TABLE {log} (name VARCHAR(255) NOT NULL, value BIGINT)"
    record = f"INSERT INTO {log} (name, value) VALUES (NEW.name, {value})"
    if dialect == "postgresql":
        return [
            create_log,
            f"CREATE FUNCTION {log}_f() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN {record}; RETURN NULL; END $$",
            f"CREATE TRIGGER {log}_t AFTER INSERT OR UPDATE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION {log}_f()",
        ], [f"DROP TRIGGER {log}_t ON {table}", f"DROP FUNCTION {log}_f()", f"DROP TABLE {log}"]
    body = record if dialect == "mysql" else f"BEGIN {record}; END"
    return [
        create_log,
        *(
            f"CREATE TRIGGER {log}_{event[0].lower()} AFTER {event} ON {table} FOR EACH ROW {body}"
            for event in ("INSERT", "UPDATE")
        ),
    ], [f"DROP TRIGGER {log}_i", f"DROP TRIGGER {log}_u", f"DROP TABLE {log}"]


@contextlib.contextmanager
def _logged(
    engine: sa.Engine, table: str, name: str, value: str
) -> Iterator[Callable[[], list[int | None]]]:
    """Within the block, a function listing ``value`` (see ``_trigger_ddl``) of every row
    of ``table`` whose ``name`` is ``name`` that the database inserted or updated since
    the block began, logged by the database (row triggers); a rolled-back statement's
    rows are not."""
    log = f"{table}_w{uuid.uuid4().hex[:8]}"
    create, drop = _trigger_ddl(engine.dialect.name, table, log, value)
    with engine.begin() as conn:
        for statement in create:
            conn.exec_driver_sql(statement)

    def values() -> list[int | None]:
        with engine.connect() as conn:
            query = sa.text(f"SELECT value FROM {log} WHERE name = :name")
            return list(conn.execute(query, {"name": name}).scalars())

    try:
        yield values
    finally:
        with engine.begin() as conn:
            for statement in drop:
                conn.exec_driver_sql(statement)


@contextlib.contextmanager
def row_writes(engine: sa.Engine, table: str, name: str) -> Iterator[Callable[[], int]]:
    """Within the block, a function counting the rows of ``table`` whose ``name`` is
    ``name`` that the database inserted or updated since the block began, counted by
    the database (row triggers). An upsert writes one row, so on a counter's shard
    table this is the number of upserts the server ran, combined or not; a rolled-back
    statement's rows do not count."""
    with _logged(engine, table, name, "NULL") as values:
        yield lambda: len(values())


@contextlib.contextmanager
def shard_counts(engine: sa.Engine, prefix: str, name: str) -> Iterator[Callable[[], list[int]]]:
    """Within the block, a function listing the shard counts the database wrote into the
    row of counter ``name`` (tables ``prefix``…) since the block began: the count it was
    created with, then one per growth (a growth to a count the row has already writes
    nothing), in order (a count only grows)."""
    with _logged(engine, f"{prefix}counters", name, "NEW.shards") as values:
        yield lambda: sorted(int(value) for value in values() if value is not None)


def _redis_increments(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("incrby", "incr"))


def increments_received(url: str) -> Callable[[], int] | None:
    """A function reading how many increment commands the cache server(s) at ``url``
    have run so far: ``INCR``/``INCRBY`` on Redis (summed over a cluster's primaries),
    ``incr`` on memcached. Server-wide: the server must be the test's own. None for
    ``memory://``, which has no server."""
    parts = urlsplit(url)
    if parts.scheme == "memory":
        return None
    if parts.scheme == "memcached":

        def memcached() -> int:
            client = MemcacheClient((parts.hostname or "", parts.port or 11211), timeout=5)
            try:
                stats = client.stats()
            finally:
                client.close()
            return int(stats[b"incr_hits"]) + int(stats[b"incr_misses"])

        return memcached
    if parts.scheme == "redis+cluster":
        nodes = [node.rsplit(":", 1) for node in parts.netloc.split(",")]

        def cluster() -> int:
            total = 0
            for host, port in nodes:
                with redis.Redis(host=host, port=int(port), socket_timeout=5) as client:
                    if client.info("replication")["role"] == "master":
                        total += _redis_increments(client)
            return total

        return cluster
    if parts.scheme == "redis":

        def single() -> int:
            with redis.Redis.from_url(url, socket_timeout=5) as client:
                return _redis_increments(client)

        return single
    raise ValueError(f"no server to ask at {url}")


def pending_on(kit: shardkit.Kit, counter: shardkit.BufferedCounter, primary: str) -> int:
    """What ``counter``'s generations whose keys live on ``primary`` hold beyond what
    the store applied."""
    assert isinstance(kit.cache, RedisClusterCache)
    pending = 0
    for generation, applied in kit.store.generations([counter.name])[counter.name].items():
        keys = counter._keys(generation)
        if generation != RETIRED and kit.cache.owner(keys[0]) == primary:
            up, down = (kit.cache.get_many(keys).get(key, BASE) - BASE for key in keys)
            pending += (up - applied.up) - (down - applied.down)
    return pending
