"""The counting statements of a ``CountingQuerySet``: their SQL for Django's cursors,
how they run on Django's connection (through libpq directly on psycopg 3), and the
thread's ticket that picks the shard they write."""

from __future__ import annotations

import functools
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from django.db import connections, models

from shardkit._program import run
from shardkit.counters.sharded import held_ticket, take_ticket
from shardkit.kit import Kit
from shardkit.store.sql import unprepare_behind_pooler
from shardkit.store.sql.dialect import IDLE, LibpqStatement

from .conf import database


@functools.lru_cache(maxsize=256)
def counting_sql(alias: str, tables: tuple[str, str], model: type[models.Model], what: str) -> str:
    """The SQL of a counting update's statement ``what`` for ``model``'s objects, for
    Django's cursors on database ``alias`` (``%s`` parameters), ``tables`` being the
    store's shards and counters tables: ``exists`` finds an object by key; ``count
    one`` upserts the shard row of an object given by key if it exists; ``count many``
    upserts one for each key of the subquery put in place of ``{select}``. Both write
    the shard a writer's ticket picks among the counter's current shards (those it is
    created with, for a counter not created yet), and return the names written; ``count
    one`` reads them only when not given (0: unknown)."""
    quote = connections[alias].ops.quote_name
    shards, counters = (quote(table) for table in tables)
    name, shard, value = (quote(column) for column in ("name", "shard", "value"))
    table, pk = quote(model._meta.db_table), quote(model._meta.pk.column)
    if what == "exists":
        return f"SELECT 1 FROM {table} WHERE {pk} = %s"
    into = f"INSERT INTO {shards} ({name}, {shard}, {value})"
    upsert = (
        f"ON CONFLICT ({name}, {shard}) DO UPDATE SET {value} = {shards}.{value} + "
        f"excluded.{value} RETURNING {name}"
    )
    if what == "count one":
        named = "%s"
        found = f"WHERE EXISTS (SELECT 1 FROM {table} WHERE {pk} = %s)"
    else:
        # WHERE true: SQLite would read the ON CONFLICT as a join's without a WHERE.
        named = f"%s || CAST(matched.{quote('shardkit_pk')} AS TEXT)"
        found = "FROM ({select}) matched WHERE true"
    current = (
        f"SELECT {counters}.{quote('shards')} FROM {counters} WHERE {counters}.{name} = {named}"
    )
    known = "NULLIF(%s, 0), " if what == "count one" else ""
    return f"{into} SELECT {named}, %s %% COALESCE({known}({current}), %s), %s {found} {upsert}"


def counted_names(connection: Any, sql: str, params: Sequence[Any], *, one: bool) -> list[str]:
    """The names the counting statement ``sql`` returns, run on Django's ``connection`` in
    its transaction. The statement of ``one`` object (parameters of ``int`` and ``str``), on
    PostgreSQL through psycopg 3, runs through libpq directly (``LibpqStatement``), as
    psycopg would run it (a transaction Django has begun is begun on the server first:
    prepared, the statement goes with its ``BEGIN``, in one round trip), prepared where
    the session keeps it (not behind a pooler), except after the first statement of a
    transaction while psycopg may prepare statements of its own (its
    ``prepare_threshold`` set): psycopg deallocates every statement of the session when
    it rolls back after preparing some, and a statement found missing there would abort
    the transaction (first in it, the transaction is rolled back and the statement sent
    again, prepared first). Prepared, the server plans it once per connection, and
    neither Django's cursor wrapper nor psycopg's cursor is paid —
    unless something watches Django's cursors (an execute wrapper, as instrumentation
    installs; the query log, with ``DEBUG`` or in a test's ``assertNumQueries``).
    Otherwise it goes through Django's cursor."""
    watched = connection.execute_wrappers or connection.queries_logged
    simple = one and all(type(param) in (int, str) for param in params)
    if watched or not simple or not _psycopg(connection):
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return [row[0] for row in cursor.fetchall()]
    connection.ensure_connection()
    connection.validate_no_broken_transaction()  # as Django's cursor would
    raw = connection.connection
    with connection.wrap_database_errors:
        session = _sessions.get(raw)
        if session is None:  # opened before the app was ready, or on another alias
            session = _Session.of(raw)
        prepare, begin = session.prepare, None
        if not raw.autocommit:
            if raw.pgconn.transaction_status == IDLE:
                begin = _begin(raw.isolation_level, raw.read_only, raw.deferrable)
                if not prepare:
                    session.run(raw, begin, ())
                    begin = None
            else:  # a statement found missing would abort the caller's transaction
                prepare = prepare and raw.prepare_threshold is None
        return session.run(raw, sql, params, prepare=prepare, begin=begin)


