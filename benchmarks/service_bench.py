"""The example FastAPI service as ``benchmarks/fastapi_app.py`` serves it: the service
itself, plus the endpoints it is measured against, on the same database and cache
through the same kinds of async clients: one row's plain ``UPDATE … SET n = n + 1``, the
hand-written forms of its two counters (an upsert of a random one of ``SHARDS`` rows,
autocommitted; a Redis ``INCR``), and a no-op.

``SHARDKIT_BENCH_DATABASE`` (a PostgreSQL URL) and ``SHARDKIT_BENCH_CACHE`` come from the
benchmark.
"""

from __future__ import annotations

import os
import random

import redis.asyncio
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from service import SHARDS, create_app

PREFIX = "bench_fastapi_"
ROW_TABLE = f"{PREFIX}row"
UPSERT_TABLE = f"{PREFIX}upsert"
INCR_KEY = f"{PREFIX}incr"

_database = os.environ["SHARDKIT_BENCH_DATABASE"].replace("postgresql://", "postgresql+psycopg://")
app = create_app(_database, os.environ["SHARDKIT_BENCH_CACHE"], prefix=PREFIX)
_engine = create_async_engine(_database, pool_size=10)
_autocommit = _engine.execution_options(isolation_level="AUTOCOMMIT")
_bump = sa.text(f"UPDATE {ROW_TABLE} SET n = n + 1 WHERE id = 1")
_upsert = sa.text(
    f"INSERT INTO {UPSERT_TABLE} (id, n) VALUES (:id, 1) "
    f"ON CONFLICT (id) DO UPDATE SET n = {UPSERT_TABLE}.n + 1"
)
_redis = redis.asyncio.Redis.from_url(os.environ["SHARDKIT_BENCH_CACHE"])


@app.post("/row")
async def row() -> dict[str, bool]:
    """One hot row, counted the plain way: an UPDATE in its own transaction."""
    async with _engine.begin() as conn:
        await conn.execute(_bump)
    return {"counted": True}


@app.post("/upsert")
async def upsert() -> dict[str, bool]:
    """The sharded counter written by hand: an upsert of a random one of its rows."""
    async with _autocommit.connect() as conn:
        await conn.execute(_upsert, {"id": random.randrange(SHARDS)})
    return {"counted": True}


@app.post("/incr")
async def incr() -> dict[str, bool]:
    """The buffered counter written by hand, without its flushes: Redis ``INCR``."""
    await _redis.incr(INCR_KEY)
    return {"counted": True}


@app.get("/noop")
async def noop() -> dict[str, bool]:
    """Nothing: the framework's (and this machine's) ceiling."""
    return {"counted": False}
