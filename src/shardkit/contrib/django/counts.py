"""Counts on Django models: ``ShardedCount`` and the queryset that routes counting updates.

::

    class Video(models.Model):
        views = ShardedCount()                   # or ShardedCount(buffered=True, interval=5)
        objects = CountingQuerySet.as_manager()

    Video.objects.filter(pk=pk).update(views=F("views") + 1)
    video.views.incr(); video.views.value()
    Video.objects.with_counts("views")           # a page's values in one query

A count is not a column: each object's count is a shardkit counter named
``"<app_label>.<model>.<field>:<pk>"`` in the app's kit, whose store is the database
``SHARDKIT['STORE']``.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Generic, Literal, TypeVar

from django.core.exceptions import FieldError
from django.db import DatabaseError, connections, models, transaction
from django.db.models.expressions import CombinedExpression, Value
from django.db.models.lookups import Exact
from django.db.models.query import ModelIterable

from shardkit._program import run
from shardkit.counters import BufferedCounter, ShardedCounter
from shardkit.counters.sharded import held_ticket, take_ticket
from shardkit.errors import ValidationError
from shardkit.kit import Kit
from shardkit.store.sql import unprepare_behind_pooler
from shardkit.store.sql.dialect import LibpqStatement
from shardkit.validation import check_delta, check_exists_ttl, check_interval, check_shards

from .conf import database, kit
from .store import DjangoStore

_M = TypeVar("_M", bound=models.Model)


class NotACountingUpdate(ValidationError, FieldError):
    """An ``update()`` that sets a count to anything but ``F(count) + n`` or ``- n``."""


# How long a buffered count takes an object this process saw exist as existing, unless
# its ``ShardedCount`` says otherwise.
DEFAULT_EXISTS_TTL = 60.0


class ShardedCount:
    """A count on each object of a model, kept in a shardkit counter, not a column.

    ``ShardedCount()`` is a sharded counter: an increment is a statement of the
    caller's transaction (committed at once outside one), applied exactly once if it
    commits. Its cached value is adjusted at once, so a rolled-back increment can show
    in ``value()`` (not ``value(fresh=True)``) until the cache entry expires. Each
    object's counter sizes itself (``shards="auto"``, as ``Kit.sharded``): created
    with 1 shard, grown when this process's counting updates of it wait on its rows;
    ``shards=N`` creates it with N.
    ``ShardedCount(buffered=True, interval=5)`` is a buffered counter: an increment goes
    to the cache when the caller's transaction commits (``on_commit``; at once outside a
    transaction) and is flushed to the store within about ``interval`` seconds.

    A buffered count's counting ``update()`` filtered by primary key alone needs to know
    whether the object exists (its return value says). It takes an object that this
    process saw exist in the last ``exists_ttl`` seconds (read by such an update, in a
    transaction that committed; default ``DEFAULT_EXISTS_TTL``, 60) as existing without
    reading it again: the increment is then a cache command alone. A deletion through
    this process's ORM is seen at once (``post_delete``, which also makes the model's
    deletes send signals rather than delete in bulk); one elsewhere (another process, raw
    SQL) within ``exists_ttl`` seconds, until when such an update returns 1 for the
    deleted object and counts it. ``exists_ttl=0`` reads the object every time.
    """

    def __init__(
        self,
        shards: int | Literal["auto"] = "auto",
        *,
        buffered: bool = False,
        interval: float = 5.0,
        exists_ttl: float | None = None,
    ):
        self.shards: int | Literal["auto"] = (
            "auto" if shards == "auto" else check_shards(shards, 1_000_000)
        )
        self.buffered = bool(buffered)
        self.interval = check_interval(interval)
        if exists_ttl is None:
            exists_ttl = DEFAULT_EXISTS_TTL if self.buffered else 0.0
        self.exists_ttl = check_exists_ttl(exists_ttl)
        if self.exists_ttl and not self.buffered:
            raise ValidationError(
                "exists_ttl is for buffered counts: a sharded count's statement finds the "
                "object itself"
            )
        self.name = ""
        self.model: type[models.Model] | None = None

    def contribute_to_class(self, cls: type[models.Model], name: str) -> None:
        """Called by Django's model metaclass: become the ``name`` attribute of ``cls``."""
        self.name = name
        self.model = cls
        # A dict of its own per model, so that subclasses add to a copy.
        cls._shardkit_counts = {**getattr(cls, "_shardkit_counts", {}), name: self}  # type: ignore[attr-defined]
        setattr(cls, name, self)

    def __get__(self, obj: models.Model | None, owner: type) -> Any:
        if obj is None:
            return self
        return BoundCount(self, obj)

    def __set__(self, obj: models.Model, value: int) -> None:
        """Remember a value read for ``obj`` (``with_counts`` sets it); the count itself
        changes only through ``incr``/``decr`` and counting updates."""
        obj.__dict__[self._loaded] = value

    @property
    def _loaded(self) -> str:
        return f"_shardkit_{self.name}"

    def counter_name(self, model: type[models.Model], pk: Any) -> str:
        """The name of the counter of ``model``'s object ``pk``: named after the model
        that declares the count (each concrete model, for an abstract one)."""
        owner = self.model if self.model is not None and not self.model._meta.abstract else model
        if pk is None:
            raise ValidationError(f"{owner._meta.label}.{self.name} of an unsaved object")
        return f"{owner._meta.label_lower}.{self.name}:{pk}"

    def counter(self, model: type[models.Model], pk: Any) -> ShardedCounter | BufferedCounter:
        """The shardkit counter of ``model``'s object ``pk``."""
        name = self.counter_name(model, pk)
        if self.buffered:
            return kit().buffered(name, self.interval)
        return kit().sharded(name, self.shards)

    def add(self, model: type[models.Model], pk: Any, delta: int) -> None:
        """Add ``delta`` to the count of ``model``'s object ``pk`` as part of the
        transaction open on the kit's database (a buffered count when it commits)."""
        counter = self.counter(model, pk)
        if isinstance(counter, BufferedCounter):
            # robust: the transaction has committed; a cache that fails now loses this
            # increment (logged), as a cache that loses its data would.
            transaction.on_commit(lambda: counter.incr(delta), using=database(), robust=True)
        else:
            counter.incr(delta)

    def __repr__(self) -> str:
        kind = f"buffered, interval={self.interval}" if self.buffered else f"shards={self.shards}"
        if self.exists_ttl:
            kind += f", exists_ttl={self.exists_ttl}"
        return f"<ShardedCount {self.name} {kind}>"


