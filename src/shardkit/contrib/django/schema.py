"""shardkit's tables in a Django database: made by ``manage.py migrate``, checked by
``manage.py check --database``.

The app's migrations create the store's tables once, named with ``SHARDKIT['PREFIX']``.
Tables they did not make — all of them after the prefix changed, or a table that a later
version of shardkit adds to the store — are created by ``migrate`` too: after each run,
a ``post_migrate`` receiver creates, on the migrated database, whatever tables of the
store's own definition (its SQLAlchemy metadata) are missing there, once the app's
migrations are applied to it. The system check ``shardkit.W001`` names the tables that
the kit's database lacks, and the fix.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from django.core import checks
from django.db import DatabaseError, connections, router
from django.db.migrations.recorder import MigrationRecorder

from shardkit.mapper.tables import ledger_tables

from .conf import database, migration_store, options, store_on
from .store import DjangoStore

_INITIAL = ("shardkit", "0001_initial")


def shardkit_tables(store: DjangoStore) -> list[sa.Table]:
    """The store's tables and the mapper's ledger beside them."""
    ledger = ledger_tables(store.prefix)
    return [*store.metadata.sorted_tables, *ledger.metadata.sorted_tables]


def create_tables(store: DjangoStore) -> None:
    """Create the store's tables and the ledger's where missing."""
    store.create_schema()
    ledger_tables(store.prefix).create(store)


def missing_tables(store: DjangoStore) -> list[str]:
    """The names of shardkit's tables that the store's database lacks (one query)."""
    present = set(connections[store.alias].introspection.table_names())
    return [table.name for table in shardkit_tables(store) if table.name not in present]


def _migrated(alias: str) -> bool:
    """Whether the app's migrations are recorded as applied to database ``alias``."""
    return _INITIAL in MigrationRecorder(connections[alias]).applied_migrations()


def create_missing_tables(*, using: str, verbosity: int = 1, **kwargs: Any) -> None:
    """``post_migrate`` receiver: create the store's missing tables in database ``using``
    if the app's migrations are applied to it (not after ``migrate shardkit zero``) and
    allowed there by the routers. Idempotent and safe against a concurrent ``migrate``;
    costs one query when no table is missing (``flush`` sends the signal too)."""
    if not router.allow_migrate(using, "shardkit"):
        return
    store = store_on(using)
    missing = missing_tables(store)
    if not missing or not _migrated(using):
        return
    create_tables(store)
    if verbosity >= 1:
        stdout = kwargs.get("stdout") or sys.stdout
        stdout.write(
            f"  Created shardkit's tables {', '.join(missing)} "
            f"(SHARDKIT['PREFIX'] {options()['PREFIX']!r})\n"
        )


def add_missing_columns(apps: Any, schema_editor: Any) -> None:
    """A migration's ``RunPython``: add to the ledger made by an earlier version the
    columns it lacks (``LedgerTables.add_missing_columns``)."""
    store = migration_store(schema_editor)
    ledger = ledger_tables(store.prefix)
    store.transaction("adding missing columns", ledger.add_missing_columns)


def check_tables(
    app_configs: Sequence[Any] | None = None, databases: Sequence[str] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Django system check ``shardkit.W001``, run when the check is given the kit's
    database (``manage.py check --database``, ``migrate``, ``test``) and it answers: the
    app's migrations are applied but tables of the store are missing. A warning, not an
    error: ``migrate``, which creates them, runs this check first and stops on errors."""
    alias = database()
    if not databases or alias not in databases:
        return []
    store = store_on(alias)
    try:
        missing = missing_tables(store)
        if not missing or not _migrated(alias):
            return []
    except DatabaseError:  # unreachable: the first query of the kit will say so
        return []
    return [
        checks.Warning(
            f"database {alias!r} (SHARDKIT['STORE']) lacks shardkit's tables "
            f"{', '.join(missing)}, named with SHARDKIT['PREFIX'] {options()['PREFIX']!r}, "
            "though the app's migrations are applied there",
            hint=f"python manage.py migrate --database {alias} creates them",
            id="shardkit.W001",
        )
    ]


__all__ = [
    "check_tables",
    "create_missing_tables",
    "create_tables",
    "missing_tables",
    "shardkit_tables",
]
