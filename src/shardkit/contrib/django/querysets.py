"""``CountingQuerySet``: the queryset whose ``update()`` routes counting updates of
``ShardedCount`` fields to their counters and whose ``with_counts()`` reads a page's
counts in one query; the system check that models with counts have its manager."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, Generic, TypeVar

from django.core.exceptions import FieldError
from django.db import DatabaseError, connections, models, transaction
from django.db.models.expressions import CombinedExpression, Value
from django.db.models.lookups import Exact
from django.db.models.query import ModelIterable

from shardkit.counters import ShardedCounter
from shardkit.validation import check_delta

from .conf import database, kit
from .counts import NotACountingUpdate, ShardedCount, counts_of, load_counts
from .sightings import sightings
from .statements import counted_names, counting_sql, writer_ticket
from .store import DjangoStore

_M = TypeVar("_M", bound=models.Model)


class CountingQuerySet(models.QuerySet[_M], Generic[_M]):
    """A queryset whose ``update()`` routes counting updates of ``ShardedCount`` fields
    to their counters, and whose ``with_counts()`` reads a page's counts in one query."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._count_fields: tuple[str, ...] = ()

    def _clone(self) -> CountingQuerySet[_M]:
        clone: CountingQuerySet[_M] = super()._clone()  # type: ignore[misc]
        clone._count_fields = self._count_fields
        return clone

    def filter(self, *args: Any, **kwargs: Any) -> CountingQuerySet[_M]:
        """Django's ``filter``. A filter on the primary key being one value (checked now,
        as Django checks it) is added to the query when the query is first needed, as
        Django's related managers add theirs: a counting update by key never builds it."""
        if _pk_filter(self.model, args, kwargs) is not None:
            self._defer_next_filter = True
        filtered: CountingQuerySet[_M] = super().filter(*args, **kwargs)
        return filtered

    def update(self, **kwargs: Any) -> int:
        """Django's ``update``, where a count may be set to ``F(count) + n`` or
        ``F(count) - n`` only: each matched object's counter moves by ``n`` in the same
        transaction as the other fields' update (a buffered count when it commits).
        Returns the number of objects matched. ``NotACountingUpdate`` for any other
        value of a count, before anything is written.

        On a model with an integer primary key, the first sharded count is written by
        the statement that finds the matched objects (one round trip; the other fields
        take one more); a buffered count filtered by its primary key alone takes that
        from the other fields' update, or from a read of the matched keys."""
        counts = counts_of(self.model)
        deltas = {
            name: _delta(counts[name], kwargs.pop(name)) for name in list(kwargs) if name in counts
        }
        if not deltas:
            return super().update(**kwargs)
        # Deliberately alike in shape to QuerySetSource's checks, with the errors of an
        # update (Django's own for a slice).
        query, deferred = self._pending()
        if query.is_sliced:  # a slice adds any filter not yet added
            raise TypeError("Cannot update a query once a slice has been taken.")
        db = self.db
        if db != database():
            raise NotACountingUpdate(
                f"counts live in database {database()!r} (SHARDKIT['STORE']); this update "
                f"runs on {db!r}, so they could not share its transaction"
            )
        found_by = None  # the sharded count whose statement finds the objects
        if isinstance(self.model._meta.pk, models.IntegerField):
            found_by = next((name for name in deltas if not counts[name].buffered), None)
        by_pk = self._by_pk(query, deferred)
        writes = sum(not counts[name].buffered for name in deltas) + bool(kwargs)
        # One statement or none that writes: no transaction of its own around it.
        single = writes == 0 or (writes == 1 and (found_by or by_pk) is not None)
        with contextlib.nullcontext() if single else transaction.atomic(using=db):
            if found_by is not None:
                pks = self._count_matched(db, counts[found_by], deltas[found_by], by_pk)
            elif by_pk is not None and kwargs:
                pks = [by_pk[0]] if self._base().filter(pk=by_pk[0]).update(**kwargs) else []
                kwargs = {}
            elif by_pk is not None:
                ttl = min(counts[name].exists_ttl for name in deltas)
                pks = [by_pk[0]] if self._exists(db, by_pk[0], ttl) else []
            else:
                # In key order: concurrent updates take their shard rows' locks in one order.
                pks = list(self.order_by("pk").values_list("pk", flat=True))
            if kwargs and pks:
                self._base().filter(pk__in=pks).update(**kwargs)
            for name, delta in deltas.items():
                if name != found_by:
                    for pk in pks:
                        counts[name].add(self.model, pk, delta)
        return len(pks)

    def _by_pk(
        self, query: Any, deferred: tuple[bool, Sequence[Any], dict[str, Any]] | None
    ) -> tuple[Any] | None:
        """``_pk_lookup`` of this queryset's query, read from the filter not yet added to
        it (``_pending()``) when that is the query's one filter."""
        if (
            deferred is not None
            and not deferred[0]
            and not (query.where.children or query.distinct)
        ):
            return _pk_filter(self.model, deferred[1], deferred[2])
        return _pk_lookup(self.query)

    def _pending(self) -> tuple[Any, tuple[bool, Sequence[Any], dict[str, Any]] | None]:
        """The query as it stands and the filter Django has not added to it yet (``negate,
        args, kwargs``): attributes of Django's queryset that its stubs do not declare."""
        state = vars(self)
        return state["_query"], state["_deferred_filter"]

    def _base(self) -> models.QuerySet[_M]:
        """The model's plain queryset on this one's database, for the other fields."""
        base: models.QuerySet[_M] = self.model._base_manager.using(self.db)
        return base

    def _count_matched(
        self, db: str, count: ShardedCount, delta: int, by_pk: tuple[Any] | None
    ) -> list[Any]:
        """Add ``delta`` to the sharded ``count`` of every object this queryset (on the
        database ``db``) matches, in one statement that finds them (in key order, so that
        concurrent updates take their shard rows' locks in one order) and upserts a shard
        row of each; return their keys. Each counter's cached value is moved when the
        transaction commits. Filtered by its key alone (``by_pk``), the statement is made
        once per model and count, not compiled from the queryset each time, and is given
        the shards of a counter this process holds open (``writing_shards``; a fixed
        count's at least, to which it grows the counter first) rather than reading them."""
        the_kit = kit()
        store = the_kit.store
        assert isinstance(store, DjangoStore)
        connection = connections[db]
        pk_field = self.model._meta.pk
        prefix = count.counter_name(self.model, "")
        ticket = writer_ticket(the_kit)
        auto = count.shards == "auto"
        created = 1 if auto else count.shards  # a new counter's shards
        tables = (store.shards_table.name, store.counters_table.name)
        if by_pk is not None:
            sql = counting_sql(db, tables, self.model, "count one")
            name = count.counter_name(self.model, by_pk[0])
            pk = pk_field.get_db_prep_value(by_pk[0], connection)
            # One this process holds gives its shards (grown first to a fixed count's),
            # not read by the statement.
            held = count.held(self.model, by_pk[0])
            known = held.writing_shards() if isinstance(held, ShardedCounter) else 0
            params = [name, ticket, known, name, created, delta, pk]
        else:
            matched = self.order_by("pk").values(shardkit_pk=models.F("pk"))
            select, selected = matched.query.get_compiler(db).as_sql()
            sql = counting_sql(db, tables, self.model, "count many")
            sql = sql.replace("{select}", select, 1)
            params = [prefix, ticket, prefix, created, delta, *selected]
        started = time.perf_counter()
        try:
            names = counted_names(connection, sql, params, one=by_pk is not None)
        except DatabaseError as exc:
            raise store._error(exc, f"adding to {self.model._meta.label}.{count.name}") from exc
        seconds = time.perf_counter() - started
        if by_pk is not None:
            pks = [by_pk[0]] if names else []
        else:
            pks = [pk_field.to_python(name[len(prefix) :]) for name in names]
        for pk in pks:
            counter = count.counter(self.model, pk)
            assert isinstance(counter, ShardedCounter)
            if by_pk is not None and auto:
                counter.wrote(seconds, ticket)  # one object's write: its counter may grow
            connection.on_commit(partial(counter.applied, delta), robust=True)
        return pks

    def _exists(self, db: str, pk: Any, ttl: float) -> bool:
        """Whether the object ``pk`` exists in ``db``: seen by this process in the last
        ``ttl`` seconds, or else read (one statement, made once per model; a sighting
        once the transaction commits)."""
        seen = None
        if ttl:
            seen = (db, self.model._meta.label_lower, self.model._meta.pk.to_python(pk))
            if sightings.within(seen, ttl):
                return True
        connection = connections[db]
        store = kit().store
        assert isinstance(store, DjangoStore)
        tables = (store.shards_table.name, store.counters_table.name)
        sql = counting_sql(db, tables, self.model, "exists")
        with connection.cursor() as cursor:
            cursor.execute(sql, [self.model._meta.pk.get_db_prep_value(pk, connection)])
            found = cursor.fetchone() is not None
        if found and seen is not None:
            connection.on_commit(partial(sightings.saw, seen))
        return found

    update.alters_data = True  # type: ignore[attr-defined]

    def with_counts(self, *names: str) -> CountingQuerySet[_M]:
        """This queryset, whose objects come with the values of the counts ``names``
        (default: all), read for all of them at once when it is evaluated: one store
        query for sharded counts (cached values first), one store and one cache read
        for buffered counts. ``obj.views.value()`` then returns the value read."""
        counts = counts_of(self.model)
        unknown = [name for name in names if name not in counts]
        if unknown:
            raise FieldError(f"{self.model.__name__} has no ShardedCount {unknown[0]!r}")
        clone: CountingQuerySet[_M] = self.all()
        clone._count_fields = tuple(dict.fromkeys((*self._count_fields, *(names or counts))))
        return clone

    def _fetch_all(self) -> None:
        fetching = self._result_cache is None
        super()._fetch_all()
        if fetching and self._count_fields and issubclass(self._iterable_class, ModelIterable):
            load_counts(self._result_cache or [], self._count_fields)


