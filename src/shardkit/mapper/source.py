"""Sources: what a mapping job visits, one page of rows at a time, ordered by a key.

A source reads inside a ``KeyRange`` and after a checkpoint key (``key > after``), always
by key order and ``LIMIT``, never ``OFFSET``: a page costs an index seek and the page,
wherever it is. Its key must be unique (a primary key, or a composite key such as
``("created_at", "id")``). Anything implementing ``Source`` is one; SQLAlchemy tables and
selects are wrapped in a ``TableSource``.

Every comparison of keys is the database's, in its order for the key (a string column's
collation), never Python's: ranges and checkpoints are conditions in the statements, and
keys come back in its ``ORDER BY``. Under a collation that holds distinct strings equal
('a' and 'A' case-insensitively, 'a' and 'a ' where trailing spaces are padding), such
strings are one key: a page that ends on one holds every row of it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import ClauseElement, Executable

from shardkit.errors import ConfigurationError
from shardkit.mapper.job import Records
from shardkit.mapper.keys import Key, KeyRange
from shardkit.store.sql.dialect import Compiled

_COMPARE = {"lo": operator.ge, "hi": operator.lt, "after": operator.gt}


@dataclass(frozen=True)
class Statistics:
    """What the database already knows of a source's keys, read from its catalog or its
    planner without reading the source's rows.

    ``rows`` is the planner's estimate of the rows the source holds (None if it cannot
    tell); ``bounds`` are keys that cut them into about equal parts — an equi-depth
    histogram of the key, ascending in the database's order as of its last statistics
    (empty when it keeps none). Both may be stale: the mapper only aims with them."""

    rows: int | None
    bounds: Sequence[Key] = ()


@runtime_checkable
class Source(Protocol):
    """Rows to visit. Every method reads through the connection it is given (in a
    transactional job, the connection of the transaction that commits the page)."""

    def page(self, conn: Connection, rng: KeyRange, after: Key | None, limit: int) -> Sequence[Any]:
        """Up to ``limit`` rows of ``rng`` with keys above ``after``, in key order; more
        only when its last key is held by several rows (equal in the database's order):
        a page ends after all of them, as the next starts above its last key."""

    def key_of(self, row: Any) -> Key:
        """The key of a row returned by ``page``."""

    def bounds(self, conn: Connection, rng: KeyRange, after: Key | None) -> tuple[Key, Key] | None:
        """The smallest and largest key of ``rng`` above ``after``; None if there is none."""

    def portable(self) -> dict[str, Any] | None:
        """A JSON description from which ``TableSource.load`` rebuilds this source in
        another process, or None (the job then carries it pickled, signed)."""


@runtime_checkable
class StatisticsSource(Protocol):
    """A source that can tell what its database knows of it (an optional ability): the
    mapper then plans a job's splits and its progress estimate from it. Without it,
    ranges are split by key arithmetic between their real bounds, and a job has no
    estimate."""

    def statistics(self, conn: Connection) -> Statistics:
        """The database's statistics of this source, read without reading its rows: a
        few catalog rows and a query plan, whatever the source's size."""
        ...


class TableSource:
    """A SQLAlchemy ``Table``, or a ``Select`` whose filters and joins are kept, keyed by
    one column or several (compared as a row value)."""

    def __init__(self, selectable: sa.Table | sa.Select[Any], key: str | Sequence[str] | None):
        if isinstance(selectable, sa.Table):
            self._from: sa.Table | sa.Subquery = selectable
            default = [column.name for column in selectable.primary_key.columns]
        elif isinstance(selectable, sa.Select):
            self._from = selectable.subquery("shardkit_source")
            default = []
        else:
            raise ConfigurationError(
                f"a source is a SQLAlchemy Table or Select, or a shardkit Source: {selectable!r}"
            )
        self.selectable = selectable
        names = [key] if isinstance(key, str) else list(key or default)
        if not names:
            raise ConfigurationError("name the key column(s) to map by: key='id'")
        unknown = [name for name in names if name not in self._from.c]
        if unknown:
            raise ConfigurationError(f"the source has no column {unknown[0]!r} to key on")
        self.key = tuple(names)
        self._columns = [self._from.c[name] for name in names]
        # Where the key's columns are in a page's rows (all the source's columns).
        self._positions = [list(self._from.c.keys()).index(name) for name in names]
        # Page statements by dialect and shape (see _edges), built once.
        self._pages: dict[tuple[sa.Dialect, tuple[str, ...]], _PageQuery] = {}
        self._ties: sa.Select[Any] | None = None
        # A key the table declares unique (its primary key, a unique constraint or
        # index) holds no two rows equal under its collation: no page ends inside ties.
        self._unique = isinstance(selectable, sa.Table) and _declared_unique(selectable, names)

    def __repr__(self) -> str:
        name = getattr(self.selectable, "name", "select")
        return f"<TableSource {name} key={','.join(self.key)}>"

    def _key_expr(self) -> Any:
        return self._columns[0] if len(self._columns) == 1 else sa.tuple_(*self._columns)

    def _bound(self, edge: str) -> Any:
        """The key as bind parameters ``shardkit_{edge}_{i}``, one per key column."""
        params = [
            sa.bindparam(f"shardkit_{edge}_{i}", type_=column.type)
            for i, column in enumerate(self._columns)
        ]
        return params[0] if len(params) == 1 else sa.tuple_(*params)

    def _where(self, edges: tuple[str, ...]) -> list[Any]:
        """The conditions of a range and checkpoint that have ``edges`` (see ``_edges``)."""
        key = self._key_expr()
        return [_COMPARE[edge](key, self._bound(edge)) for edge in edges]

    def _edges(self, rng: KeyRange, after: Key | None) -> tuple[tuple[str, ...], dict[str, Any]]:
        """Which of ``lo``, ``hi`` and ``after`` are set, and their bind parameters: a
        range's statements differ only by the former, so each shape is built once."""
        edges: list[str] = []
        params: dict[str, Any] = {}
        for edge, key in (("lo", rng.lo), ("hi", rng.hi), ("after", after)):
            if key is not None:
                edges.append(edge)
                params.update(self._params(edge, key))
        return tuple(edges), params

    def _params(self, edge: str, key: Key) -> dict[str, Any]:
        """``key`` as the values of the bind parameters of ``_bound(edge)``."""
        if len(self._columns) == 1:
            return {f"shardkit_{edge}_0": key}
        if isinstance(key, tuple) and len(key) == len(self._columns):
            return {f"shardkit_{edge}_{i}": value for i, value in enumerate(key)}
        raise ConfigurationError(f"a key of {self.key} must be a tuple: {key!r}")

    def page(self, conn: Connection, rng: KeyRange, after: Key | None, limit: int) -> Records:
        edges, params = self._edges(rng, after)
        query = self._pages.get((conn.dialect, edges))
        if query is None:
            statement = (
                sa.select(self._from)
                .where(*self._where(edges))
                .order_by(*self._columns)
                .limit(sa.bindparam("shardkit_limit", type_=sa.Integer))
            )
            query = self._pages[conn.dialect, edges] = _PageQuery(statement, conn.dialect)
        params["shardkit_limit"] = limit
        rows = query.read(conn, params)
        if len(rows) == limit and not self._unique and _may_tie(self.key_of(rows[-1])):
            return self._with_ties(conn, rows)
        return rows

    def _with_ties(self, conn: Connection, rows: Records) -> Records:
        """A full page, its end moved past every row whose key equals its last key in
        the database's order: read them, and replace the page's rows of the same exact
        keys (its tail) with them. One index probe; usually the last row alone."""
        if self._ties is None:
            self._ties = sa.select(self._from).where(self._key_expr() == self._bound("tie"))
        last = self._params("tie", self.key_of(rows[-1]))
        tail = conn.execute(self._ties, last).all()
        keys = {self.key_of(row) for row in tail}
        kept = (tuple(row) for row in rows if self.key_of(row) not in keys)
        return rows.again([*kept, *map(tuple, tail)])

    def key_of(self, row: Any) -> Key:
        if len(self._positions) == 1:
            return row[self._positions[0]]  # type: ignore[no-any-return]
        return tuple(row[i] for i in self._positions)

    def bounds(self, conn: Connection, rng: KeyRange, after: Key | None) -> tuple[Key, Key] | None:
        edges, params = self._edges(rng, after)

        def edge(descending: bool) -> Key | None:
            order = [c.desc() for c in self._columns] if descending else self._columns
            row = conn.execute(
                sa.select(*self._columns).where(*self._where(edges)).order_by(*order).limit(1),
                params,
            ).first()
            if row is None:
                return None
            return row[0] if len(self._columns) == 1 else tuple(row)

        low = edge(descending=False)
        high = edge(descending=True)
        return None if low is None or high is None else (low, high)

    def statistics(self, conn: Connection) -> Statistics:
        """PostgreSQL: the planner's row estimate (``EXPLAIN``) and, for a table keyed by
        one column, that column's histogram (``pg_stats.histogram_bounds``, kept by
        ``ANALYZE`` and autovacuum). MySQL and MariaDB: the planner's row estimate.
        SQLite, which keeps no estimate: a count of the rows (a local file's)."""
        dialect = conn.dialect.name
        if dialect == "sqlite":
            statement = sa.select(sa.func.count()).select_from(self._from)
            return Statistics(int(conn.execute(statement).scalar_one()))
        everything = sa.select(*self._columns)
        if dialect == "postgresql":
            plan = conn.execute(Explain(everything, "(FORMAT JSON) ")).scalar_one()
            return Statistics(int(plan[0]["Plan"]["Plan Rows"]), self._histogram(conn))
        if dialect in ("mysql", "mariadb"):
            rows = conn.execute(Explain(everything)).mappings().first()
            found = None if rows is None else rows.get("rows")
            return Statistics(None if found is None else int(found))
        return Statistics(None)

    def _histogram(self, conn: Connection) -> list[Key]:
        """The key's equi-depth histogram bounds in PostgreSQL's statistics: a table's one
        key column only (a select's filters make the table's histogram another's)."""
        from sqlalchemy.dialects import postgresql  # read on PostgreSQL only

        if not isinstance(self._from, sa.Table) or len(self._columns) != 1:
            return []
        column = self._columns[0]
        if isinstance(column.type, sa.types.NullType):  # no type to read the bounds as
            return []
        name = conn.dialect.identifier_preparer.format_table(self._from)
        stats = sa.table(
            "pg_stats",
            sa.column("schemaname"),
            sa.column("tablename"),
            sa.column("attname"),
            sa.column("histogram_bounds"),
        )
        relation = (
            sa.text(
                "SELECT n.nspname, c.relname FROM pg_class AS c JOIN pg_namespace AS n "
                "ON n.oid = c.relnamespace WHERE c.oid = to_regclass(:shardkit_name)"
            )
            .columns(sa.column("nspname"), sa.column("relname"))
            .subquery()
        )
        bounds = sa.cast(sa.cast(stats.c.histogram_bounds, sa.Text), postgresql.ARRAY(column.type))
        statement = sa.select(bounds).where(
            stats.c.schemaname == relation.c.nspname,
            stats.c.tablename == relation.c.relname,
            stats.c.attname == column.name,
        )
        found = conn.execute(statement, {"shardkit_name": name}).scalar()
        return list(found or [])

    def portable(self) -> dict[str, Any] | None:
        if not isinstance(self.selectable, sa.Table):
            return None
        return {"table": self.selectable.name, "schema": self.selectable.schema, "key": self.key}

    @classmethod
    def load(cls, description: dict[str, Any], engine: sa.Engine) -> TableSource:
        """Rebuild a table source from ``portable()``, reflecting the table."""
        table = sa.Table(
            description["table"],
            sa.MetaData(),
            schema=description["schema"],
            autoload_with=engine,
        )
        return cls(table, description["key"])


class _PageQuery:
    """A page statement of a table source on one dialect. Its pages are read through
    SQLAlchemy until one holds rows; from then on, where nothing converts values on
    their way to or from the driver (no type's bind or result processing, no parameter
    expanded at execution), on a cursor of the DB-API connection alone
    (``Compiled.fetch``: no SQLAlchemy execution, no row made but those fn reads), each
    page's rows made as that first page's are. Thread-safe."""

    __slots__ = ("direct", "like", "statement")

    def __init__(self, statement: sa.Select[Any], dialect: sa.Dialect) -> None:
        self.statement = statement
        compiled = Compiled(statement, dialect)
        self.direct = compiled if compiled.plain else None
        self.like: Records | None = None  # makes rows as the first page read did

    def read(self, conn: Connection, params: dict[str, Any]) -> Records:
        direct, like = self.direct, self.like
        if direct is not None and like is not None:
            return like.again(direct.fetch(conn, params))
        result = conn.execute(self.statement, params)
        described = None if direct is None else result.cursor.description
        rows = Records.read(result, self.statement.selected_columns)
        if described is not None and rows:
            if _converts(self.statement, described, conn.dialect):
                self.direct = None
            else:
                self.like = rows.again([])
        return rows


def _converts(statement: sa.Select[Any], described: Sequence[Any], dialect: sa.Dialect) -> bool:
    """Whether a result of ``statement`` converts a column's values from the driver's (a
    result processor of its type for the type code the cursor ``described``)."""
    columns = statement.selected_columns
    return len(columns) != len(described) or any(
        column.type.dialect_impl(dialect).result_processor(dialect, description[1]) is not None
        for column, description in zip(columns, described, strict=True)
    )


class Explain(Executable, ClauseElement):
    """``EXPLAIN`` of a statement, its parameters bound as the statement's own."""

    inherit_cache = False  # made once per job and process: not worth a cache key

    def __init__(self, statement: sa.Select[Any], prefix: str = "") -> None:
        self.statement = statement
        self.prefix = prefix


@compiles(Explain)
def _explain(element: Explain, compiler: Any, **kw: Any) -> str:
    return f"EXPLAIN {element.prefix}{compiler.process(element.statement, **kw)}"


def _declared_unique(table: sa.Table, names: Sequence[str]) -> bool:
    """Whether ``table`` declares the columns ``names`` unique together."""
    wanted = set(names)
    declared = [{c.name for c in table.primary_key.columns}]
    declared += [
        {c.name for c in constraint.columns}
        for constraint in table.constraints
        if isinstance(constraint, sa.UniqueConstraint)
    ]
    declared += [
        {c.name for c in index.columns}
        for index in table.indexes
        if index.unique
        and not any(  # a partial index holds some rows only
            name.endswith("_where") and value is not None
            for name, value in index.dialect_kwargs.items()
        )
    ]
    declared += [{column.name} for column in table.columns if column.unique]
    return wanted in declared


def _may_tie(key: Key) -> bool:
    """Whether the database may hold ``key`` equal to another value of its type: strings
    (or composite keys with one), under a collation; ints, bytes and UUIDs are equal only
    to themselves."""
    if isinstance(key, tuple):
        return any(isinstance(part, str) for part in key)
    return isinstance(key, str)


SourceAdapter = Callable[[Any, str | Sequence[str] | None], Source | None]
"""Wraps an object of an integration's own as a ``Source`` (given the ``key`` of
``kit.map``), or returns None for any other object."""

_adapters: list[SourceAdapter] = []


def adapt_sources(adapter: SourceAdapter) -> SourceAdapter:
    """Register ``adapter`` (once): ``as_source`` asks it to wrap what is neither a
    SQLAlchemy ``Table`` or ``Select`` nor a ``Source``. An integration registers its
    own (the Django app its querysets, when Django is ready), so that the mapper knows
    none of them. Returns ``adapter``."""
    if adapter not in _adapters:
        _adapters.append(adapter)
    return adapter


def as_source(obj: Any, key: str | Sequence[str] | None) -> Source:
    """``obj`` as a source: a ``Source`` as it is; a Table or Select wrapped; anything
    else as a registered adapter wraps it (a Django queryset, once the Django app is
    ready)."""
    if isinstance(obj, (sa.Table, sa.Select)):
        return TableSource(obj, key)
    if isinstance(obj, Source):
        return obj
    for adapter in _adapters:
        source = adapter(obj, key)
        if source is not None:
            return source
    hint = ""
    if type(obj).__module__.startswith("django."):
        hint = " (a Django queryset needs 'shardkit.contrib.django' in INSTALLED_APPS)"
    raise ConfigurationError(
        "a source is a SQLAlchemy Table or Select, a Django queryset, or a shardkit "
        f"Source: {obj!r}{hint}"
    )


__all__ = [
    "Source",
    "SourceAdapter",
    "Statistics",
    "StatisticsSource",
    "TableSource",
    "adapt_sources",
    "as_source",
]