class BoundCount:
    """An object's count: ``incr``, ``decr``, ``value``. ``int()`` and ``str()`` give the
    value, so templates (``{{ video.views }}``), the admin and serializers show it."""

    def __init__(self, count: ShardedCount, obj: models.Model) -> None:
        self._count = count
        self._obj = obj

    @property
    def counter(self) -> ShardedCounter | BufferedCounter:
        return self._count.counter(type(self._obj), self._obj.pk)

    def incr(self, delta: int = 1) -> None:
        """Add ``delta``, in the transaction open on the kit's database (see ``ShardedCount``)."""
        check_delta(delta)
        self._obj.__dict__.pop(self._count._loaded, None)
        self._count.add(type(self._obj), self._obj.pk, delta)

    def decr(self, delta: int = 1) -> None:
        """Subtract ``delta``."""
        self.incr(-check_delta(delta))

    def value(self, *, fresh: bool = False) -> int:
        """The count: the value ``with_counts`` read with the object, if it did and not
        ``fresh``; otherwise read now (a sharded count from the cache unless ``fresh``,
        stale by at most the kit's cache TTL; a buffered count stored plus pending)."""
        loaded = self._obj.__dict__.get(self._count._loaded)
        if loaded is not None and not fresh:
            return int(loaded)
        counter = self.counter
        if isinstance(counter, BufferedCounter):
            return counter.value()
        return counter.value(fresh=fresh)

    def __int__(self) -> int:
        return self.value()

    def __str__(self) -> str:
        return str(self.value())

    def __repr__(self) -> str:
        return f"<BoundCount {self._count.counter_name(type(self._obj), self._obj.pk)}>"