def check_managers(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[Any]:
    """Django system check (``shardkit.E001``): a model with counts whose default manager
    is not a ``CountingQuerySet``'s, so ``update(views=F("views") + 1)`` would fail."""
    from django.apps import apps
    from django.core import checks

    models_to_check = (
        apps.get_models()
        if app_configs is None
        else [model for config in app_configs for model in config.get_models()]
    )
    return [
        checks.Error(
            f"{model._meta.label} has counts ({', '.join(counts_of(model))}) but its default "
            "manager does not make CountingQuerySets",
            hint="objects = CountingQuerySet.as_manager()",
            obj=model,
            id="shardkit.E001",
        )
        for model in models_to_check
        if counts_of(model)
        and not issubclass(model._default_manager._queryset_class, CountingQuerySet)
    ]


def _delta(count: ShardedCount, value: Any) -> int:
    """``n`` of ``F(count) + n`` / ``n + F(count)`` / ``F(count) - n``."""
    if isinstance(value, CombinedExpression) and value.connector in ("+", "-"):
        lhs, rhs = value.lhs, value.rhs
        if _is_count(lhs, count) and isinstance(rhs, Value):
            delta = check_delta(rhs.value)
            return delta if value.connector == "+" else -delta
        if value.connector == "+" and isinstance(lhs, Value) and _is_count(rhs, count):
            return check_delta(lhs.value)
    raise NotACountingUpdate(
        f"{count.name!r} is a ShardedCount: update it with F({count.name!r}) + n or "
        f"F({count.name!r}) - n (n an int), not {value!r}"
    )


def _is_count(expression: Any, count: ShardedCount) -> bool:
    return isinstance(expression, models.F) and expression == models.F(count.name)


def _pk_lookup(query: Any) -> tuple[Any] | None:
    """``(pk,)`` when ``query`` filters on its model's primary key being one value and on
    nothing else, so that an update's row count says whether that object matched."""
    where = query.where
    if where.negated or len(where.children) != 1 or query.distinct:
        return None
    lookup = where.children[0]
    target = getattr(getattr(lookup, "lhs", None), "target", None)
    if not isinstance(lookup, Exact) or target is None or not target.primary_key:
        return None
    if target.model is not query.model or hasattr(lookup.rhs, "resolve_expression"):
        return None
    return (lookup.rhs,)


def _pk_filter(
    model: type[models.Model], args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Any] | None:
    """``(pk,)`` when ``filter(*args, **kwargs)`` asks for ``model``'s primary key (not a
    relation) to be the one value ``pk``, prepared as Django prepares it (its error for a
    value the field refuses)."""
    pk = model._meta.pk
    if args or len(kwargs) != 1 or pk.is_relation:
        return None
    ((lookup, value),) = kwargs.items()
    if lookup.removesuffix("__exact") not in ("pk", pk.attname):
        return None
    if value is None or hasattr(value, "resolve_expression") or isinstance(value, models.Model):
        return None
    return (pk.get_prep_value(value),)


__all__ = ["CountingQuerySet", "check_managers"]
