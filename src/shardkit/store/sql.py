"""The SQL store: SQLite, PostgreSQL and MySQL/MariaDB through SQLAlchemy Core.

Each shard write is one atomic upsert (``INSERT … ON CONFLICT … DO UPDATE SET value =
value + excluded.value``, or ``ON DUPLICATE KEY UPDATE`` on MySQL), never a read followed
by a write. The statement is built and compiled once by SQLAlchemy per dialect; the hot
path then runs it on a held autocommit connection, so a write costs one round trip and
almost no client CPU. Dialect differences live in ``_Dialect`` and nowhere else.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import queue
import random
import re
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.pool import QueuePool

from shardkit import _urls
from shardkit._fork import ForkGate, reset_in_child
from shardkit._program import Program, blocking, call, run
from shardkit.errors import (
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    CounterKindMismatch,
    CounterOverflow,
    InvalidDelta,
    MissingDriver,
    ShardkitError,
    StoreNotFound,
)
from shardkit.store.base import RETIRED, CounterInfo, Flushed
from shardkit.validation import MAX_NAME_LENGTH, sums_fit

_T = TypeVar("_T")
_Merge = Callable[[Any, Any], Any]  # (existing column, incoming value) -> new value
_DEADLOCK_RETRIES = 5
# Key of a pooled connection's ``info``: whether it goes through a pooler.
_POOLED = "shardkit.pooled"

# URL scheme -> (the driver SQLAlchemy should use, the extra that installs it).
_DRIVERS = {
    "sqlite": ("sqlite", None),
    "postgresql": ("postgresql+psycopg", "postgres"),
    "postgres": ("postgresql+psycopg", "postgres"),
    "mysql": ("mysql+pymysql", "mysql"),
    "mariadb": ("mariadb+pymysql", "mysql"),
}

# Connections of a forked parent: kept referenced in the child, never used, closed or
# returned to a pool, so the child sends nothing on a socket it shares with the parent.
_INHERITED: list[object] = []
# The fork gate of each SQLite engine (``gate_forks``).
_GATES: weakref.WeakKeyDictionary[Engine, ForkGate] = weakref.WeakKeyDictionary()
_GATING = threading.Lock()


class _Text(sa.types.TypeDecorator[str]):
    """Names and keys: compared byte for byte on every database.

    MySQL's string collations ignore case and trailing spaces, so two different counter
    names could meet on one row; there the column is VARBINARY holding UTF-8.
    """

    impl = sa.String(MAX_NAME_LENGTH)
    cache_ok = True

    def load_dialect_impl(self, dialect: sa.Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.VARBINARY(4 * MAX_NAME_LENGTH))
        return dialect.type_descriptor(sa.String(MAX_NAME_LENGTH))

    def process_bind_param(self, value: Any, dialect: sa.Dialect) -> Any:
        if isinstance(value, str) and dialect.name in ("mysql", "mariadb"):
            return value.encode()
        return value

    def process_result_value(self, value: Any, dialect: sa.Dialect) -> str | None:
        return value.decode() if isinstance(value, bytes) else value


class _Dialect:
    """The statements whose SQL differs between databases, built once per store."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.is_mysql = name in ("mysql", "mariadb")

    def is_deadlock(self, exc: DBAPIError) -> bool:
        """Whether the database rolled the transaction back to break a deadlock."""
        if self.is_mysql:
            return getattr(exc.orig, "args", (None,))[:1] == (1213,)
        return getattr(exc.orig, "sqlstate", None) == "40P01"

    def is_out_of_range(self, exc: Exception) -> bool:
        """Whether the database refused a statement for taking a value outside its column
        (signed 64-bit): the statement changed nothing. ``exc`` is the driver's error,
        or wraps it (SQLAlchemy's ``orig``, Django's ``__cause__``)."""
        orig = getattr(exc, "orig", None) or exc.__cause__ or exc
        if self.is_mysql:
            return getattr(orig, "args", (None,))[:1] in ((1264,), (1690,))
        if self.name == "postgresql":
            return getattr(orig, "sqlstate", None) == "22003"
        # SQLite turns an overflowing sum into a float, which the integer check refuses.
        return "typeof(value) = 'integer'" in str(orig) or "integer overflow" in str(orig)

    def exact_sum(self, value: Any) -> tuple[Any, Any, int]:
        """Aggregates ``high`` and ``low`` and a scale such that the sum of ``value`` (a
        64-bit expression) is ``high * scale + low``, exact even past 64 bits: SQLite's
        ``sum`` fails there, so it sums the high and low 32 bits apart."""
        if self.name == "sqlite":
            return sa.func.sum(value.op(">>")(32)), sa.func.sum(value.op("&")(2**32 - 1)), 2**32
        return sa.func.sum(value), sa.literal(0), 1

    def insert_ignore(self, conn: Connection, table: sa.Table, row: Mapping[str, Any]) -> bool:
        """INSERT ``row`` unless its primary key exists; return whether it was inserted.

        Racing inserts of one key wait for each other, so exactly one returns True.
        """
        if self.is_mysql:
            return conn.execute(self._insert_ignore(table), row).rowcount == 1
        statement = self._insert_ignore(table).returning(sa.literal(1))
        return conn.execute(statement, row).first() is not None

    def insert_ignore_many(
        self, conn: Connection, table: sa.Table, rows: Sequence[Mapping[str, Any]]
    ) -> None:
        """INSERT each of ``rows`` whose primary key does not exist, in one call (one
        round trip where the driver batches them)."""
        conn.execute(self._insert_ignore(table), list(rows))

    def _insert_ignore(self, table: sa.Table) -> sa.Insert:
        if self.is_mysql:
            return mysql.insert(table).prefix_with("IGNORE")
        if self.name == "postgresql":
            return postgresql.insert(table).on_conflict_do_nothing()
        return sqlite.insert(table).on_conflict_do_nothing()

    def upsert(self, table: sa.Table, merge: dict[str, _Merge]) -> sa.Insert:
        """INSERT a row, or set each ``merge`` column of the existing row to
        ``merge[column](existing, incoming)``, in one statement. Every column's value is
        the bind parameter ``p_<column>``."""
        values: dict[str, Any] = {c.name: sa.bindparam(f"p_{c.name}") for c in table.columns}
        rules = merge.items()
        upsert: sa.Insert
        if self.is_mysql:
            my = mysql.insert(table).values(values)
            upsert = my.on_duplicate_key_update(
                {name: rule(table.c[name], my.inserted[name]) for name, rule in rules}
            )
        else:
            module = postgresql if self.name == "postgresql" else sqlite
            ins = module.insert(table).values(values)
            upsert = ins.on_conflict_do_update(
                index_elements=list(table.primary_key.columns),
                set_={
                    name: rule(table.c[name], ins.excluded[name]) for name, rule in merge.items()
                },
            )
        return upsert