def counts_of(model: type[models.Model]) -> dict[str, ShardedCount]:
    """The counts of ``model``, by attribute name."""
    return dict(getattr(model, "_shardkit_counts", {}))


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
        the shards of a counter this process holds open (``writing_shards``) rather than
        reading them."""
        the_kit = kit()
        store = the_kit.store
        assert isinstance(store, DjangoStore)
        connection = connections[db]
        pk_field = self.model._meta.pk
        prefix = count.counter_name(self.model, "")
        ticket = _ticket(the_kit)
        auto = count.shards == "auto"
        created = 1 if auto else count.shards  # a new counter's shards
        tables = (store.shards_table.name, store.counters_table.name)
        if by_pk is not None:
            sql = _statement(db, tables, self.model, "count one")
            name = count.counter_name(self.model, by_pk[0])
            pk = pk_field.get_db_prep_value(by_pk[0], connection)
            held = the_kit.held(name)  # its shards known: not read by the statement
            known = held.writing_shards() if isinstance(held, ShardedCounter) else 0
            params = [name, ticket, known, name, created, delta, pk]
        else:
            matched = self.order_by("pk").values(shardkit_pk=models.F("pk"))
            select, selected = matched.query.get_compiler(db).as_sql()
            sql = _statement(db, tables, self.model, "count many")
            sql = sql.replace("{select}", select, 1)
            params = [prefix, ticket, prefix, created, delta, *selected]
        started = time.perf_counter()
        try:
            names = _names(connection, sql, params, one=by_pk is not None)
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
        sql = _statement(db, tables, self.model, "exists")
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


def load_counts(objects: Sequence[models.Model], names: Sequence[str]) -> None:
    """Read the counts ``names`` of ``objects`` (of one model) into them, all at once."""
    if not objects:
        return
    counts = counts_of(type(objects[0]))
    for name in names:
        count = counts[name]
        wanted = {count.counter_name(type(obj), obj.pk): obj for obj in objects}
        if count.buffered:
            values = {key: parts.total for key, parts in kit().parts(wanted).items()}
        else:
            values = kit().values(wanted)
        for key, obj in wanted.items():
            setattr(obj, name, values[key])


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


@functools.lru_cache(maxsize=256)
def _statement(alias: str, tables: tuple[str, str], model: type[models.Model], what: str) -> str:
    """The SQL of a counting update's statement ``what`` for ``model``'s objects, for
    Django's cursors on database ``alias`` (``%s`` parameters), ``tables`` being the
    store's shards and counters tables: ``exists`` finds an object by key; ``count
    one`` upserts the shard row of an object given by key if it exists; ``count many``
    upserts one for each key of the subquery put in place of ``{select}``. Both write
    the shard a writer's ticket picks among the counter's current shards (those it is
    created with, for a counter not created yet), and return the names written; ``count
    one`` reads them only when not given (0: unknown)."""
    quote = connections[alias].ops.quote_name
    shards, counters = (quote(table) for table in tables)
    name, shard, value = (quote(column) for column in ("name", "shard", "value"))
    table, pk = quote(model._meta.db_table), quote(model._meta.pk.column)
    if what == "exists":
        return f"SELECT 1 FROM {table} WHERE {pk} = %s"
    into = f"INSERT INTO {shards} ({name}, {shard}, {value})"
    upsert = (
        f"ON CONFLICT ({name}, {shard}) DO UPDATE SET {value} = {shards}.{value} + "
        f"excluded.{value} RETURNING {name}"
    )
    if what == "count one":
        named = "%s"
        found = f"WHERE EXISTS (SELECT 1 FROM {table} WHERE {pk} = %s)"
    else:
        # WHERE true: SQLite would read the ON CONFLICT as a join's without a WHERE.
        named = f"%s || CAST(matched.{quote('shardkit_pk')} AS TEXT)"
        found = "FROM ({select}) matched WHERE true"
    current = (
        f"SELECT {counters}.{quote('shards')} FROM {counters} WHERE {counters}.{name} = {named}"
    )
    known = "NULLIF(%s, 0), " if what == "count one" else ""
    return f"{into} SELECT {named}, %s %% COALESCE({known}({current}), %s), %s {found} {upsert}"


def _names(connection: Any, sql: str, params: Sequence[Any], *, one: bool) -> list[str]:
    """The names the counting statement ``sql`` returns, run on Django's ``connection`` in
    its transaction. The statement of ``one`` object (parameters of ``int`` and ``str``), on
    PostgreSQL through psycopg 3, runs through libpq directly (``LibpqStatement``), as
    psycopg would run it (a transaction Django has begun is begun on the server first:
    prepared, the statement goes with its ``BEGIN``, in one round trip), prepared where
    psycopg never deallocates it (not behind a pooler; in a transaction, only while
    psycopg prepares nothing of its own): the server plans it once per connection, and
    neither Django's cursor wrapper nor psycopg's cursor is paid —
    unless something watches Django's cursors (an execute wrapper, as instrumentation
    installs; the query log, with ``DEBUG`` or in a test's ``assertNumQueries``).
    Otherwise it goes through Django's cursor."""
    watched = connection.execute_wrappers or connection.queries_logged
    simple = one and all(type(param) in (int, str) for param in params)
    if watched or not simple or not _psycopg(connection):
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return [row[0] for row in cursor.fetchall()]
    connection.ensure_connection()
    connection.validate_no_broken_transaction()  # as Django's cursor would
    raw = connection.connection
    with connection.wrap_database_errors:
        session = _sessions.get(raw)
        if session is None:  # opened before the app was ready, or on another alias
            session = _Session.of(raw)
        prepare, begin = session.prepare, None
        if not raw.autocommit:
            prepare = prepare and raw.prepare_threshold is None
            if raw.pgconn.transaction_status == _IDLE:
                begin = _begin(raw.isolation_level, raw.read_only, raw.deferrable)
                if not prepare:
                    session.run(raw, begin, ())
                    begin = None
        return session.run(raw, sql, params, prepare=prepare, begin=begin)


