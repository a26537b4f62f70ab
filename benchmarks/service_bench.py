"""The example FastAPI service as ``benchmarks/fastapi_app.py`` serves it: the service
itself, plus the endpoint it is measured against (one row's plain ``UPDATE … SET n = n +
1``, on the same database, through the same kind of async engine) and a no-op.

``SHARDKIT_BENCH_DATABASE`` (a PostgreSQL URL) and ``SHARDKIT_BENCH_CACHE`` come from the
benchmark.
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from service import create_app

PREFIX = "bench_fastapi_"
ROW_TABLE = f"{PREFIX}row"

_database = os.environ["SHARDKIT_BENCH_DATABASE"].replace("postgresql://", "postgresql+psycopg://")
app = create_app(_database, os.environ["SHARDKIT_BENCH_CACHE"], prefix=PREFIX)
_engine = create_async_engine(_database, pool_size=10)
_bump = sa.text(f"UPDATE {ROW_TABLE} SET n = n + 1 WHERE id = 1")


@app.post("/row")
async def row() -> dict[str, bool]:
    """One hot row, counted the plain way: an UPDATE in its own transaction."""
    async with _engine.begin() as conn:
        await conn.execute(_bump)
    return {"counted": True}


@app.get("/noop")
async def noop() -> dict[str, bool]:
    """Nothing: the framework's (and this machine's) ceiling."""
    return {"counted": False}
