"""The SQL store of an async kit: ``SqlCore``'s rules on SQLAlchemy's asyncio engine.

The tables, statements and rules are the sync store's (``shardkit.store.sql``): sync and
async processes count into the same rows. Transactions run the same code as the sync
store's, on the async connection's sync facade (``AsyncConnection.run_sync``): each
statement awaits the driver (psycopg's async connection, aiosqlite, asyncmy) without
blocking the event loop.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from shardkit import _urls
from shardkit._program import Awaiting, playing
from shardkit.errors import ConfigurationError, MissingDriver
from shardkit.store.sql import (
    Sql,
    SqlCore,
    SqlRoles,
    committing,
    gate_forks,
    make_engine,
    watch_for_poolers,
)

_T = TypeVar("_T")

# The sync kit's drivers, which a store URL may name: the async kit takes its own.
_BLOCKING_DRIVERS = {"pymysql", "mysqldb", "pysqlite", "psycopg2"}
# URL scheme -> (the asyncio driver SQLAlchemy should use, the extra that installs it).
_DRIVERS = {
    "sqlite": ("sqlite+aiosqlite", "aio"),
    "postgresql": ("postgresql+psycopg", "postgres"),
    "postgres": ("postgresql+psycopg", "postgres"),
    "mysql": ("mysql+asyncmy", "mysql"),
    "mariadb": ("mariadb+asyncmy", "mysql"),
}


class AsyncSqlStore(SqlCore, Awaiting):
    """``Store``'s methods, awaited, on an ``AsyncEngine``.

    Belongs to the event loop it is used on. A transaction or a read is never interrupted
    midway: a cancelled caller stops waiting at once, and its statements finish on a
    task of their own (committed or rolled back, the connection back in the pool). An
    interrupted statement would leave its connection to be thrown away, and aiosqlite's,
    stopped rather than closed, keeps its open transaction — the database's lock — until
    garbage collection. The shard upsert, one autocommitted statement that leaves no
    transaction open, runs on its caller's task (the counters' writes come from a
    combiner's batch task, which no caller's cancellation reaches). Behind a pooler
    (PgBouncer in transaction mode), psycopg's automatic preparing is turned off, and on
    SQLite a fork waits for other threads to leave the database, as in the sync store.
    """

    def __init__(
        self, engine: AsyncEngine, *, prefix: str = "shardkit_", owns_engine: bool = False
    ) -> None:
        super().__init__(engine.dialect, engine.url, prefix=prefix)
        self.engine = engine
        self.roles = SqlRoles(playing(self, Sql))
        self._owns_engine = owns_engine
        self._finishing: set[asyncio.Task[Any]] = set()  # cancelled callers' calls
        watch_for_poolers(engine.sync_engine)
        gate_forks(engine.sync_engine)

    # -- the role Sql ------------------------------------------------------------------

    async def _whole(self, call: Coroutine[Any, Any, _T]) -> _T:
        """Await ``call`` on a task of its own, which a cancelled caller leaves to finish
        (its outcome then dropped: the caller knows it may or may not have applied)."""
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                self._finishing.add(task)
                task.add_done_callback(self._finished)
            raise

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._finishing.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: nobody waits for it

    async def transaction(self, action: str, work: Callable[[Connection], _T]) -> _T:
        """Run ``work`` (blocking SQLAlchemy code) in one transaction, again if the
        database chose it as a deadlock victim. Never interrupted midway (``_whole``). A
        failed COMMIT raises as ``committing`` the ``action``."""
        return await self._whole(self._transaction(action, work))

    async def _transaction(self, action: str, work: Callable[[Connection], _T]) -> _T:
        for attempt in itertools.count():
            doing = action
            try:
                async with self.engine.begin() as conn:
                    done = await conn.run_sync(work)
                    doing = committing(action)  # what fails from here is the COMMIT
                return done
            except SQLAlchemyError as exc:
                await asyncio.sleep(self._pause_before_retry(exc, doing, attempt))
        raise AssertionError("unreachable")

    async def read(
        self, action: str, statement: sa.Executable, *, autocommit: bool = False
    ) -> list[Any]:
        """Run a query and return its rows; with ``autocommit``, outside any transaction."""
        return await self._whole(self._read(action, statement, autocommit))

    async def _read(self, action: str, statement: sa.Executable, autocommit: bool) -> list[Any]:
        try:
            async with self.engine.connect() as conn:
                if autocommit:
                    await conn.execution_options(isolation_level="AUTOCOMMIT")
                return list(await conn.execute(statement))
        except SQLAlchemyError as exc:
            raise self._error(exc, action) from exc

    async def fast_add(self, params: Mapping[str, Any]) -> None:
        """Run the shard upsert, committed at once."""
        try:
            async with self.engine.connect() as conn:
                await conn.execution_options(isolation_level="AUTOCOMMIT")
                await conn.execute(self._upsert_add, params)
        except SQLAlchemyError as exc:
            raise self._error(exc, f"adding to counter {params['p_name']!r}") from exc

    async def has_schema(self) -> bool:
        """See ``Store.has_schema``."""
        try:
            async with self.engine.connect() as conn:
                return await conn.run_sync(self.schema_in)
        except SQLAlchemyError as exc:
            raise self._error(exc, "looking for the schema") from exc

    async def close(self) -> None:
        """Close the engine's connections, if the store made the engine, once the calls
        that cancelled callers left have finished."""
        if self._finishing:
            await asyncio.wait(self._finishing)
        if self._owns_engine:
            await self.engine.dispose()


def async_engine_from_url(url: str, *, pool_size: int | None = None) -> AsyncEngine:
    """An asyncio engine for a store URL (``engine_from_url``'s rules), choosing our async
    driver when the URL names none or a blocking one: psycopg (``shardkit[postgres]``),
    asyncmy (``shardkit[mysql]``, which leaves out PyMySQL's ``ssl_disabled``) or
    aiosqlite (``shardkit[aio]``)."""
    scheme, sep, rest = url.partition("://")
    base, _, driver = scheme.partition("+")
    if driver.lower() in _BLOCKING_DRIVERS:  # the sync kit's URL: take the async driver
        url = f"{base}{sep}{rest}"
    if base.lower() in ("mysql", "mariadb") and "ssl_disabled" in rest:
        # PyMySQL's option, which asyncmy lacks: it negotiates TLS only when given it.
        parsed = sa.make_url(url).difference_update_query(["ssl_disabled"])
        url = parsed.render_as_string(hide_password=False)
    if importlib.util.find_spec("greenlet") is None:  # SQLAlchemy's asyncio runs on it
        raise MissingDriver("the async kit needs: pip install 'shardkit[aio]'")
    try:
        engine: AsyncEngine = make_engine(url, create_async_engine, _DRIVERS, pool_size=pool_size)
    except sa.exc.InvalidRequestError as exc:  # a driver that is not an asyncio one
        raise ConfigurationError(f"no asyncio driver in {_urls.redact(url)!r}: {exc}") from None
    if engine.dialect.driver == "asyncmy":
        logging.getLogger("asyncmy").addFilter(_ignored_duplicates)
    return engine


def _ignored_duplicates(record: logging.LogRecord) -> bool:
    """asyncmy logs each warning of a statement; ``INSERT IGNORE``'s "Duplicate entry" is
    how the store learns that a key exists, not news."""
    return not str(record.msg).startswith("Duplicate entry")


__all__ = ["AsyncSqlStore", "async_engine_from_url"]
