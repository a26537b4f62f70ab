"""A Django queryset as a mapping source: ``kit().map(Account.objects.filter(active=True), fn)``.

The job's pages are the queryset's rows, read in key order by the ORM with ``key > after``
and ``LIMIT`` (never ``OFFSET``), with the queryset's filters kept: model instances, or
for a ``values()`` / ``values_list()`` queryset dicts or tuples, which spare building an
instance (an object the garbage collector tracks while its page is held) per row. The
queryset must be on the database of the app's kit (``SHARDKIT['STORE']``): its reads then
run on the connection of the page's transaction, so in a transactional job ORM writes
made by ``fn`` commit with the checkpoint, exactly once.
"""

from __future__ import annotations

import json
import operator
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from django.apps import apps
from django.db import connections, models
from django.db.models.query import (
    FlatValuesListIterable,
    ModelIterable,
    ValuesIterable,
    ValuesListIterable,
)
from sqlalchemy.engine import Connection

from shardkit.errors import ConfigurationError
from shardkit.mapper.keys import Key, KeyRange
from shardkit.mapper.source import Statistics

from .conf import database
from .store import DjangoConnection


class QuerySetSource:
    """A queryset keyed by one unique field (default: the primary key). A ``values()``
    queryset's rows are dicts, a ``values_list()`` one's tuples (or its key alone, with
    ``flat=True``): the key must be among their fields."""

    def __init__(self, queryset: models.QuerySet[Any], key: str | None = None) -> None:
        if key is not None and not isinstance(key, str):
            raise ConfigurationError("a queryset is mapped by one unique field: key='id'")
        meta = queryset.model._meta
        field = meta.pk if key in (None, "pk") else meta.get_field(key)
        if not (field.primary_key or field.unique):
            raise ConfigurationError(
                f"{meta.label}.{field.name} is not unique: map by a unique key"
            )
        # Deliberately alike in shape to CountingQuerySet.update's checks, with the
        # errors of mapping.
        if queryset.query.is_sliced:
            raise ConfigurationError("a sliced queryset cannot be mapped: filter it instead")
        if queryset.db != database():
            raise ConfigurationError(
                f"the queryset reads database {queryset.db!r}; map querysets of the kit's "
                f"database {database()!r} (SHARDKIT['STORE']), whose transactions it shares"
            )
        self.queryset = queryset.order_by()
        self.key = field.attname
        self._key_of = _key_reader(queryset, field)

    def __repr__(self) -> str:
        return f"<QuerySetSource {self.queryset.model._meta.label} key={self.key}>"

    def __reduce__(self) -> tuple[Any, ...]:
        # A queryset pickles its evaluated rows; its query pickles as the query, and the
        # shape of its rows (Django keeps it beside the query) goes with it.
        queryset = self.queryset
        query = pickle.dumps(queryset.query)
        shape = (queryset._iterable_class, queryset._fields)
        return (_rebuild, (queryset.model._meta.label, query, queryset.db, self.key, shape))

    def _within(self, conn: Connection, rng: KeyRange, after: Key | None) -> models.QuerySet[Any]:
        """The queryset's rows in ``rng`` above ``after``, read on ``conn``'s connection."""
        dbapi = conn.connection.dbapi_connection
        if not isinstance(dbapi, DjangoConnection) or dbapi.alias != self.queryset.db:
            raise ConfigurationError(
                "a queryset is mapped by the Django app's kit: shardkit.contrib.django.kit()"
            )
        dbapi.begin()  # a page read in a transaction, and fn's ORM writes, are part of it
        lookups = {}
        if rng.lo is not None:
            lookups[f"{self.key}__gte"] = rng.lo
        if rng.hi is not None:
            lookups[f"{self.key}__lt"] = rng.hi
        if after is not None:
            lookups[f"{self.key}__gt"] = after
        within: models.QuerySet[Any] = self.queryset.filter(**lookups)
        return within

    def page(self, conn: Connection, rng: KeyRange, after: Key | None, limit: int) -> list[Any]:
        return list(self._within(conn, rng, after).order_by(self.key)[:limit])

    def key_of(self, row: Any) -> Key:
        return self._key_of(row)

    def bounds(self, conn: Connection, rng: KeyRange, after: Key | None) -> tuple[Key, Key] | None:
        edges = self._within(conn, rng, after).aggregate(
            low=models.Min(self.key), high=models.Max(self.key)
        )
        return None if edges["low"] is None else (edges["low"], edges["high"])

    def statistics(self, conn: Connection) -> Statistics:
        """The planner's row estimate on PostgreSQL (``queryset.explain``); elsewhere a
        count. No histogram: a queryset's filters make the table's another's."""
        if connections[self.queryset.db].vendor == "postgresql":
            plan = json.loads(self.queryset.explain(format="json"))
            return Statistics(int(plan[0]["Plan"]["Plan Rows"]))
        return Statistics(self.queryset.count())

    def portable(self) -> None:
        return None  # a queryset's filters travel pickled, signed with the kit's secret


def _key_reader(
    queryset: models.QuerySet[Any], field: models.Field[Any, Any]
) -> Callable[[Any], Key]:
    """How the key is read from a row of ``queryset``: an instance's attribute, a dict's
    item, a tuple's item, or a flat ``values_list``'s row itself. ``ConfigurationError``
    if its rows do not hold the key."""
    shape = queryset._iterable_class
    fields: tuple[str, ...] = queryset._fields or ()  # type: ignore[attr-defined]
    if issubclass(shape, ModelIterable):
        return operator.attrgetter(field.attname)
    if issubclass(shape, ValuesIterable) and not fields:
        return operator.itemgetter(field.attname)  # values(): every field, by attname
    names = {field.name, field.attname} | ({"pk"} if field.primary_key else set())
    held = [i for i, name in enumerate(fields) if name in names]
    if held and issubclass(shape, ValuesIterable):
        return operator.itemgetter(fields[held[0]])
    if held and issubclass(shape, FlatValuesListIterable):
        return lambda row: row
    if held and issubclass(shape, ValuesListIterable):
        return operator.itemgetter(held[0])
    raise ConfigurationError(
        f"the queryset's rows must hold its key {field.name!r}: name it among the fields "
        "of values() or values_list()"
    )


def _rebuild(
    model: str, query: bytes, db: str, key: str, shape: tuple[type[Any], Any]
) -> QuerySetSource:
    queryset = apps.get_model(model)._base_manager.using(db).all()
    queryset.query = pickle.loads(query)  # signed with the job's payload
    queryset._iterable_class, queryset._fields = shape
    return QuerySetSource(queryset, key)


def adapt_queryset(obj: object, key: str | Sequence[str] | None) -> QuerySetSource | None:
    """The mapper's adapter of querysets (registered when the app is ready)."""
    if not isinstance(obj, models.QuerySet):
        return None
    return QuerySetSource(obj, key)  # type: ignore[arg-type]  # it refuses a sequence


__all__ = ["QuerySetSource", "adapt_queryset"]
