"""Engines for store URLs (``engine_from_url``, our driver chosen when the URL names
none), and what is done to an engine's connections: a pooler in front of PostgreSQL
detected (``watch_for_poolers``), forks gated on SQLite (``gate_forks``), TCP liveness
set on PostgreSQL's (libpq's settings) and PyMySQL's (``_connect_alive``)."""

from __future__ import annotations

import socket
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from shardkit import _urls
from shardkit._fork import ForkGate
from shardkit.errors import (
    ConfigurationError,
    MissingDriver,
    StoreNotFound,
)

_T = TypeVar("_T")
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

# A server or network that goes silent fails the call within about 30 s (keepalive probes
# after 10 s of silence, 3 more 5 s apart; a request unacknowledged for 30 s) instead of
# leaving it waiting for hours. A statement that runs long is unaffected: the server's
# host acknowledges the probes.
_IDLE, _INTERVAL, _PROBES, _UNACKED_MS = 10, 5, 3, 30_000
# libpq's settings for a PostgreSQL connection that the URL does not give.
_POSTGRES_LIVENESS = {
    "keepalives": "1",
    "keepalives_idle": str(_IDLE),
    "keepalives_interval": str(_INTERVAL),
    "keepalives_count": str(_PROBES),
    "tcp_user_timeout": str(_UNACKED_MS),
}
# The same as socket options (level, name, value), those the platform has: PyMySQL's.
_SOCKET_LIVENESS = [
    (level, getattr(socket, name), value)
    for level, name, value in (
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", _IDLE),  # Linux
        (socket.IPPROTO_TCP, "TCP_KEEPALIVE", _IDLE),  # macOS
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", _INTERVAL),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", _PROBES),
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", _UNACKED_MS),
    )
    if hasattr(socket, name)
]
# PyMySQL's error for a server that cannot be reached (CR_CONN_HOST_ERROR).
_CONN_HOST_ERROR = 2003

# The fork gate of each SQLite engine (``gate_forks``).
_GATES: weakref.WeakKeyDictionary[Engine, ForkGate] = weakref.WeakKeyDictionary()
_GATING = threading.Lock()


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


def _connect_alive(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
    """``do_connect`` hook of PyMySQL engines: the connection made (``defer_connect``)
    and then connected on a TCP socket of ours with ``_SOCKET_LIVENESS`` set. PyMySQL's
    own turns keepalives on and leaves their timing to the kernel (on Linux, probes
    after 2 hours of silence). A Unix socket, which no network silences, is PyMySQL's.
    A server that cannot be reached raises PyMySQL's error for it."""
    dbapi = dialect.loaded_dbapi
    connection = dbapi.connect(*cargs, **{**cparams, "defer_connect": True})
    if connection.unix_socket:
        connection.connect()
        return connection
    source = None if connection.bind_address is None else (connection.bind_address, 0)
    address = (connection.host, connection.port)
    try:
        sock = socket.create_connection(address, connection.connect_timeout, source)
    except OSError as exc:
        raise dbapi.OperationalError(
            _CONN_HOST_ERROR, f"Can't connect to MySQL server on {connection.host!r} ({exc})"
        ) from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for level, option, value in _SOCKET_LIVENESS:
        sock.setsockopt(level, option, value)
    connection.connect(sock)
    return connection


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


def engine_from_url(url: str, *, pool_size: int | None = None, existing: bool = False) -> Engine:
    """Create an engine for a store URL, choosing our driver when the URL names none.

    ``pool_size`` connections are kept open (SQLAlchemy's default, 5, when None): as many
    as the threads that use the store at once, or each one past it opens and closes a
    connection of its own. Its connections are checked for a pooler in front of the
    server (``watch_for_poolers``); PyMySQL's send keepalives (``_connect_alive``).

    Raises ``MissingDriver`` naming the extra to install, or ``ConfigurationError``; with
    ``existing``, ``StoreNotFound`` for a SQLite file that does not exist (SQLite would
    create it).
    """
    engine: Engine = make_engine(
        url, sa.create_engine, _DRIVERS, pool_size=pool_size, existing=existing
    )
    watch_for_poolers(engine)
    if engine.dialect.driver == "pymysql":
        sa.event.listen(engine, "do_connect", _connect_alive)
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
    elif base in ("postgresql", "postgres"):
        given = set(parsed.query)
        options["connect_args"] = {
            key: value for key, value in _POSTGRES_LIVENESS.items() if key not in given
        }
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
    "engine_from_url",
    "gate_forks",
    "make_engine",
    "unprepare_behind_pooler",
    "watch_for_poolers",
]
