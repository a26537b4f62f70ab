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
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from shardkit.errors import ConfigurationError
from shardkit.mapper.keys import Key, KeyRange

_COMPARE = {"lo": operator.ge, "hi": operator.lt, "after": operator.gt}


@dataclass(frozen=True)
class Sample:
    """Split points drawn from the data: ``drawn`` keys were taken at random from a
    range, and ``keys`` are the ``points``-quantiles of those, in key order (the
    database's): the keys of rank ``ceil(k * drawn / points)`` for k = 1…points, each
    once, so the largest drawn key is last and, when ``drawn <= points``, every drawn key
    is there. Key ``i`` therefore has about ``(i + 1) * drawn / len(keys)`` drawn keys at
    or below it.

    ``rows`` is how many rows the sampled range holds: ``drawn`` when fewer than the
    ``size`` asked for were drawn (every row was), else an estimate from the draw, or None
    if the source cannot tell."""

    keys: Sequence[Key]
    drawn: int
    rows: int | None = None


@runtime_checkable
class Source(Protocol):
    """Rows to visit. Every method reads through the connection it is given (in a
    transactional job, the connection of the transaction that commits the page)."""

    def page(self, conn: Connection, rng: KeyRange, after: Key | None, limit: int) -> list[Any]:
        """Up to ``limit`` rows of ``rng`` with keys above ``after``, in key order; more
        only when its last key is held by several rows (equal in the database's order):
        a page ends after all of them, as the next starts above its last key."""

    def key_of(self, row: Any) -> Key:
        """The key of a row returned by ``page``."""

    def sample(
        self, conn: Connection, rng: KeyRange, after: Key | None, size: int, points: int
    ) -> Sample | None:
        """Draw up to ``size`` keys of ``rng`` above ``after`` at random (all of them when
        fewer exist) and return their ``points``-quantiles (see ``Sample``). Only those
        travel: a database computes them where the keys are. None if this source cannot
        sample; the mapper then splits between the real ``bounds`` by key arithmetic."""

    def bounds(self, conn: Connection, rng: KeyRange, after: Key | None) -> tuple[Key, Key] | None:
        """The smallest and largest key of ``rng`` above ``after``; None if there is none."""

    def count(self, conn: Connection) -> int:
        """How many rows the source has (for the progress estimate)."""

    def portable(self) -> dict[str, Any] | None:
        """A JSON description from which ``TableSource.load`` rebuilds this source in
        another process, or None (the job then carries it pickled, signed)."""


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
        # Statements by shape (see _edges), built once.
        self._pages: dict[tuple[str, ...], sa.Select[Any]] = {}
        self._samples: dict[tuple[str, tuple[str, ...]], sa.Select[Any]] = {}
        self._ties: sa.Select[Any] | None = None

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

    def page(
        self, conn: Connection, rng: KeyRange, after: Key | None, limit: int
    ) -> list[RowMapping]:
        edges, params = self._edges(rng, after)
        statement = self._pages.get(edges)
        if statement is None:
            statement = self._pages[edges] = (
                sa.select(self._from)
                .where(*self._where(edges))
                .order_by(*self._columns)
                .limit(sa.bindparam("shardkit_limit", type_=sa.Integer))
            )
        params["shardkit_limit"] = limit
        rows = list(conn.execute(statement, params).mappings().all())
        if len(rows) == limit and _may_tie(self.key_of(rows[-1])):
            return self._with_ties(conn, rows)
        return rows

    def _with_ties(self, conn: Connection, rows: list[RowMapping]) -> list[RowMapping]:
        """A full page, its end moved past every row whose key equals its last key in
        the database's order: read them, and replace the page's rows of the same exact
        keys (its tail) with them. One index probe; usually the last row alone."""
        if self._ties is None:
            self._ties = sa.select(self._from).where(self._key_expr() == self._bound("tie"))
        last = self._params("tie", self.key_of(rows[-1]))
        tail = conn.execute(self._ties, last).mappings().all()
        keys = {self.key_of(row) for row in tail}
        return [row for row in rows if self.key_of(row) not in keys] + list(tail)

    def key_of(self, row: Any) -> Key:
        if len(self.key) == 1:
            return row[self.key[0]]  # type: ignore[no-any-return]
        return tuple(row[name] for name in self.key)

    def sample(
        self, conn: Connection, rng: KeyRange, after: Key | None, size: int, points: int
    ) -> Sample:
        edges, params = self._edges(rng, after)
        shape = (conn.dialect.name, edges)
        statement = self._samples.get(shape)
        if statement is None:
            statement = self._samples[shape] = self._sample_statement(*shape)
        params.update(shardkit_size=size, shardkit_points=points)
        rows = conn.execute(statement, params).all()
        if not rows:
            return Sample([], 0, 0)
        n = len(self.key)
        keys = [row[0] for row in rows] if n == 1 else [tuple(row[:n]) for row in rows]
        drawn, top = rows[0][n], rows[0][n + 1]
        # The largest of the ``size`` smallest of N uniform draws is about size / N, so
        # (size - 1) / top estimates N (within about 1 / sqrt(size)).
        total = drawn if drawn < size else max(drawn, round((size - 1) / max(top, 1e-12)))
        return Sample(keys, drawn, total)

    def _sample_statement(self, dialect: str, edges: tuple[str, ...]) -> sa.Select[Any]:
        # ORDER BY a random draw reads the rest of the range once (a top-N sort): the
        # price of split points that follow the data, however skewed. The rank r of a
        # quantile k * drawn / points (rounded up) is the one whose r * points passes a
        # multiple of drawn: (r * points) % drawn < points, in integers on every database.
        uniform: sa.ColumnElement[Any]
        if dialect in ("mysql", "mariadb"):
            uniform = sa.func.rand()
        elif dialect == "sqlite":  # random() is a 64-bit integer there
            uniform = sa.func.random() / sa.literal(2.0**64) + sa.literal(0.5)
        else:
            uniform = sa.func.random()
        draw = uniform.label("shardkit_draw")
        picked = (
            sa.select(*self._columns, draw)
            .where(*self._where(edges))
            .order_by(draw)
            .limit(sa.bindparam("shardkit_size", type_=sa.Integer))
            .subquery("shardkit_sample")
        )
        keys = [picked.c[name] for name in self.key]
        ranked = sa.select(
            *keys,
            sa.func.row_number().over(order_by=keys).label("shardkit_rank"),
            sa.func.count().over().label("shardkit_drawn"),
            sa.func.max(picked.c.shardkit_draw).over().label("shardkit_top"),
        ).subquery("shardkit_ranked")
        columns = [ranked.c[name] for name in self.key]
        rank, drawn = ranked.c.shardkit_rank, ranked.c.shardkit_drawn
        every = sa.bindparam("shardkit_points", type_=sa.Integer)
        return (
            sa.select(*columns, drawn, ranked.c.shardkit_top)
            .where(rank * every % drawn < every)
            .order_by(*columns)
        )

    def bounds(self, conn: Connection, rng: KeyRange, after: Key | None) -> tuple[Key, Key] | None:
        edges, params = self._edges(rng, after)

        def edge(descending: bool) -> Key | None:
            order = [c.desc() for c in self._columns] if descending else self._columns
            row = conn.execute(
                sa.select(*self._columns).where(*self._where(edges)).order_by(*order).limit(1),
                params,
            ).first()
            return None if row is None else self.key_of(row._mapping)

        low = edge(descending=False)
        high = edge(descending=True)
        return None if low is None or high is None else (low, high)

    def count(self, conn: Connection) -> int:
        statement = sa.select(sa.func.count()).select_from(self._from)
        return int(conn.execute(statement).scalar_one())

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


def _may_tie(key: Key) -> bool:
    """Whether the database may hold ``key`` equal to another value of its type: strings
    (or composite keys with one), under a collation; ints, bytes and UUIDs are equal only
    to themselves."""
    if isinstance(key, tuple):
        return any(isinstance(part, str) for part in key)
    return isinstance(key, str)


def as_source(obj: Any, key: str | Sequence[str] | None) -> Source:
    """``obj`` as a source: a ``Source`` as it is; a Table or Select, or a Django
    queryset (``shardkit.contrib.django.source.QuerySetSource``), wrapped."""
    if isinstance(obj, (sa.Table, sa.Select)):
        return TableSource(obj, key)
    if isinstance(obj, Source):
        return obj
    django_models = sys.modules.get("django.db.models")  # loaded if obj is a queryset
    if django_models is not None and isinstance(obj, django_models.QuerySet):
        from shardkit.contrib.django.source import QuerySetSource

        return QuerySetSource(obj, key)  # type: ignore[arg-type]
    raise ConfigurationError(
        "a source is a SQLAlchemy Table or Select, a Django queryset, or a shardkit "
        f"Source: {obj!r}"
    )


__all__ = ["Sample", "Source", "TableSource", "as_source"]