def _add(existing: Any, incoming: Any) -> Any:
    return existing + incoming


def _greatest(existing: Any, incoming: Any) -> Any:
    # CASE, not GREATEST: SQLite has no GREATEST (its two-argument max() is not portable).
    return sa.case((incoming > existing, incoming), else_=existing)


class _Compiled:
    """A statement compiled once, run on a raw DB-API connection with minimal overhead."""

    def __init__(self, statement: sa.Insert, dialect: sa.Dialect) -> None:
        compiled = statement.compile(dialect=dialect)
        self.sql = compiled.string
        self.order = compiled.positiontup if compiled.positional else None
        self._libpq = dialect.driver == "psycopg" and self.order is None

    def params(self, values: Mapping[str, Any]) -> Any:
        if self.order is None:
            return values
        return tuple(values[key] for key in self.order)

    def runner(self, dbapi_connection: Any) -> Callable[[Mapping[str, Any]], object]:
        """A function that runs the statement on ``dbapi_connection``, to keep with it."""
        if self._libpq:
            return self._libpq_runner(dbapi_connection)
        cursor = dbapi_connection.cursor()
        sql, params = self.sql, self.params
        return lambda values: cursor.execute(sql, params(values))

    def _libpq_runner(self, conn: Any) -> Callable[[Mapping[str, Any]], object]:
        """psycopg: call libpq directly, skipping the cursor machinery (a third of the
        client's CPU per write). On a direct connection the statement runs prepared, under
        a name derived from its text; through a transaction pooler (``prepare_threshold``
        None, see ``_detect_pooler``) it is sent whole each time, as an unnamed statement."""
        from psycopg import errors, pq

        encoding: str = conn.info.encoding
        names: list[str] = []

        def placeholder(match: re.Match[str]) -> str:
            if match.group(1) is None:
                return "%"
            names.append(match.group(1))
            return f"${len(names)}"

        sql = re.sub(r"%\((\w+)\)s|%%", placeholder, self.sql).encode(encoding)
        pgconn = conn.pgconn
        done = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)

        def check(result: Any) -> None:
            if result.status not in done:
                raise errors.error_from_result(result, encoding=encoding)

        def text(values: Mapping[str, Any]) -> list[bytes]:
            return [
                value.encode(encoding) if isinstance(value, str) else b"%d" % value
                for value in (values[name] for name in names)
            ]

        if conn.prepare_threshold is None:
            return lambda values: check(pgconn.exec_params(sql, text(values)))
        # Prepared when the session turns out not to have it: on first use, and after a
        # DEALLOCATE ALL, which psycopg runs when it rolls back a transaction after
        # preparing statements of its own. The failed call ran nothing: it is repeated.
        # (Named by the text, so another store's statement never takes the name.)
        name = b"shardkit_" + hashlib.sha1(sql).hexdigest()[:16].encode()
        sqlstate = pq.DiagnosticField.SQLSTATE
        missing = b"26000"  # invalid_sql_statement_name

        def run(values: Mapping[str, Any]) -> None:
            params = text(values)
            result = pgconn.exec_prepared(name, params)
            if result.error_field(sqlstate) == missing:
                check(pgconn.prepare(name, sql))
                result = pgconn.exec_prepared(name, params)
            check(result)

        return run


def watch_for_poolers(engine: Engine) -> None:
    """Have every connection of a psycopg ``engine`` (or of an asyncio engine's
    ``sync_engine``) checked once for a pooler in front of the server
    (``_detect_pooler``). Idempotent; other drivers are left alone."""
    if engine.dialect.driver in ("psycopg", "psycopg_async") and not sa.event.contains(
        engine, "checkout", _detect_pooler
    ):
        sa.event.listen(engine, "checkout", _detect_pooler)


