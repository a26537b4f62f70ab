"""How SQL differs between the databases: the type of names and keys, the upserts and
the other statements whose SQL differs (``Dialect``), and a statement compiled once to
run on a raw DB-API connection (``Compiled``), and one run on psycopg's libpq connection
directly (``LibpqStatement``)."""

from __future__ import annotations

import hashlib
import importlib
import itertools
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, StatementError

from shardkit.validation import MAX_NAME_LENGTH

_T = TypeVar("_T")
_Merge = Callable[[Any, Any], Any]  # (existing column, incoming value) -> new value


class Text(sa.types.TypeDecorator[str]):
    """Names and keys: compared byte for byte on every database.

    MySQL's string collations ignore case and trailing spaces, so two different counter
    names could meet on one row; there the column is VARBINARY holding UTF-8.
    """

    impl = sa.String(MAX_NAME_LENGTH)
    cache_ok = True

    def load_dialect_impl(self, dialect: sa.Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            from sqlalchemy.dialects import mysql

            return dialect.type_descriptor(mysql.VARBINARY(4 * MAX_NAME_LENGTH))
        return dialect.type_descriptor(sa.String(MAX_NAME_LENGTH))

    def process_bind_param(self, value: Any, dialect: sa.Dialect) -> Any:
        if isinstance(value, str) and dialect.name in ("mysql", "mariadb"):
            return value.encode()
        return value

    def process_result_value(self, value: Any, dialect: sa.Dialect) -> str | None:
        return value.decode() if isinstance(value, bytes) else value


class Dialect:
    """The statements whose SQL differs between databases, built once per store."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.is_mysql = name in ("mysql", "mariadb")
        # SQLAlchemy's constructs of this database only (the others are not imported).
        self._sql = importlib.import_module(
            f"sqlalchemy.dialects.{'mysql' if self.is_mysql else name}"
        )

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
            return self._sql.insert(table).prefix_with("IGNORE")  # type: ignore[no-any-return]
        return self._sql.insert(table).on_conflict_do_nothing()  # type: ignore[no-any-return]

    def upsert(self, table: sa.Table, merge: dict[str, _Merge]) -> sa.Insert:
        """INSERT a row, or set each ``merge`` column of the existing row to
        ``merge[column](existing, incoming)``, in one statement. Every column's value is
        the bind parameter ``p_<column>``."""
        values: dict[str, Any] = {c.name: sa.bindparam(f"p_{c.name}") for c in table.columns}
        rules = merge.items()
        upsert: sa.Insert
        if self.is_mysql:
            my = self._sql.insert(table).values(values)
            upsert = my.on_duplicate_key_update(
                {name: rule(table.c[name], my.inserted[name]) for name, rule in rules}
            )
        else:
            ins = self._sql.insert(table).values(values)
            upsert = ins.on_conflict_do_update(
                index_elements=list(table.primary_key.columns),
                set_={
                    name: rule(table.c[name], ins.excluded[name]) for name, rule in merge.items()
                },
            )
        return upsert


def added(existing: Any, incoming: Any) -> Any:
    return existing + incoming


def greatest_of(existing: Any, incoming: Any) -> Any:
    # CASE, not GREATEST: SQLite has no GREATEST (its two-argument max() is not portable).
    return sa.case((incoming > existing, incoming), else_=existing)


class LibpqStatement:
    """A statement run on a psycopg 3 connection through libpq directly, skipping the
    cursor machinery and its CPU: ``$n`` parameters, each an ``int`` or a ``str``.
    Prepared, it runs under a name derived from its text (so another statement never
    takes the name), prepared when the session turns out not to have it: on first use,
    and after a ``DEALLOCATE ALL``, which psycopg runs when it rolls back a transaction
    after preparing statements of its own (the failed call ran nothing: it is repeated;
    in a transaction, the failure aborts it). The caller owns the connection's state:
    its transaction, and no pipeline."""

    def __init__(self, sql: str) -> None:
        self.sql = sql

    def on(
        self, conn: Any, *, prepare: bool, now: bool = False
    ) -> Callable[[Sequence[int | str]], Any]:
        """A function that runs the statement on ``conn`` (prepared, or sent whole) and
        returns its libpq result, raising psycopg's error for a failed one; to keep with
        the connection. With ``now``, the statement is prepared at once (one round trip),
        so that no run in a transaction finds it missing."""
        from psycopg import pq

        encoding: str = conn.info.encoding
        sql = self.sql.encode(encoding)
        pgconn = conn.pgconn
        sqlstate = pq.DiagnosticField.SQLSTATE
        check = _checker(encoding)
        if not prepare:
            return lambda values: check(pgconn.exec_params(sql, _text(values, encoding)))
        name = b"shardkit_" + hashlib.sha1(sql).hexdigest()[:16].encode()
        if now:
            check(pgconn.prepare(name, sql))

        def run(values: Sequence[int | str]) -> Any:
            params = _text(values, encoding)
            result = pgconn.exec_prepared(name, params)
            if result.error_field(sqlstate) == _MISSING:
                check(pgconn.prepare(name, sql))
                result = pgconn.exec_prepared(name, params)
            return check(result)

        return run

    def redoable(self, conn: Any) -> Callable[[Sequence[int | str]], Any | None]:
        """A function that runs the statement on ``conn``, prepared under a name of its
        own (at its first run: one round trip more), and returns its libpq result,
        raising psycopg's error for a failed one. If the session lost the statement
        (a ``DEALLOCATE ALL``) it is prepared and run again, except in a transaction,
        which the failure aborted: then it returns None, for the transaction to be
        rolled back and run again (the statement is prepared first). To keep with the
        connection."""
        from psycopg import pq

        prepared = _Prepared(conn, self.sql)
        pgconn, name, check = prepared.pgconn, prepared.name, prepared.check
        encoding = prepared.encoding
        sqlstate, failed = pq.DiagnosticField.SQLSTATE, pq.TransactionStatus.INERROR

        def run(values: Sequence[int | str]) -> Any | None:
            prepared.ready()
            params = _text(values, encoding)
            result = pgconn.exec_prepared(name, params)
            if result.error_field(sqlstate) == _MISSING:
                prepared.lost()
                if pgconn.transaction_status == failed:
                    return None
                prepared.ready()
                result = pgconn.exec_prepared(name, params)
            return check(result)

        return run

    def committing(self, conn: Any) -> Callable[[Sequence[int | str]], Any | None]:
        """A function that runs the statement on ``conn`` and commits the connection's
        transaction in the same round trip: one simple query, ``EXECUTE name(…);
        COMMIT``, the statement prepared as ``redoable`` prepares it, its values (one at
        least) sent as literals. Returns the COMMIT's libpq result; None if the session
        had lost the statement (prepared again at the next run): the transaction is then
        aborted, to be rolled back. A failed statement raises psycopg's error, the
        transaction aborted and the COMMIT not run; a failed COMMIT raises its own, the
        transaction over. To keep with the connection."""
        from psycopg import pq

        prepared = _Prepared(conn, self.sql)
        pgconn, check = prepared.pgconn, prepared.check
        sqlstate = pq.DiagnosticField.SQLSTATE

        def run(values: Sequence[int | str]) -> Any | None:
            prepared.ready()
            result = pgconn.exec_(prepared.execute(values) + b"; COMMIT")
            if result.error_field(sqlstate) == _MISSING:
                prepared.lost()
                return None
            return check(result)

        return run

    def beginning(self, conn: Any, begin: str) -> Callable[[Sequence[int | str]], Any]:
        """A function that begins a transaction on ``conn``, which has none begun on the
        server, with the statement ``begin`` (a ``BEGIN``) and runs this statement first
        in it, in one round trip: one simple query, ``BEGIN …; EXECUTE name(…)``, the
        statement prepared as ``redoable`` prepares it, its values (one at least) sent
        as literals. Returns the statement's libpq result, raising psycopg's error for a
        failed one (the transaction aborted). If the session had lost the statement, the
        transaction, in which nothing ran, is rolled back and the query sent again, the
        statement prepared first. To keep with the connection."""
        from psycopg import pq

        prepared = _Prepared(conn, self.sql)
        pgconn, check = prepared.pgconn, prepared.check
        sqlstate = pq.DiagnosticField.SQLSTATE
        head = begin.encode(prepared.encoding) + b"; "

        def run(values: Sequence[int | str]) -> Any:
            prepared.ready()
            query = head + prepared.execute(values)
            result = pgconn.exec_(query)
            if result.error_field(sqlstate) == _MISSING:
                prepared.lost()
                check(pgconn.exec_(b"ROLLBACK"))
                prepared.ready()
                result = pgconn.exec_(query)
            return check(result)

        return run


class _Prepared:
    """A statement to prepare on a psycopg connection under a name of its own: at its
    first run, and again after the session lost it."""

    __slots__ = ("check", "encoding", "escape", "head", "missing", "name", "pgconn", "sql")

    def __init__(self, conn: Any, sql: str) -> None:
        from psycopg import pq

        self.encoding: str = conn.info.encoding
        self.sql = sql.encode(self.encoding)
        self.pgconn = conn.pgconn
        self.check = _checker(self.encoding)
        self.name = b"shardkit_prepared_%d" % next(_prepared_names)
        self.missing = True
        self.escape = pq.Escaping(self.pgconn).escape_literal
        self.head = b"EXECUTE " + self.name + b"("

    def execute(self, values: Sequence[int | str]) -> bytes:
        """``EXECUTE name(…)`` of ``values`` (one at least), each a literal."""
        escape, encoding = self.escape, self.encoding
        literals = b", ".join(
            escape(value.encode(encoding)) if isinstance(value, str) else b"%d" % value
            for value in values
        )
        return self.head + literals + b")"

    def ready(self) -> None:
        """Prepare the statement if the session does not have it."""
        if self.missing:
            self.check(self.pgconn.prepare(self.name, self.sql))
            self.missing = False

    def lost(self) -> None:
        """The session no longer has the statement: prepare it at the next ``ready``."""
        self.missing = True


def _row_count(cursor: Any) -> int:
    return int(cursor.rowcount)


def _all_rows(cursor: Any) -> list[Any]:
    rows = cursor.fetchall()
    return rows if isinstance(rows, list) else list(rows)


def _checker(encoding: str) -> Callable[[Any], Any]:
    """A function returning a libpq result that succeeded, raising psycopg's error for
    one that failed."""
    from psycopg import errors, pq

    done = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)

    def check(result: Any) -> Any:
        if result.status not in done:
            raise errors.error_from_result(result, encoding=encoding)
        return result

    return check


def _text(values: Sequence[int | str], encoding: str) -> list[bytes]:
    """libpq's text parameters of ``values``."""
    return [value.encode(encoding) if isinstance(value, str) else b"%d" % value for value in values]


_MISSING = b"26000"  # invalid_sql_statement_name: not prepared in this session
IDLE = 0
"""libpq's ``PQTRANS_IDLE`` (a connection's ``transaction_status``): no transaction open."""
COMMIT = "COMMIT"
"""The statement a ``DBAPIError`` names when the ``COMMIT`` sent with a statement failed
(``Compiled.run``): the transaction is over, rolled back by the database."""
_prepared_names = itertools.count()  # each `_Prepared` statement's own name


class Compiled:
    """A statement compiled once, run on a raw DB-API connection with minimal overhead.
    Its parameters are given by name (its bind parameters'), those with values of their
    own (literals in the statement) left out; no type's bind processing is applied."""

    def __init__(
        self, statement: sa.Insert | sa.Update | sa.Select[Any], dialect: sa.Dialect
    ) -> None:
        compiled = statement.compile(dialect=dialect)
        self.sql = compiled.string
        self.order = compiled.positiontup if compiled.positional else None
        self._libpq = dialect.driver == "psycopg" and self.order is None
        self._own = {
            name: value
            for name, value in compiled.construct_params(_check=False).items()
            if not compiled.binds[name].required
        }
        # Whether its parameters reach the driver as given: no type processes them and
        # none is expanded at execution (an ``IN`` list's).
        self.plain = not compiled.post_compile_params and all(
            bind.type.dialect_impl(dialect).bind_processor(dialect) is None
            for bind in compiled.binds.values()
        )

    def params(self, values: Mapping[str, Any]) -> Any:
        given = {**self._own, **values} if self._own else values
        if self.order is None:
            return given
        return tuple(given[key] for key in self.order)

    def run(
        self, conn: Connection, values: Mapping[str, Any], *, commit: bool = False
    ) -> int | None:
        """Run the statement in ``conn``'s transaction (or autocommitted) with no
        SQLAlchemy execution around it and return its row count: psycopg's through
        libpq (``LibpqStatement.redoable``, kept with the DB-API connection; sent whole
        through a transaction pooler), None when the session had lost the prepared
        statement within a transaction, which is then to be rolled back and run again;
        other drivers' on a cursor of the DB-API connection. With ``commit`` (the
        statement is the last of ``conn``'s transaction), psycopg on a direct connection
        commits the transaction in the same round trip (``LibpqStatement.committing``)
        and returns -1, the row count not known (as a DB-API cursor's); elsewhere the
        transaction is left to its owner. The driver's errors raise as SQLAlchemy's
        ``DBAPIError``, a lost connection invalidated as SQLAlchemy would."""
        if self._libpq:
            key = (self, commit)
            run = conn.info.get(key)
            dbapi_connection: Any = conn.connection.dbapi_connection
            if run is None:
                run = conn.info[key] = self._counting(dbapi_connection, commit)
            try:
                return run(values)
            except conn.dialect.loaded_dbapi.Error as exc:
                # A COMMIT that failed ended the transaction; a statement that failed
                # left it aborted, the COMMIT sent with it not run.
                ended = commit and dbapi_connection.pgconn.transaction_status == IDLE
                raise self._failure(conn, values, None, exc, committing=ended) from exc
        return self._on_cursor(conn, values, _row_count)

    def fetch(self, conn: Connection, values: Mapping[str, Any]) -> list[Any]:
        """Run the query in ``conn``'s transaction (or autocommitted) on a cursor of the
        DB-API connection, with no SQLAlchemy execution around it, and return its rows
        as the driver makes them (no type's result processing); errors as ``run``'s."""
        return self._on_cursor(conn, values, _all_rows)

    def _on_cursor(
        self, conn: Connection, values: Mapping[str, Any], take: Callable[[Any], _T]
    ) -> _T:
        """``take`` of a cursor of ``conn``'s DB-API connection that ran the statement."""
        dbapi_connection: Any = conn.connection.dbapi_connection
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(self.sql, self.params(values))
            return take(cursor)
        except conn.dialect.loaded_dbapi.Error as exc:
            raise self._failure(conn, values, cursor, exc) from exc
        finally:
            cursor.close()

    def _failure(
        self,
        conn: Connection,
        values: Mapping[str, Any],
        cursor: Any,
        exc: Any,
        *,
        committing: bool = False,
    ) -> StatementError:
        """The driver's error ``exc`` as SQLAlchemy's ``DBAPIError``, naming the statement
        that failed: this one, or (``committing``) the ``COMMIT`` sent with it, with no
        parameters. A lost connection is invalidated as SQLAlchemy would."""
        lost = conn.dialect.is_disconnect(exc, conn.connection.dbapi_connection, cursor)
        if lost:
            conn.invalidate(exc)
        failure: StatementError = DBAPIError.instance(
            COMMIT if committing else self.sql,
            None if committing else dict(values),
            exc,
            conn.dialect.loaded_dbapi.Error,
            connection_invalidated=lost,
        )
        return failure

    def _counting(self, conn: Any, commit: bool) -> Callable[[Mapping[str, Any]], int | None]:
        """psycopg: a function running the statement as ``run`` does on ``conn``."""
        statement, names = self._numbered()
        if conn.prepare_threshold is None:  # behind a transaction pooler
            run = statement.on(conn, prepare=False)
        elif commit:
            run = statement.committing(conn)
        else:
            run = statement.redoable(conn)
        params = self.params

        def count(values: Mapping[str, Any]) -> int | None:
            given = params(values)
            result = run([given[name] for name in names])
            if result is None:
                return None
            tuples = result.command_tuples  # None for the COMMIT
            return -1 if tuples is None else int(tuples)

        return count

    def runner(self, dbapi_connection: Any) -> Callable[[Mapping[str, Any]], object]:
        """A function that runs the statement on ``dbapi_connection``, to keep with it."""
        if self._libpq:
            return self._libpq_runner(dbapi_connection)
        cursor = dbapi_connection.cursor()
        sql, params = self.sql, self.params
        return lambda values: cursor.execute(sql, params(values))

    def _libpq_runner(self, conn: Any) -> Callable[[Mapping[str, Any]], object]:
        """psycopg: a ``LibpqStatement``, prepared on a direct connection, sent whole
        through a transaction pooler (``prepare_threshold`` None, see
        ``_detect_pooler``)."""
        statement, names = self._numbered()
        run = statement.on(conn, prepare=conn.prepare_threshold is not None)
        params = self.params
        if self._own or len(names) < 2:

            def ordered(values: Mapping[str, Any]) -> None:
                given = params(values)
                run([given[name] for name in names])

            return ordered
        take = operator.itemgetter(*names)  # a tuple of the values, in their order
        return lambda values: run(take(values))

    def _numbered(self) -> tuple[LibpqStatement, list[str]]:
        """The statement with libpq's ``$n`` parameters, and the names they stand for."""
        names: list[str] = []

        def placeholder(match: re.Match[str]) -> str:
            if match.group(1) is None:
                return "%"
            names.append(match.group(1))
            return f"${len(names)}"

        return LibpqStatement(re.sub(r"%\((\w+)\)s|%%", placeholder, self.sql)), names


__all__ = [
    "COMMIT",
    "IDLE",
    "Compiled",
    "Dialect",
    "LibpqStatement",
    "Text",
    "added",
    "greatest_of",
]
