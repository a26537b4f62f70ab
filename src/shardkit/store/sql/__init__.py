"""The SQL store: SQLite, PostgreSQL and MySQL/MariaDB through SQLAlchemy Core.

Each shard write is one atomic upsert (``INSERT … ON CONFLICT … DO UPDATE SET value =
value + excluded.value``, or ``ON DUPLICATE KEY UPDATE`` on MySQL), never a read followed
by a write. The statement is built and compiled once by SQLAlchemy per dialect; the hot
path then runs it on a held autocommit connection, so a write costs one round trip and
almost no client CPU. Dialect differences live in ``dialect`` and nowhere else.

The package: ``dialect`` (how SQL differs), ``schema`` (the tables), ``core`` (the
statements, the rules as programs), ``store`` (``SqlStore``, blocking), ``engines``
(engines for URLs, poolers, fork gates).
"""

from __future__ import annotations

from .core import Sql, SqlCore, SqlRoles, committing
from .dialect import Dialect
from .engines import (
    engine_from_url,
    gate_forks,
    make_engine,
    unprepare_behind_pooler,
    watch_for_poolers,
)
from .store import SqlStore

__all__ = [
    "Dialect",
    "Sql",
    "SqlCore",
    "SqlRoles",
    "SqlStore",
    "committing",
    "engine_from_url",
    "gate_forks",
    "make_engine",
    "unprepare_behind_pooler",
    "watch_for_poolers",
]
