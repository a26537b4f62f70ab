"""shardkit's SQL store on a Django database: Django's connection, no second pool.

The store's SQLAlchemy engine hands out, in each thread, the DB-API connection that
Django holds for that thread (``django.db.connections[alias]``), and every transaction
SQLAlchemy runs on it is a Django ``atomic`` block: a transaction of its own outside
any atomic block, a savepoint inside one. So a shard write made while the caller's
transaction is open commits or rolls back with it, and Django's ``on_commit`` hooks,
``needs_rollback`` and connection management keep working as they do for the ORM.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, cast

import sqlalchemy as sa
from django.db import DatabaseError, connections, transaction
from django.db.transaction import Atomic
from sqlalchemy.pool import SingletonThreadPool

from shardkit.errors import ConfigurationError
from shardkit.store.sql import SqlStore

# Django's database vendor -> SQLAlchemy's dialect, for the drivers shardkit supports.
_DIALECTS = {"postgresql": "postgresql", "sqlite": "sqlite"}


class _Rollback(Exception):
    """Passed to ``Atomic.__exit__`` to roll the block back."""


class DjangoConnection:
    """A DB-API connection for SQLAlchemy over Django's connection ``alias`` of the
    thread that created it.

    The first cursor of a transaction enters a Django atomic block; ``commit`` leaves it
    (committing, or releasing the savepoint), ``rollback`` and ``close`` leave it rolling
    back. While SQLAlchemy has set it to AUTOCOMMIT, statements run on Django's
    connection as they are: committed at once, or part of the caller's atomic block.
    Closing never closes Django's connection, and from another thread (the pool
    recycling the connections of finished threads) does nothing. Anything else is the
    connection Django holds now (it may reconnect between requests).
    """

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._thread = threading.get_ident()
        self._atomic: Atomic | None = None
        self.autocommit = False

    @property
    def _raw(self) -> Any:
        django_connection = connections[self.alias]
        django_connection.ensure_connection()
        return django_connection.connection

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        self.begin()
        return self._raw.cursor(*args, **kwargs)

    def begin(self) -> None:
        """Enter the transaction's atomic block now, as its first cursor would (unless
        in AUTOCOMMIT): the ORM's statements that follow on Django's connection are part
        of it, though SQLAlchemy has not run one yet."""
        if self._atomic is None and not self.autocommit:
            atomic = transaction.atomic(using=self.alias)
            atomic.__enter__()
            self._atomic = atomic

    def commit(self) -> None:
        atomic, self._atomic = self._atomic, None
        if atomic is not None:
            atomic.__exit__(None, None, None)

    def rollback(self) -> None:
        atomic, self._atomic = self._atomic, None
        if atomic is not None:
            atomic.__exit__(_Rollback, _Rollback(), None)

    def close(self) -> None:
        if threading.get_ident() == self._thread:
            self.rollback()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _set_isolation_level(dbapi_connection: Any, level: str | None) -> None:
    # Django's connection keeps the isolation level Django gave it; SQLAlchemy's
    # AUTOCOMMIT only means: no atomic block of the stand-in's own.
    dbapi_connection.autocommit = level == "AUTOCOMMIT"


def _reset_isolation_level(dbapi_connection: Any) -> None:
    _set_isolation_level(dbapi_connection, None)


def django_engine(alias: str) -> sa.Engine:
    """A SQLAlchemy engine whose connections are Django's connection ``alias``, one per
    thread as Django keeps them."""
    if alias not in connections:
        raise ConfigurationError(f"no database {alias!r} in settings.DATABASES")
    django_connection = connections[alias]
    dialect = _DIALECTS.get(django_connection.vendor)
    if dialect is None:
        raise ConfigurationError(
            f"database {alias!r} is {django_connection.vendor}: shardkit's Django app "
            f"runs on {' and '.join(sorted(_DIALECTS))}"
        )
    driver = cast(Any, django_connection).Database.__name__.partition(".")[0]
    if dialect == "sqlite":
        driver = "pysqlite"
    elif driver != "psycopg":
        raise ConfigurationError(
            f"database {alias!r} uses {driver}: shardkit's Django app needs psycopg 3 "
            "(pip install 'shardkit[postgres]'; Django then uses it too)"
        )
    # No dialect option that hands the DB-API connection to the driver's own functions
    # (psycopg's TypeInfo.fetch wants its Connection class, not this stand-in).
    options = {"use_native_hstore": False} if dialect == "postgresql" else {}
    engine = sa.create_engine(
        f"{dialect}+{driver}://",
        creator=lambda: DjangoConnection(alias),
        **options,
        # One connection per thread, like Django's; past pool_size threads, those of
        # other threads are dropped (a thread that is still alive gets a new one).
        poolclass=SingletonThreadPool,
        pool_size=64,
    )
    # The dialect's own switching would run statements (SQLite's PRAGMA) outside any
    # transaction of SQLAlchemy's, leaving an atomic block open.
    dialect_object: Any = engine.dialect
    dialect_object.set_isolation_level = _set_isolation_level
    dialect_object.reset_isolation_level = _reset_isolation_level
    return engine


class DjangoStore(SqlStore):
    """The SQL store on Django's database ``alias``. Its tables come from the app's
    migrations (``manage.py migrate shardkit``). A transaction of the store is a Django
    atomic block; a read, and a shard write without an idempotency key, is one statement
    on Django's connection: part of the caller's transaction if one is open, on its own
    (autocommitted) if not."""

    combinable = False  # a write is part of its caller's transaction

    def __init__(self, alias: str, *, prefix: str = "shardkit_") -> None:
        super().__init__(django_engine(alias), prefix=prefix)
        self.alias = alias
        self.url = f"django://{alias}"
        # Compiled once with named %(…)s parameters, which Django's cursors take on
        # every backend.
        named = cast(Any, type(self.engine.dialect))(paramstyle="pyformat")
        self._add_sql = self._upsert_add.compile(dialect=named).string

    def read(self, action: str, statement: sa.Executable, *, autocommit: bool = False) -> list[Any]:
        """Run a query as one statement, outside any atomic block of the store's own:
        no BEGIN/ROLLBACK around it outside a transaction, no savepoint inside one, so
        there it fails the caller's transaction if it fails, as an ORM query would (on
        Django's connection, AUTOCOMMIT is a flag of the stand-in, free to set)."""
        return super().read(action, statement, autocommit=True)

    def after_commit(self, action: Callable[[], object]) -> None:
        """Call ``action`` when the caller's transaction commits (now, outside one;
        never, if it rolls back)."""
        transaction.on_commit(action, using=self.alias)

    def fast_add(self, params: Mapping[str, Any]) -> None:
        try:
            with connections[self.alias].cursor() as cursor:
                cursor.execute(self._add_sql, params)
        except DatabaseError as exc:
            raise self._error(exc, f"adding to counter {params['p_name']!r}") from exc


__all__ = ["DjangoConnection", "DjangoStore", "django_engine"]
