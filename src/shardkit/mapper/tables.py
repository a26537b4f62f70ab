"""The mapper's tables, and what it needs of the SQL store that holds them.

The ledger is two tables beside the store's, named with the store's prefix:
``{prefix}jobs`` (one row per job: its state, its pickled spec, its estimate) and
``{prefix}ranges`` (one row per key range of a job: its bounds, checkpoint, state and
progress). The mapper creates them when it is first used on a store (``LedgerTables.
create``). It reaches the store through ``LedgerStore`` alone: its transactions, reads
and engine, never its tables or statements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from shardkit.store.sql import Dialect, SqlRoles
from shardkit.store.sql.schema import column_names

_T = TypeVar("_T")


class LedgerStore(Protocol):
    """What the mapper needs of the SQL store its ledger lives in (``SqlStore``, and a
    Django store, play it)."""

    url: str
    prefix: str
    engine: Engine
    """Where the mapper reads a job's source, in its own connections and transactions."""
    dialect: Dialect
    combinable: bool
    """Whether the store's transactions are its own (a Django store's are its caller's)."""
    roles: SqlRoles

    @property
    def autocommits_free(self) -> bool: ...

    def transaction(self, action: str, work: Callable[[Connection], _T]) -> _T:
        """Run ``work`` in one transaction (again if it was a deadlock's victim)."""
        ...

    def standalone(self, action: str, work: Callable[[Connection], _T]) -> _T:
        """Run ``work`` (one write) autocommitted where that is free, else in a
        transaction."""
        ...

    def read(self, action: str, statement: sa.Executable, *, autocommit: bool = False) -> list[Any]:
        """Run a query and return its rows (outside any transaction with ``autocommit``)."""
        ...

    def after_commit(self, action: Callable[[], object]) -> None:
        """Call ``action`` once what this thread wrote through the store is committed:
        at once where the store's transactions are its own, when the caller's
        transaction commits where they are its caller's (never, if it rolls back)."""
        ...

    def create_tables(self, metadata: sa.MetaData, upgrade: Callable[[Connection], None]) -> None:
        """Create ``metadata``'s tables where missing, then run ``upgrade`` in the same
        transaction; concurrent creators may race."""
        ...


class LedgerTables:
    """The ledger's tables for a store's ``prefix``, in a ``MetaData`` of their own."""

    def __init__(self, prefix: str) -> None:
        metadata = sa.MetaData()
        self.jobs = sa.Table(
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
        self.ranges = sa.Table(
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
            sa.Column("runs", sa.Integer),  # runs begun since its job was last resumed
            sa.Column("error", sa.Text),
            sa.Column("created_at", sa.Double, nullable=False),
            sa.Column("done_at", sa.Double),
            sa.Index(f"{prefix}ranges_state", "job", "state"),
            sa.Index(f"{prefix}ranges_parent", "job", "parent"),
        )
        self.metadata = metadata

    def create(self, store: LedgerStore) -> None:
        """Create the tables in ``store`` where missing, and add the columns that tables
        made by an earlier version lack."""
        store.create_tables(self.metadata, self.add_missing_columns)

    def add_missing_columns(self, conn: Connection) -> None:
        """Add to tables made by an earlier version the nullable columns they lack (a
        range's ``planned`` rows, its ``tries``, its ``runs``). Idempotent; a concurrent caller's
        addition makes this one fail, and a second look finds the column there."""
        table = self.ranges
        have = column_names(conn, table)
        name = conn.dialect.identifier_preparer.format_table(table)
        for column in table.columns:
            if column.name not in have and column.nullable:
                definition = sa.schema.CreateColumn(column).compile(dialect=conn.dialect)
                conn.exec_driver_sql(f"ALTER TABLE {name} ADD COLUMN {definition}")


@functools.lru_cache(maxsize=64)
def ledger_tables(prefix: str) -> LedgerTables:
    """The ledger's tables for ``prefix`` (built once per prefix)."""
    return LedgerTables(prefix)