class _Session:
    """What counting updates keep with one psycopg connection: whether it may prepare
    statements (not behind a pooler), and a function running each statement through
    libpq, by SQL, whether prepared, and the ``BEGIN`` sent with it."""

    __slots__ = ("prepare", "runners")

    def __init__(self, raw: Any) -> None:
        self.prepare = not unprepare_behind_pooler(raw)  # one round trip
        self.runners: dict[tuple[str, bool, str | None], _Names] = {}

    @classmethod
    def of(cls, raw: Any) -> _Session:
        """The session of ``raw``, made (one round trip) and remembered."""
        session = _sessions[raw] = cls(raw)
        return session

    def run(
        self,
        raw: Any,
        sql: str,
        params: Sequence[Any],
        *,
        prepare: bool = False,
        begin: str | None = None,
    ) -> list[str]:
        """Run the statement ``sql`` (``%s`` parameters) on ``raw``, prepared or not
        (with ``begin``: prepared, sent with that ``BEGIN`` of a transaction in one
        round trip); the names it returns."""
        key = (sql, prepare, begin)
        run = self.runners.get(key)
        if run is None:
            run = self.runners[key] = _runner(raw, sql, prepare, begin)
        return run(params)


def _runner(raw: Any, sql: str, prepare: bool, begin: str | None) -> _Names:
    """A function running the counting statement ``sql`` (``%s`` parameters) on psycopg's
    connection ``raw`` through libpq (after ``begin``, in one round trip, if given); it
    returns the names the statement returns."""
    numbers = iter(range(1, sql.count("%s") + 1))
    text = re.sub(r"%s|%%", lambda m: "%" if m[0] == "%%" else f"${next(numbers)}", sql)
    statement = LibpqStatement(text)
    if begin is None:
        run = statement.on(raw, prepare=prepare, now=True)
    else:
        run = statement.beginning(raw, begin)
    encoding: str = raw.info.encoding

    def names(params: Sequence[Any]) -> list[str]:
        result = run(params)
        return [result.get_value(row, 0).decode(encoding) for row in range(result.ntuples)]

    return names


