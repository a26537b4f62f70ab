"""The blocking SQL store (``SqlStore``): ``SqlCore``'s programs run on a SQLAlchemy
engine, and the hot path's upsert on held autocommit connections."""

from __future__ import annotations

import contextlib
import itertools
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import QueuePool

from shardkit._fork import reset_in_child
from shardkit._program import Blocking

from .core import SqlCore, SqlRoles, committing
from .dialect import Compiled
from .engines import gate_forks, watch_for_poolers

_T = TypeVar("_T")
_Run = Callable[[Mapping[str, Any]], object]  # the upsert's runner on one connection

# Connections of a forked parent: kept referenced in the child, never used, closed or
# returned to a pool, so the child sends nothing on a socket it shares with the parent.
_INHERITED: list[object] = []


class SqlStore(SqlCore, Blocking):
    """A durable store on any SQL database SQLAlchemy reaches through one of our drivers
    (its tables: see ``SqlCore``).

    Thread-safe; fork-safe (a child opens its own connections; on SQLite a fork waits
    for other threads to leave the database, ``gate_forks``). Writes without an
    idempotency key run on held autocommit connections (at most ``pool_size - 1`` held,
    so other users of the engine's pool are never starved).
    """

    def __init__(self, engine: Engine, *, prefix: str = "shardkit_", owns_engine: bool = False):
        super().__init__(engine.dialect, engine.url, prefix=prefix)
        self.engine = engine
        self.roles = SqlRoles(self)
        self._owns_engine = owns_engine
        self._fast_add = Compiled(self._upsert_add, engine.dialect)
        pool = engine.pool
        self._max_held = pool.size() - 1 if isinstance(pool, QueuePool) else 0
        self._gate = gate_forks(engine)
        # Held connections, each with its runner of the upsert.
        self._held: queue.SimpleQueue[tuple[Connection, _Run]] = queue.SimpleQueue()
        watch_for_poolers(engine)
        reset_in_child(self, SqlStore._after_fork)

    def _after_fork(self) -> None:
        _INHERITED.append(self._held)
        self._held = queue.SimpleQueue()
        self.engine.dispose(close=False)

    def has_schema(self) -> bool:
        """See ``Store.has_schema`` (``ConfigurationError`` for tables of a development
        version: ``check_current``)."""
        try:
            with self.engine.connect() as conn:
                return self.schema_in(conn)
        except SQLAlchemyError as exc:
            raise self._error(exc, "looking for the schema") from exc

    def add_many(
        self, name: str, shard: int, writes: Sequence[tuple[int, str | None]]
    ) -> list[bool]:
        """``SqlCore.add_many``: writes without keys are its one upsert, called here
        with no program run around it (the sharded counters' hot path)."""
        unkeyed = self._unkeyed(name, shard, writes)
        if unkeyed is None:
            return self._carry_out(self._add_keyed(name, shard, writes))
        self.fast_add(unkeyed)
        return [True] * len(writes)

    # -- the role Sql ------------------------------------------------------------------

    def transaction(self, action: str, work: Callable[[Connection], _T]) -> _T:
        """Run ``work`` in one transaction, again if the database chose it as a deadlock
        victim (its effects were rolled back whole, so running it again is safe). A
        failed COMMIT raises as ``committing`` the ``action``."""
        for attempt in itertools.count():
            doing = action
            try:
                with self.engine.begin() as conn:
                    done = work(conn)
                    doing = committing(action)  # what fails from here is the COMMIT
                return done
            except SQLAlchemyError as exc:
                time.sleep(self._pause_before_retry(exc, doing, attempt))
        raise AssertionError("unreachable")

    @property
    def autocommits_free(self) -> bool:
        """Whether a connection of the store's own is switched to autocommit for free (no
        round trip: not MySQL, where ``SET autocommit`` costs one each way; not a
        Django store, whose transactions are its caller's atomic blocks)."""
        return self.combinable and not self.dialect.is_mysql

    def standalone(self, action: str, work: Callable[[Connection], _T]) -> _T:
        """Run ``work``, which needs no transaction around its statements (one write),
        autocommitted where that is free (``autocommits_free``: no BEGIN, no COMMIT), in
        a ``transaction`` elsewhere."""
        if not self.autocommits_free:
            return self.transaction(action, work)
        try:
            with self.engine.connect() as conn:
                return work(conn.execution_options(isolation_level="AUTOCOMMIT"))
        except SQLAlchemyError as exc:
            raise self._error(exc, action) from exc

    def after_commit(self, action: Callable[[], object]) -> None:
        """Call ``action`` now: a transaction of the store's own has committed when it
        returns."""
        action()

    def read(self, action: str, statement: sa.Executable, *, autocommit: bool = False) -> list[Any]:
        """Run a query and return its rows; with ``autocommit``, outside any transaction
        (no BEGIN or ROLLBACK around it: it sees whatever was committed before it)."""
        try:
            with self.engine.connect() as conn:
                if autocommit:
                    conn.execution_options(isolation_level="AUTOCOMMIT")
                return list(conn.execute(statement))
        except SQLAlchemyError as exc:
            raise self._error(exc, action) from exc

    def fast_add(self, params: Mapping[str, Any]) -> None:
        """Run the precompiled upsert on a held autocommit connection: one round trip."""
        try:
            conn, run = self._held.get_nowait()
        except queue.Empty:
            conn = self._connect_autocommit()
            run = self._runner(conn)
        try:
            if self._gate is None:
                run(params)
            else:  # held between statements aside the gate: it gates this one
                self._gate.enter(conn)
                try:
                    run(params)
                finally:
                    self._gate.leave(conn)
        except Exception as exc:
            dialect = self.engine.dialect
            failed = isinstance(exc, dialect.loaded_dbapi.Error)
            dbapi_conn = conn.connection.dbapi_connection
            lost = failed and dialect.is_disconnect(cast(Any, exc), dbapi_conn, None)
            if lost:
                # What SQLAlchemy does when its own statements meet a disconnect: the
                # pool replaces, at checkout, every connection opened before now (all
                # dead, after a restart), so only this call fails, not one per connection.
                self.engine.pool._invalidate(conn.connection, exc, _checkin=False)
            conn.invalidate()
            conn.close()
            if failed:
                action = f"adding to counter {params['p_name']!r}"
                raise self._error(exc, action, lost=lost) from exc
            raise
        if self._held.qsize() < self._max_held:
            self._held.put((conn, run))
        else:
            conn.close()

    def _runner(self, conn: Connection) -> _Run:
        """The upsert's runner on ``conn`` (a prepared libpq call, or a cursor): built
        once per DB-API connection and kept in its ``info``, which SQLAlchemy clears when
        that connection is closed or invalidated; keyed by the statement, since several
        stores may share one engine."""
        info = conn.info
        run: _Run | None = info.get(self._fast_add)
        if run is None:
            run = info[self._fast_add] = self._fast_add.runner(conn.connection.dbapi_connection)
        return run

    def _connect_autocommit(self) -> Connection:
        """A connection to hold between statements (aside the fork gate, if any:
        ``fast_add`` gates each statement on it)."""
        try:
            with contextlib.nullcontext() if self._gate is None else self._gate.aside():
                conn = self.engine.connect()
                return conn.execution_options(isolation_level="AUTOCOMMIT")
        except SQLAlchemyError as exc:
            raise self._error(exc, "connecting") from exc

    # -- connections -------------------------------------------------------------------

    def _drop_held(self) -> None:
        """Invalidate and let go of the held connections (they died with the server)."""
        while True:
            try:
                conn, _ = self._held.get_nowait()
            except queue.Empty:
                return
            conn.invalidate()
            conn.close()

    def close(self) -> None:
        while True:
            try:
                self._held.get_nowait()[0].close()
            except queue.Empty:
                break
        if self._owns_engine:
            self.engine.dispose()


__all__ = ["SqlStore"]