class _Session:
    """What counting updates keep with one psycopg connection: whether it may prepare
    statements (not behind a pooler), and a function running each statement through
    libpq, by SQL, whether prepared, and the ``BEGIN`` sent with it."""

    __slots__ = ("prepare", "runners")

    def __init__(self, raw: Any) -> None:
        self.prepare = not unprepare_behind_pooler(raw)  # one round trip
        self.runners: dict[tuple[str, bool, str | None], _Names] = {}

    @classmethod
    def of(cls, raw: Any) -> _Session:
        """The session of ``raw``, made (one round trip) and remembered."""
        session = _sessions[raw] = cls(raw)
        return session

    def run(
        self,
        raw: Any,
        sql: str,
        params: Sequence[Any],
        *,
        prepare: bool = False,
        begin: str | None = None,
    ) -> list[str]:
        """Run the statement ``sql`` (``%s`` parameters) on ``raw``, prepared or not
        (with ``begin``: prepared, sent with that ``BEGIN`` of a transaction in one
        round trip); the names it returns."""
        key = (sql, prepare, begin)
        run = self.runners.get(key)
        if run is None:
            run = self.runners[key] = _runner(raw, sql, prepare, begin)
        return run(params)


def _runner(raw: Any, sql: str, prepare: bool, begin: str | None) -> _Names:
    """A function running the counting statement ``sql`` (``%s`` parameters) on psycopg's
    connection ``raw`` through libpq (after ``begin``, in one round trip, if given); it
    returns the names the statement returns."""
    numbers = iter(range(1, sql.count("%s") + 1))
    text = re.sub(r"%s|%%", lambda m: "%" if m[0] == "%%" else f"${next(numbers)}", sql)
    statement = LibpqStatement(text)
    if begin is None:
        run = statement.on(raw, prepare=prepare, now=True)
    else:
        run = statement.beginning(raw, begin)
    encoding: str = raw.info.encoding

    def names(params: Sequence[Any]) -> list[str]:
        result = run(params)
        return [result.get_value(row, 0).decode(encoding) for row in range(result.ntuples)]

    return names


@functools.lru_cache(maxsize=64)
def _begin(isolation_level: int | None, read_only: bool | None, deferrable: bool | None) -> str:
    """The ``BEGIN`` psycopg sends before a transaction's first statement on a connection
    of these settings."""
    from psycopg import IsolationLevel

    parts = ["BEGIN"]
    if isolation_level is not None:
        parts.append(f"ISOLATION LEVEL {IsolationLevel(isolation_level).name.replace('_', ' ')}")
    if read_only is not None:
        parts.append("READ ONLY" if read_only else "READ WRITE")
    if deferrable is not None:
        parts.append("DEFERRABLE" if deferrable else "NOT DEFERRABLE")
    return " ".join(parts)


_Names = Callable[[Sequence[Any]], list[str]]
_sessions: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()


def note_pooler(sender: Any, connection: Any, **_: Any) -> None:
    """``connection_created``'s receiver: find out, once per connection Django opens to
    the store's database, whether it goes through a pooler (one round trip), before any
    request's counting update needs to know."""
    if connection.alias == database() and _psycopg(connection):
        _Session.of(connection.connection)


def _psycopg(connection: Any) -> bool:
    """Whether Django's ``connection`` is to PostgreSQL through psycopg 3."""
    return bool(connection.vendor == "postgresql" and connection.Database.__name__ == "psycopg")


_tickets = threading.local()


def writer_ticket(the_kit: Kit) -> int:
    """This thread's ticket, which picks its shard of every count it writes by
    statement: one per thread and process, so that concurrent writers of one hot object
    write different rows."""
    ticket = held_ticket(_tickets)
    if ticket is None:
        settings = the_kit.settings
        taking = take_ticket(settings, settings.cache_key("django", "ticket"), _tickets)
        ticket = run(taking, settings.roles)
    return ticket


__all__ = ["counted_names", "counting_sql", "note_pooler", "writer_ticket"]