@functools.lru_cache(maxsize=64)
def _begin(isolation_level: int | None, read_only: bool | None, deferrable: bool | None) -> str:
    """The ``BEGIN`` psycopg sends before a transaction's first statement on a connection
    of these settings."""
    from psycopg import IsolationLevel

    parts = ["BEGIN"]
    if isolation_level is not None:
        parts.append(f"ISOLATION LEVEL {IsolationLevel(isolation_level).name.replace('_', ' ')}")
    if read_only is not None:
        parts.append("READ ONLY" if read_only else "READ WRITE")
    if deferrable is not None:
        parts.append("DEFERRABLE" if deferrable else "NOT DEFERRABLE")
    return " ".join(parts)


_Names = Callable[[Sequence[Any]], list[str]]
_IDLE = 0  # libpq's PQTRANS_IDLE: no transaction begun on the server
_sessions: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()


def note_pooler(sender: Any, connection: Any, **_: Any) -> None:
    """``connection_created``'s receiver: find out, once per connection Django opens to
    the store's database, whether it goes through a pooler (one round trip), before any
    request's counting update needs to know."""
    if connection.alias == database() and _psycopg(connection):
        _Session.of(connection.connection)


def _psycopg(connection: Any) -> bool:
    """Whether Django's ``connection`` is to PostgreSQL through psycopg 3."""
    return bool(connection.vendor == "postgresql" and connection.Database.__name__ == "psycopg")


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


class Sightings:
    """When this process last saw objects exist, for counts with ``exists_ttl``: by
    database alias, model label and key (the newest ``most``). Thread-safe."""

    def __init__(self, most: int = 100_000) -> None:
        self._seen: dict[tuple[str, str, Any], float] = {}  # oldest first
        self._most = most
        self._lock = threading.Lock()

    def saw(self, seen: tuple[str, str, Any]) -> None:
        with self._lock:
            self._seen.pop(seen, None)
            self._seen[seen] = time.monotonic()
            if len(self._seen) > self._most:
                del self._seen[next(iter(self._seen))]

    def within(self, seen: tuple[str, str, Any], ttl: float) -> bool:
        at = self._seen.get(seen)
        return at is not None and time.monotonic() - at <= ttl

    def forget(
        self, sender: type[models.Model], instance: models.Model, using: str, **_: Any
    ) -> None:
        """``post_delete``'s receiver: forget the object now and when the delete commits
        (an update that read it meanwhile may have seen it)."""
        seen = (using, sender._meta.label_lower, instance.pk)
        self._forget(seen)
        transaction.on_commit(lambda: self._forget(seen), using=using)

    def _forget(self, seen: tuple[str, str, Any]) -> None:
        with self._lock:
            self._seen.pop(seen, None)


sightings = Sightings()


def watch_deletes() -> None:
    """Forget the objects deleted through the ORM of models whose counts have
    ``exists_ttl`` (connected once Django's models are loaded: a model inherits the
    counts of an abstract one)."""
    from django.apps import apps
    from django.db.models.signals import post_delete

    for model in apps.get_models():
        if any(count.exists_ttl for count in counts_of(model).values()):
            post_delete.connect(
                sightings.forget,
                sender=model,
                weak=False,
                dispatch_uid=f"shardkit.sightings.{model._meta.label_lower}",
            )


_tickets = threading.local()


def _ticket(the_kit: Kit) -> int:
    """This thread's ticket, which picks its shard of every count it writes by
    statement: one per thread and process, so that concurrent writers of one hot object
    write different rows."""
    ticket = held_ticket(_tickets)
    if ticket is None:
        settings = the_kit.settings
        taking = take_ticket(settings, settings.cache_key("django", "ticket"), _tickets)
        ticket = run(taking, settings.roles)
    return ticket


__all__ = ["BoundCount", "CountingQuerySet", "NotACountingUpdate", "ShardedCount", "counts_of"]