def gate_forks(engine: Engine) -> ForkGate | None:
    """Have a fork of the process wait while another thread has one of a SQLite
    ``engine``'s connections checked out (a child forked mid-use inherits SQLite's locks
    held); return that ``ForkGate``. Idempotent; None (nothing done) for other
    databases."""
    if engine.dialect.name != "sqlite":
        return None
    with _GATING:
        gate = _GATES.get(engine)
        if gate is None:
            gate = _GATES[engine] = ForkGate(f"the SQLite database {engine.url.database!r}")
            sa.event.listen(engine, "checkout", lambda _, record, __: gate.enter(record))
            sa.event.listen(engine, "checkin", lambda _, record: gate.leave(record))
    return gate


def _detect_pooler(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """Pool checkout hook of psycopg engines: once per connection, ``unprepare_behind_pooler``
    (for an asyncio engine's, ``_unprepare_async``). A connection that cannot answer is
    replaced by the pool. (Connections that are not psycopg's own, such as Django's
    behind its stand-in, are left alone.)"""
    from psycopg import AsyncConnection, Connection

    if _POOLED in record.info:
        return
    try:
        if isinstance(dbapi_connection, Connection):
            record.info[_POOLED] = unprepare_behind_pooler(dbapi_connection)
        elif isinstance(record.driver_connection, AsyncConnection):
            record.info[_POOLED] = _unprepare_async(dbapi_connection, record.driver_connection)
    except ConnectionError as exc:
        raise sa.exc.DisconnectionError(str(exc)) from exc


def _unprepare_async(adapted: Any, connection: Any) -> bool:
    """``unprepare_behind_pooler`` for psycopg's ``AsyncConnection`` behind SQLAlchemy's
    adapter ``adapted``, whose calls await the connection from the checkout's greenlet
    (so the event loop is never blocked): the same question, in a transaction rolled
    back at once."""
    try:
        cursor = adapted.cursor()
        try:
            cursor.execute("SELECT pg_backend_pid()")
            (pid,) = cursor.fetchone()
        finally:
            cursor.close()
            adapted.rollback()
    except Exception as exc:
        raise ConnectionError(f"the connection did not answer: {exc}") from exc
    pooled: bool = int(pid) != connection.info.backend_pid
    if pooled:
        connection.prepare_threshold = None
    return pooled


def unprepare_behind_pooler(connection: Any) -> bool:
    """Whether the psycopg ``connection`` goes through a pooler (PgBouncer in transaction
    mode, …), which may run each transaction on another server session, where a
    statement prepared in an earlier one is missing or present already; if so, turn
    psycopg's automatic preparing off. A pooler answers the connection with a backend
    process id of its own making, a direct connection with the server's. One round trip,
    outside any transaction; raises ``ConnectionError`` if the connection cannot answer."""
    from psycopg import pq

    result = connection.pgconn.exec_(b"SELECT pg_backend_pid()")
    if result.status != pq.ExecStatus.TUPLES_OK:
        raise ConnectionError("the connection did not answer")
    pooled: bool = int(result.get_value(0, 0) or 0) != connection.info.backend_pid
    if pooled:
        connection.prepare_threshold = None
    return pooled


class Sql(Protocol):
    """The role of a SQL store's driver in the store's programs: how a statement is run,
    blocking (``SqlStore``) or on an event loop (``shardkit.aio``'s store)."""

    def read(self, action: str, statement: sa.Executable, *, autocommit: bool = False) -> list[Any]:
        """Run a query and return its rows; with ``autocommit``, outside any transaction
        (no BEGIN or ROLLBACK around it: it sees whatever was committed before it)."""
        ...

    def transaction(self, action: str, work: Callable[[Connection], _T]) -> _T:
        """Run ``work`` in one transaction, again if the database chose it as a deadlock
        victim (its effects were rolled back whole, so running it again is safe)."""
        ...

    def fast_add(self, params: Mapping[str, Any]) -> None:
        """Run the shard upsert with ``params`` in one round trip, committed at once."""
        ...


class SqlCore:
    """What the sync and async SQL stores share: the tables, the statements and the rules
    (``Store``'s methods, as programs run on the role ``Sql``).

    Tables are named ``{prefix}counters``, ``{prefix}shards``, ``{prefix}keys``,
    ``{prefix}flushed`` (what each cache generation of a buffered counter has flushed),
    ``{prefix}maxima`` (the highest values persisted by monotonic counters),
    ``{prefix}identity`` (the store's identity, one row), and the
    mapper's ledger, ``{prefix}jobs`` and ``{prefix}ranges``.
    """

    combinable = True  # its writes run on connections of its own

    def __init__(self, dialect: sa.Dialect, url: sa.URL, *, prefix: str) -> None:
        self.url = url.render_as_string(hide_password=True)
        self._password = url.password
        self._database = url.database
        if dialect.name not in ("sqlite", "postgresql", "mysql", "mariadb"):
            raise ConfigurationError(f"unsupported SQL database {dialect.name!r}")
        self.dialect = _Dialect(dialect.name)
        metadata = sa.MetaData()
        self.counters_table = sa.Table(
            f"{prefix}counters",
            metadata,
            sa.Column("name", _Text(), primary_key=True),
            sa.Column("kind", sa.String(16), nullable=False),
            sa.Column("shards", sa.Integer, nullable=False),
        )
        self.shards_table = sa.Table(
            f"{prefix}shards",
            metadata,
            sa.Column("name", _Text(), primary_key=True),
            sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("value", sa.BigInteger, nullable=False),
            # SQLite turns an integer sum past 64 bits into a REAL: refuse it instead, so
            # an overflowing write fails and changes nothing, as on the other databases.
            sa.CheckConstraint("typeof(value) = 'integer'").ddl_if(dialect="sqlite"),
        )
        self.keys_table = sa.Table(
            f"{prefix}keys",
            metadata,
            sa.Column("name", _Text(), primary_key=True),
            sa.Column("key", _Text(), primary_key=True),
            sa.Column("created_at", sa.Double, nullable=False, index=True),
        )
        self.flushed_table = sa.Table(
            f"{prefix}flushed",
            metadata,
            sa.Column("name", _Text(), primary_key=True),
            sa.Column("generation", sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("up", sa.BigInteger, nullable=False),
            sa.Column("down", sa.BigInteger, nullable=False),
            sa.Column("created_at", sa.Double, nullable=False),
        )
        self.identity_table = sa.Table(
            f"{prefix}identity",
            metadata,
            sa.Column("one", sa.Integer, primary_key=True, autoincrement=False),  # always 1
            sa.Column("identity", sa.String(32), nullable=False),
        )
        self.maxima_table = sa.Table(
            f"{prefix}maxima",
            metadata,
            sa.Column("name", _Text(), primary_key=True),
            sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("value", sa.BigInteger, nullable=False),
        )
        # The mapper's ledger (shardkit.mapper.ledger): its jobs and their key ranges.
        self.jobs_table = sa.Table(
            f"{prefix}jobs",
            metadata,
            sa.Column("id", sa.String(64), primary_key=True),
            sa.Column("state", sa.String(12), nullable=False),
            sa.Column("spec", sa.Text, nullable=False),
            sa.Column("estimate", sa.BigInteger),
            sa.Column("error", sa.Text),
            sa.Column("created_at", sa.Double, nullable=False),
            sa.Column("finished_at", sa.Double),
        )
        self.ranges_table = sa.Table(
            f"{prefix}ranges",
            metadata,
            sa.Column("job", sa.String(64), primary_key=True),
            sa.Column("id", sa.String(32), primary_key=True),
            sa.Column("parent", sa.String(32)),
            sa.Column("lo", sa.Text),
            sa.Column("hi", sa.Text),
            sa.Column("after", sa.Text),
            sa.Column("state", sa.String(8), nullable=False),
            sa.Column("depth", sa.Integer, nullable=False),
            sa.Column("rows", sa.BigInteger, nullable=False),
            sa.Column("planned", sa.BigInteger),  # rows its parent planned in it
            sa.Column("pages", sa.Integer, nullable=False),
            sa.Column("failures", sa.Integer, nullable=False),
            sa.Column("tries", sa.Integer),  # failed attempts since its last page
            sa.Column("error", sa.Text),
            sa.Column("created_at", sa.Double, nullable=False),
            sa.Column("done_at", sa.Double),
            sa.Index(f"{prefix}ranges_state", "job", "state"),
            sa.Index(f"{prefix}ranges_parent", "job", "parent"),
        )
        self.metadata = metadata
        self._upsert_add = self.dialect.upsert(self.shards_table, {"value": _add})
        self._fold = self.dialect.upsert(self.flushed_table, {"up": _add, "down": _add})
        self._raise_max = self.dialect.upsert(self.maxima_table, {"value": _greatest})
        self._identity: str | None = None
        self.roles: Mapping[str, Any] = {"Sql": self}

    # -- errors ------------------------------------------------------------------------

    def _error(self, exc: Exception, action: str, *, lost: bool = False) -> ShardkitError:
        """The ``BackendError`` for a failure of the store; ``BackendUnavailable`` when the
        connection was ``lost`` (or SQLAlchemy found it so) or could not be made, and
        ``CounterOverflow`` when the database refused a value outside signed 64-bit (so
        nothing was written). A lost connection means the server went away: the held
        connections are dropped too."""
        text = _urls.scrub(str(getattr(exc, "orig", None) or exc), self._password)
        detail = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        if self.dialect.is_out_of_range(exc):
            return CounterOverflow(
                f"store {self.url} refused, while {action}, a value outside signed 64-bit; "
                "nothing was written"
            )
        if lost or (isinstance(exc, DBAPIError) and exc.connection_invalidated):
            self._drop_held()
            return BackendUnavailable(f"lost the store at {self.url} while {action}: {detail}")
        if isinstance(exc, sa.exc.OperationalError) and "connect" in detail.lower():
            return BackendUnavailable(f"cannot reach the store at {self.url}: {detail}")
        return BackendError(f"store {self.url} failed while {action}: {detail}")

    def _pause_before_retry(self, exc: SQLAlchemyError, action: str, attempt: int) -> float:
        """How long to wait before running a transaction again, after its ``attempt``
        (from 0) failed with ``exc``: only a deadlock victim is run again, a few times
        (its effects were rolled back whole); any other failure raises its
        ``ShardkitError``."""
        if (
            isinstance(exc, DBAPIError)
            and self.dialect.is_deadlock(exc)
            and attempt < _DEADLOCK_RETRIES
        ):
            return random.uniform(0, 0.01 * 2**attempt)  # let the winner finish
        raise self._error(exc, action) from exc

    def _drop_held(self) -> None:
        """Let go of connections held for fast writes (they died with the server)."""

    # -- schema ------------------------------------------------------------------------

    def _create_schema(self) -> Program[None]:
        """Create the tables if missing. Concurrent callers may race: a loser's "already
        exists" error is absorbed by another, checking, attempt. Each failed attempt
        means a racer created a table meanwhile, so one attempt per table (and one more)
        is enough however the racers interleave."""
        if self.dialect.name == "sqlite" and self._database:
            yield from call(
                Sql.transaction,
                "creating the schema",
                lambda conn: conn.exec_driver_sql("PRAGMA journal_mode=WAL"),
            )
        attempts = len(self.metadata.tables) + 1
        racing = (sa.exc.ProgrammingError, sa.exc.IntegrityError, sa.exc.OperationalError)
        for attempt in range(attempts):
            try:
                yield from call(Sql.transaction, "creating the schema", self._create_tables)
                return
            except BackendError as exc:
                if attempt == attempts - 1 or not isinstance(exc.__cause__, racing):
                    raise

    def _create_tables(self, conn: Connection) -> None:
        self.metadata.create_all(conn, checkfirst=True)
        self.add_missing_columns(conn)

    def add_missing_columns(self, conn: Connection) -> None:
        """Add to tables made by an earlier version the nullable columns they lack (a
        range's ``planned`` rows, its ``tries``). Idempotent; a concurrent caller's
        addition makes this one fail, and a second look finds the column there."""
        table = self.ranges_table
        have = {column["name"] for column in sa.inspect(conn).get_columns(table.name)}
        name = conn.dialect.identifier_preparer.format_table(table)
        for column in table.columns:
            if column.name not in have and column.nullable:
                definition = sa.schema.CreateColumn(column).compile(dialect=conn.dialect)
                conn.exec_driver_sql(f"ALTER TABLE {name} ADD COLUMN {definition}")

    def _identity_of_store(self) -> Program[str]:
        """See ``Store.identity``."""
        if self._identity is None:
            table = self.identity_table
            found = yield from call(
                Sql.read, "reading the store's identity", sa.select(table.c.identity)
            )
            if not found:  # a new store: the first to record its identity wins

                def work(conn: Connection) -> Any:
                    made = {"one": 1, "identity": uuid.uuid4().hex}
                    self.dialect.insert_ignore(conn, table, made)
                    return conn.execute(sa.select(table.c.identity)).all()

                found = yield from call(Sql.transaction, "recording the store's identity", work)
            self._identity = str(found[0].identity)
        return self._identity

    # -- counters ----------------------------------------------------------------------

    def _open_counter(
        self, name: str, kind: str, shards: int, *, grow: bool = True
    ) -> Program[CounterInfo]:
        """See ``Store.open_counter``."""
        table = self.counters_table

        def work(conn: Connection) -> Any:
            # Growing first takes the row's write lock at once; inserting first would take
            # a shared lock on an existing row and then need to upgrade it, which deadlocks
            # against a concurrent opener doing the same on MySQL.
            if grow:
                conn.execute(
                    sa.update(table)
                    .where(table.c.name == name, table.c.kind == kind, table.c.shards < shards)
                    .values(shards=shards)
                )
            self.dialect.insert_ignore(conn, table, {"name": name, "kind": kind, "shards": shards})
            return conn.execute(
                sa.select(table.c.kind, table.c.shards).where(table.c.name == name)
            ).one()

        found = yield from call(Sql.transaction, f"opening counter {name!r}", work)
        if found.kind != kind:
            raise CounterKindMismatch(f"{name!r} is a {found.kind} counter, not a {kind} counter")
        return CounterInfo(name, kind, int(found.shards))

    def _counter(self, name: str) -> Program[CounterInfo | None]:
        """See ``Store.counter``."""
        table = self.counters_table
        rows = yield from call(
            Sql.read,
            f"reading counter {name!r}",
            sa.select(table.c.name, table.c.kind, table.c.shards).where(table.c.name == name),
        )
        return CounterInfo(rows[0].name, rows[0].kind, int(rows[0].shards)) if rows else None

    def _counters(self) -> Program[list[CounterInfo]]:
        """See ``Store.counters``."""
        table = self.counters_table
        rows = yield from call(
            Sql.read,
            "listing counters",
            sa.select(table.c.name, table.c.kind, table.c.shards).order_by(table.c.name),
        )
        return [CounterInfo(row.name, row.kind, int(row.shards)) for row in rows]

    # -- writes ------------------------------------------------------------------------

    def _add(self, name: str, shard: int, delta: int, key: str | None = None) -> Program[bool]:
        """See ``Store.add``."""
        applied = yield from self._add_many(name, shard, [(delta, key)])
        return applied[0]

    def _add_many(
        self, name: str, shard: int, writes: Sequence[tuple[int, str | None]]
    ) -> Program[list[bool]]:
        """See ``Store.add_many``."""
        unkeyed = self._unkeyed(name, shard, writes)
        if unkeyed is not None:
            yield from call(Sql.fast_add, unkeyed)
            return [True] * len(writes)
        keyed = [key for _, key in writes if key is not None]

        def work(conn: Connection) -> list[bool]:
            created_at = time.time()
            new = {
                key
                for key in dict.fromkeys(keyed)
                if self.dialect.insert_ignore(
                    conn, self.keys_table, {"name": name, "key": key, "created_at": created_at}
                )
            }
            applied = []
            for _, key in writes:
                applied.append(key is None or key in new)
                new.discard(key)  # a key repeated in ``writes`` applies once, first
            deltas = [delta for (delta, _), ok in zip(writes, applied, strict=True) if ok]
            if deltas:
                conn.execute(self._upsert_add, self._add_params(name, shard, deltas))
            return applied

        return (yield from call(Sql.transaction, f"adding to counter {name!r}", work))

    @staticmethod
    def _add_params(name: str, shard: int, deltas: Sequence[int]) -> dict[str, Any]:
        return {"p_name": name, "p_shard": shard, "p_value": sum(deltas)}

    def _unkeyed(
        self, name: str, shard: int, writes: Sequence[tuple[int, str | None]]
    ) -> dict[str, Any] | None:
        """The parameters of the one upsert that makes ``writes`` when none has a key
        (None when one has). ``InvalidDelta`` if their sum could leave signed 64-bit."""
        deltas = [delta for delta, _ in writes]
        if not sums_fit(deltas):
            raise InvalidDelta(f"{len(writes)} deltas could sum outside signed 64-bit")
        if any(key is not None for _, key in writes):
            return None
        return self._add_params(name, shard, deltas)

    # -- reads -------------------------------------------------------------------------

    def _total(self, name: str) -> Program[int]:
        """See ``Store.total``."""
        return (yield from self._totals([name]))[name]

    def _totals(self, names: Iterable[str]) -> Program[dict[str, int]]:
        """See ``Store.totals``."""
        wanted = list(dict.fromkeys(names))
        result = dict.fromkeys(wanted, 0)
        if not wanted:
            return result
        shards, flushed = self.shards_table, self.flushed_table
        high, low, scale = self.dialect.exact_sum(shards.c.value)
        net_high, net_low, _ = self.dialect.exact_sum(flushed.c.up - flushed.c.down)
        rows = yield from call(
            Sql.read,
            "reading counter values",
            sa.union_all(
                sa.select(shards.c.name, high, low)
                .where(shards.c.name.in_(wanted))
                .group_by(shards.c.name),
                sa.select(flushed.c.name, net_high, net_low)
                .where(flushed.c.name.in_(wanted))
                .group_by(flushed.c.name),
            ),
        )
        for name, high_sum, low_sum in rows:
            result[name] += int(high_sum) * scale + int(low_sum)
        return result

    # -- buffered counters' generations ------------------------------------------------

    def _add_generation(self, name: str, generation: int) -> Program[None]:
        """See ``Store.add_generation``."""
        row = {"name": name, "generation": generation, "up": 0, "down": 0}
        yield from call(
            Sql.transaction,
            f"recording a generation of counter {name!r}",
            lambda conn: self.dialect.insert_ignore(
                conn, self.flushed_table, {**row, "created_at": time.time()}
            ),
        )

    def _generations(self, names: Iterable[str]) -> Program[dict[str, dict[int, Flushed]]]:
        """See ``Store.generations``."""
        wanted = list(dict.fromkeys(names))
        if not wanted:
            return {}
        table = self.flushed_table
        rows = yield from call(
            Sql.read,
            "reading flushed generations",
            sa.select(table.c.name, table.c.generation, table.c.up, table.c.down).where(
                table.c.name.in_(wanted)
            ),
        )
        result: dict[str, dict[int, Flushed]] = {}
        for row in rows:
            result.setdefault(row.name, {})[int(row.generation)] = Flushed(
                int(row.up), int(row.down)
            )
        return result

    def _recorded_at(self, name: str, generations: Iterable[int]) -> Program[dict[int, float]]:
        """See ``Store.recorded_at``."""
        table = self.flushed_table
        statement = sa.select(table.c.generation, table.c.created_at).where(
            table.c.name == name, table.c.generation.in_(list(generations))
        )
        rows = yield from call(Sql.read, f"reading the generations of counter {name!r}", statement)
        return {int(row.generation): float(row.created_at) for row in rows}

    def _advance(self, name: str, generation: int, seen: Flushed, to: Flushed) -> Program[bool]:
        """See ``Store.advance``."""
        table = self.flushed_table
        statement = (
            sa.update(table)
            .where(
                table.c.name == name,
                table.c.generation == generation,
                table.c.up == seen.up,
                table.c.down == seen.down,
            )
            .values(up=to.up, down=to.down)
        )

        def work(conn: Connection) -> bool:
            return bool(conn.execute(statement).rowcount == 1)

        return (yield from call(Sql.transaction, f"flushing counter {name!r}", work))

    def _retire(self, name: str, generation: int, applied: Flushed) -> Program[bool]:
        """See ``Store.retire``."""
        table = self.flushed_table
        statement = sa.delete(table).where(
            table.c.name == name,
            table.c.generation == generation,
            table.c.up == applied.up,
            table.c.down == applied.down,
        )
        folded = {
            "p_name": name,
            "p_generation": RETIRED,
            "p_up": applied.up,
            "p_down": applied.down,
            "p_created_at": time.time(),
        }

        def work(conn: Connection) -> bool:
            if conn.execute(statement).rowcount != 1:
                return False
            conn.execute(self._fold, folded)
            return True

        return (
            yield from call(Sql.transaction, f"retiring a generation of counter {name!r}", work)
        )

    # -- monotonic counters' maxima ----------------------------------------------------

    def _raise_max_of(self, name: str, shard: int, value: int) -> Program[None]:
        """See ``Store.raise_max``."""
        params = {"p_name": name, "p_shard": shard, "p_value": value}
        yield from call(
            Sql.transaction,
            f"persisting the maximum of counter {name!r}",
            lambda conn: conn.execute(self._raise_max, params),
        )

    def _maxima(self, names: Iterable[str]) -> Program[dict[str, int]]:
        """See ``Store.maxima``."""
        wanted = list(dict.fromkeys(names))
        result = dict.fromkeys(wanted, 0)
        if not wanted:
            return result
        table = self.maxima_table
        rows = yield from call(
            Sql.read,
            "reading counter maxima",
            sa.select(table.c.name, sa.func.max(table.c.value))
            .where(table.c.name.in_(wanted))
            .group_by(table.c.name),
        )
        result.update({name: int(value) for name, value in rows})
        return result

    # -- id allocators -----------------------------------------------------------------

    def _reserve(self, name: str, count: int) -> Program[int]:
        """See ``Store.reserve``."""
        table = self.shards_table
        params = {"p_name": name, "p_shard": 0, "p_value": count}
        if self.dialect.is_mysql:  # no RETURNING: read the row back under the upsert's lock
            mark = sa.select(table.c.value).where(table.c.name == name, table.c.shard == 0)

            def work(conn: Connection) -> int:
                conn.execute(self._upsert_add, params)
                return int(conn.execute(mark).scalar_one())

        else:
            returning = self._upsert_add.returning(table.c.value)

            def work(conn: Connection) -> int:
                return int(conn.execute(returning, params).scalar_one())

        return (yield from call(Sql.transaction, f"reserving ids of {name!r}", work))

    # -- maintenance -------------------------------------------------------------------

    def _purge_keys(self, older_than: float) -> Program[int]:
        """See ``Store.purge_keys``."""
        table = self.keys_table
        statement = sa.delete(table).where(table.c.created_at < older_than)
        return (
            yield from call(
                Sql.transaction,
                "purging idempotency keys",
                lambda conn: int(conn.execute(statement).rowcount),
            )
        )


class SqlStore(SqlCore):
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
        self._owns_engine = owns_engine
        self._fast_add = _Compiled(self._upsert_add, engine.dialect)
        pool = engine.pool
        self._max_held = pool.size() - 1 if isinstance(pool, QueuePool) else 0
        self._gate = gate_forks(engine)
        self._held: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        watch_for_poolers(engine)
        reset_in_child(self, SqlStore._after_fork)

    def _after_fork(self) -> None:
        _INHERITED.append(self._held)
        self._held = queue.SimpleQueue()
        self.engine.dispose(close=False)

    create_schema = blocking(SqlCore._create_schema)

    def has_schema(self) -> bool:
        """See ``Store.has_schema``."""
        try:
            with self.engine.connect() as conn:
                inspector = sa.inspect(conn)
                return all(inspector.has_table(t.name) for t in self.metadata.sorted_tables)
        except SQLAlchemyError as exc:
            raise self._error(exc, "looking for the schema") from exc

    identity = blocking(SqlCore._identity_of_store)
    open_counter = blocking(SqlCore._open_counter)
    counter = blocking(SqlCore._counter)
    counters = blocking(SqlCore._counters)
    add = blocking(SqlCore._add)
    total = blocking(SqlCore._total)
    totals = blocking(SqlCore._totals)
    add_generation = blocking(SqlCore._add_generation)
    generations = blocking(SqlCore._generations)
    recorded_at = blocking(SqlCore._recorded_at)
    advance = blocking(SqlCore._advance)
    retire = blocking(SqlCore._retire)
    raise_max = blocking(SqlCore._raise_max_of)
    maxima = blocking(SqlCore._maxima)
    reserve = blocking(SqlCore._reserve)
    purge_keys = blocking(SqlCore._purge_keys)

    def add_many(
        self, name: str, shard: int, writes: Sequence[tuple[int, str | None]]
    ) -> list[bool]:
        """See ``Store.add_many``: ``SqlCore._add_many``, its hot path (no key) taken
        without a runner (a write's client CPU is what many writers on few cores run
        out of)."""
        unkeyed = self._unkeyed(name, shard, writes)
        if unkeyed is None:
            return run(self._add_many(name, shard, writes), self.roles)
        self.fast_add(unkeyed)
        return [True] * len(writes)

    # -- the role Sql ------------------------------------------------------------------

    def transaction(self, action: str, work: Callable[[Connection], _T]) -> _T:
        """Run ``work`` in one transaction, again if the database chose it as a deadlock
        victim (its effects were rolled back whole, so running it again is safe)."""
        for attempt in itertools.count():
            try:
                with self.engine.begin() as conn:
                    return work(conn)
            except SQLAlchemyError as exc:
                time.sleep(self._pause_before_retry(exc, action, attempt))
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
            conn = self._held.get_nowait()
        except queue.Empty:
            conn = self._connect_autocommit()
        try:
            # The statement's runner (a prepared libpq call, or a cursor) is built once per
            # DB-API connection and kept in its ``info``, which SQLAlchemy clears when that
            # connection is closed or invalidated; keyed by the statement, since several
            # stores may share one engine.
            info = conn.info
            run = info.get(self._fast_add)
            if run is None:
                run = self._fast_add.runner(conn.connection.dbapi_connection)
                info[self._fast_add] = run
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
            self._held.put(conn)
        else:
            conn.close()

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
                conn = self._held.get_nowait()
            except queue.Empty:
                return
            conn.invalidate()
            conn.close()

    def close(self) -> None:
        while True:
            try:
                self._held.get_nowait().close()
            except queue.Empty:
                break
        if self._owns_engine:
            self.engine.dispose()


def engine_from_url(url: str, *, pool_size: int | None = None, existing: bool = False) -> Engine:
    """Create an engine for a store URL, choosing our driver when the URL names none.

    ``pool_size`` connections are kept open (SQLAlchemy's default, 5, when None): as many
    as the threads that use the store at once, or each one past it opens and closes a
    connection of its own. Its connections are checked for a pooler in front of the
    server (``watch_for_poolers``).

    Raises ``MissingDriver`` naming the extra to install, or ``ConfigurationError``; with
    ``existing``, ``StoreNotFound`` for a SQLite file that does not exist (SQLite would
    create it).
    """
    engine: Engine = make_engine(
        url, sa.create_engine, _DRIVERS, pool_size=pool_size, existing=existing
    )
    watch_for_poolers(engine)
    return engine


def make_engine(
    url: str,
    create: Callable[..., _T],
    drivers: Mapping[str, tuple[str, str | None]],
    *,
    pool_size: int | None,
    existing: bool = False,
) -> _T:
    """``create(url, **options)`` for a store URL, the driver chosen from ``drivers``
    (URL scheme -> SQLAlchemy's dialect+driver, and the extra that installs it) when the
    URL names none. Raises ``MissingDriver`` or ``ConfigurationError``; with
    ``existing``, ``StoreNotFound`` for a SQLite file that does not exist."""
    scheme_part, sep, rest = url.partition("://")
    if not sep:
        raise ConfigurationError(f"not a store URL: {_urls.redact(url)!r}")
    _urls.split(url, "store")
    base = scheme_part.split("+", 1)[0].lower()
    if base not in drivers:
        raise ConfigurationError(f"unknown store URL scheme in {_urls.redact(url)!r}")
    driver, extra = drivers[base]
    if "+" not in scheme_part:
        url = f"{driver}://{rest}"
    options: dict[str, Any] = {}
    try:
        parsed = sa.make_url(url)
    except (ArgumentError, ValueError) as exc:
        detail = _urls.scrub(str(exc), _urls.split(url, "store").password)
        raise ConfigurationError(f"bad store URL {_urls.redact(url)!r}: {detail}") from None
    if base == "sqlite":
        database = parsed.database
        if not database or database == ":memory:":
            raise ConfigurationError(
                "an in-memory SQLite database is private to one connection; use a file, "
                "e.g. sqlite:///shardkit.db"
            )
        if existing:
            _sqlite_file_exists(database)
        # Writers queue on SQLite's database lock instead of failing after 5 s.
        options["connect_args"] = {"timeout": 60}
    if pool_size is not None:
        options["pool_size"] = pool_size
    try:
        return create(url, **options)
    except (ImportError, NoSuchModuleError) as exc:
        if extra is None or (isinstance(exc, NoSuchModuleError) and "+" in scheme_part):
            raise ConfigurationError(
                f"no SQLAlchemy driver for {_urls.redact(url)!r}: {exc}"
            ) from exc
        raise MissingDriver(
            f"the {base} store needs its driver: pip install 'shardkit[{extra}]'"
        ) from exc
    except (ArgumentError, ValueError, TypeError) as exc:
        detail = _urls.scrub(str(exc), parsed.password)
        raise ConfigurationError(f"bad store URL {_urls.redact(url)!r}: {detail}") from None


def _sqlite_file_exists(database: str) -> None:
    """Raise ``StoreNotFound`` unless the SQLite file ``database`` (a path, or a
    ``file:`` URI) exists, with a hint where a relative path may be the mistake."""
    path = Path(database.removeprefix("file:").split("?", 1)[0])
    if path.is_file():
        return
    hint = ""
    if not path.is_absolute():
        hint = (
            f" (a relative path, from {Path.cwd()}: sqlite:///{path} is relative, "
            f"sqlite:////{path.resolve().as_posix().lstrip('/')} absolute)"
        )
    raise StoreNotFound(f"no SQLite database at {str(path)!r}{hint}; nothing was created")


__all__ = [
    "Sql",
    "SqlCore",
    "SqlStore",
    "engine_from_url",
    "make_engine",
    "unprepare_behind_pooler",
    "watch_for_poolers",
]
