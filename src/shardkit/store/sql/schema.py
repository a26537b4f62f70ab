"""The SQL store's tables (``Tables``): their definitions for a prefix, and the check
that tables made by an earlier version need."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from shardkit.errors import ConfigurationError

from .dialect import Text


class Tables:
    """The store's tables, named with ``prefix``: ``{prefix}counters`` (one row per
    counter: its kind, shards and incarnation); the rows of a counter, deleted with it:
    ``{prefix}shards``, ``{prefix}keys`` (idempotency keys), ``{prefix}flushed`` (what
    each cache generation of a buffered counter has flushed), ``{prefix}maxima`` (the
    highest values persisted by a monotonic counter's incarnation); ``{prefix}marks``
    (each id allocator's high-water mark, kept when it is deleted), ``{prefix}identity``
    (the store's identity, one row). (The mapper keeps its ledger beside them, with the
    same prefix: ``shardkit.mapper.tables``.)"""

    url: str

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        metadata = sa.MetaData()
        self.counters_table = sa.Table(
            f"{prefix}counters",
            metadata,
            sa.Column("name", Text(), primary_key=True),
            sa.Column("kind", sa.String(16), nullable=False),
            sa.Column("shards", sa.Integer, nullable=False),
            sa.Column("incarnation", sa.BigInteger, nullable=False),
        )
        # The tables of a counter's rows (shards, flushed, maxima) are deliberately alike:
        # each is keyed by the name and one more column.
        self.shards_table = sa.Table(
            f"{prefix}shards",
            metadata,
            sa.Column("name", Text(), primary_key=True),
            sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("value", sa.BigInteger, nullable=False),
            # SQLite turns an integer sum past 64 bits into a REAL: refuse it instead, so
            # an overflowing write fails and changes nothing, as on the other databases.
            sa.CheckConstraint("typeof(value) = 'integer'").ddl_if(dialect="sqlite"),
        )
        self.keys_table = sa.Table(
            f"{prefix}keys",
            metadata,
            sa.Column("name", Text(), primary_key=True),
            sa.Column("key", Text(), primary_key=True),
            sa.Column("created_at", sa.Double, nullable=False, index=True),
        )
        self.flushed_table = sa.Table(
            f"{prefix}flushed",
            metadata,
            sa.Column("name", Text(), primary_key=True),
            sa.Column("generation", sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("up", sa.BigInteger, nullable=False),
            sa.Column("down", sa.BigInteger, nullable=False),
            sa.Column("created_at", sa.Double, nullable=False),
        )
        self.maxima_table = sa.Table(
            f"{prefix}maxima",
            metadata,
            sa.Column("name", Text(), primary_key=True),
            # A monotonic counter's maxima are its incarnation's: an object of a deleted
            # one may still persist a value, which the next one must not read.
            sa.Column("incarnation", sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("value", sa.BigInteger, nullable=False),
        )
        self.marks_table = sa.Table(
            f"{prefix}marks",
            metadata,
            sa.Column("name", Text(), primary_key=True),
            sa.Column("mark", sa.BigInteger, nullable=False),
        )
        self.identity_table = sa.Table(
            f"{prefix}identity",
            metadata,
            sa.Column("one", sa.Integer, primary_key=True, autoincrement=False),  # always 1
            sa.Column("identity", sa.String(32), nullable=False),
        )
        self.metadata = metadata

    def schema_in(self, conn: Connection) -> bool:
        """Whether every table is in the database ``conn`` reaches (one query), and
        current (``check_current``)."""
        if missing_tables(conn, self.metadata):
            return False
        self.check_current(conn)
        return True

    def check_current(self, conn: Connection) -> None:
        """``ConfigurationError`` if the counters table was made by a development version
        of shardkit (0.1.0 before its release) whose counters had no incarnations: its
        tables cannot be used, nor changed in place."""
        table = self.counters_table
        if "incarnation" not in column_names(conn, table):
            raise ConfigurationError(
                f"the table {table.name} in {self.url} was made by a development version of "
                "shardkit (before 0.1.0) and cannot be used: drop the prefix's tables, or "
                "choose another prefix"
            )


# Not SQLAlchemy's ``has_table`` nor ``get_columns``: its PostgreSQL dialect keeps their
# queries in caches of 128 entries keyed by the dialect, each engine's own, so that each
# engine opened and closed would be kept (about 830 objects) until 128 others pushed it out.


def missing_tables(conn: Connection, metadata: sa.MetaData) -> list[sa.Table]:
    """``metadata``'s tables that the database ``conn`` reaches (its default schema)
    lacks, in dependency order: one query."""
    present = set(sa.inspect(conn).get_table_names())
    return [table for table in metadata.sorted_tables if table.name not in present]


def column_names(conn: Connection, table: sa.Table) -> set[str]:
    """The names of the columns ``table`` has in the database ``conn`` reaches: one
    query, which reads no row."""
    query = sa.select(sa.text("*")).select_from(sa.table(table.name, schema=table.schema))
    return set(conn.execute(query.where(sa.false())).keys())


__all__ = ["Tables", "column_names", "missing_tables"]
