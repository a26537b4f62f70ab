"""The SQL store's tables (``Tables``): their definitions for a prefix, and the checks
and additions that tables made by an earlier version need."""

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
    (the store's identity, one row), and the mapper's ledger, ``{prefix}jobs`` and
    ``{prefix}ranges``."""

    url: str

    def __init__(self, prefix: str) -> None:
        metadata = sa.MetaData()
        self.counters_table = sa.Table(
            f"{prefix}counters",
            metadata,
            sa.Column("name", Text(), primary_key=True),
            sa.Column("kind", sa.String(16), nullable=False),
            sa.Column("shards", sa.Integer, nullable=False),
            sa.Column("incarnation", sa.BigInteger, nullable=False),
        )
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

    def schema_in(self, conn: Connection) -> bool:
        """Whether every table is in the database ``conn`` reaches (one query), and
        current (``check_current``)."""
        present = set(sa.inspect(conn).get_table_names())
        if not all(table.name in present for table in self.metadata.sorted_tables):
            return False
        self.check_current(conn)
        return True

    def check_current(self, conn: Connection) -> None:
        """``ConfigurationError`` if the counters table was made by a development version
        of shardkit (0.1.0 before its release) whose counters had no incarnations: its
        tables cannot be used, nor changed in place."""
        table = self.counters_table
        have = {column["name"] for column in sa.inspect(conn).get_columns(table.name)}
        if "incarnation" not in have:
            raise ConfigurationError(
                f"the table {table.name} in {self.url} was made by a development version of "
                "shardkit (before 0.1.0) and cannot be used: drop the prefix's tables, or "
                "choose another prefix"
            )

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


__all__ = ["Tables"]
