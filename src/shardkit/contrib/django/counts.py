"""Counts on Django models: ``ShardedCount``, the count a model declares, and
``BoundCount``, an object's count.

::

    class Video(models.Model):
        views = ShardedCount()                   # or ShardedCount(buffered=True, interval=5)
        objects = CountingQuerySet.as_manager()

    Video.objects.filter(pk=pk).update(views=F("views") + 1)
    video.views.incr(); video.views.value()
    Video.objects.with_counts("views")           # a page's values in one query

A count is not a column: each object's count is a shardkit counter named
``"<app_label>.<model>.<field>:<pk>"`` in the app's kit, whose store is the database
``SHARDKIT['STORE']``. The queryset that routes counting updates is ``querysets``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from django.core.exceptions import FieldError
from django.db import models, transaction

from shardkit.counters import BufferedCounter, ShardedCounter
from shardkit.errors import ValidationError
from shardkit.kit import Kit
from shardkit.validation import check_delta, check_exists_ttl, check_interval, check_shards

from .conf import database, kit


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
        # The counters this count opened through the kit, by name, with the kit and its
        # turnover then: good while both stand (see ``counter``).
        self._opened: tuple[Kit | None, int, dict[str, ShardedCounter | BufferedCounter]]
        self._opened = (None, 0, {})

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
        """The shardkit counter of ``model``'s object ``pk``, opened through the kit (a
        fixed ``shards=N`` grows it to N) once: kept, and handed out again without the
        kit, until the kit stops holding an object it held (its ``turnover``: a counter
        ended, opened anew, or dropped for room) or is replaced."""
        counter = self.held(model, pk, opening=True)
        assert counter is not None  # opened
        return counter

    def held(
        self, model: type[models.Model], pk: Any, *, opening: bool = False
    ) -> ShardedCounter | BufferedCounter | None:
        """``counter(model, pk)`` if this count or the kit holds it open, else None
        (without ``opening``) or opened now: no round trip unless the kit opens it (or
        grows it to a fixed count's shards)."""
        name = self.counter_name(model, pk)
        the_kit = kit()
        turnover = the_kit.turnover  # read before opening: a change meanwhile is seen next
        held_by, seen, opened = self._opened
        if held_by is not the_kit or seen != turnover:
            opened = {}
            self._opened = (the_kit, turnover, opened)
        counter = opened.get(name)
        if counter is None and (opening or the_kit.held(name) is not None):
            if self.buffered:
                counter = the_kit.buffered(name, self.interval)
            else:
                counter = the_kit.sharded(name, self.shards)
            opened[name] = counter
        return counter

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


__all__ = [
    "DEFAULT_EXISTS_TTL",
    "BoundCount",
    "NotACountingUpdate",
    "ShardedCount",
    "counts_of",
    "load_counts",
]
