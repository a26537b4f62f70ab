"""What the sync and async kits share (``KitCore``): the counters opened lately, and the
rules of opening, reading, flushing and ending counters, as programs on the backends of
``CounterRoles``."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from shardkit import metrics
from shardkit._program import Program, call, rule
from shardkit.cache import Cache
from shardkit.counters.adjuster import Adjuster
from shardkit.counters.base import CounterRoles, Options, best_effort, log
from shardkit.counters.buffered import BufferedCore, Parts, flush_counters, read_parts
from shardkit.counters.buffered import forget as forget_buffered
from shardkit.counters.ids import IdCore
from shardkit.counters.ids import forget as forget_ids
from shardkit.counters.monotonic import MonotonicCore
from shardkit.counters.monotonic import forget as forget_monotonic
from shardkit.counters.sharded import ShardedCore
from shardkit.counters.sharded import forget as forget_sharded
from shardkit.counters.sharded import value_key as sharded_value_key
from shardkit.errors import CounterKindMismatch, CounterNotFound, ShardkitError
from shardkit.store import CounterInfo, Store
from shardkit.store.base import Deleted
from shardkit.validation import (
    check_block,
    check_chance,
    check_interval,
    check_name,
    check_names,
    check_shards,
    check_stripes,
)

DEFAULT_STORE = "sqlite:///shardkit.db"
DEFAULT_CACHE = "memory://"
DEFAULT_SHARDS = 20
DEFAULT_INTERVAL = 5.0
_OPEN_COUNTERS = 4096


class _Named(Protocol):
    name: str
    kind: str

    def _expire(self) -> None: ...


_CACHING_VALUES = metrics.action("caching values")
_FORGETTING = metrics.action("removing a deleted counter's cache keys")
_K = TypeVar("_K", bound=_Named)  # the counters a kit keeps open
_C = TypeVar("_C", bound=_Named)
_S = TypeVar("_S", bound=ShardedCore)
_B = TypeVar("_B", bound=BufferedCore)
_M = TypeVar("_M", bound=MonotonicCore)
_I = TypeVar("_I", bound=IdCore)


class KitCore(Generic[_K]):
    """What the sync and async kits share: the counters opened lately, and the rules of
    opening and reading counters (programs on ``CounterRoles``)."""

    roles: CounterRoles

    def __init__(self, options: Options) -> None:
        self._options = options
        self._lock = threading.Lock()
        # The counters opened lately, so that opening one again costs no round trip;
        # bounded, since applications open a counter per entity (poll, video, …).
        self._counters: OrderedDict[str, _K] = OrderedDict()

    def _opened(self, name: str, kind: type[_C]) -> _C | None:
        with self._lock:
            counter = self._counters.get(name)
            if counter is not None:
                self._counters.move_to_end(name)
        if counter is None or isinstance(counter, kind):
            return counter
        raise CounterKindMismatch(
            f"{name!r} is a {counter.kind} counter, not a {kind.kind} counter"
        )

    def _keep(self, counter: _C) -> _C:
        with self._lock:
            self._counters[counter.name] = counter  # type: ignore[assignment]  # a _K
            self._counters.move_to_end(counter.name)
            if len(self._counters) > _OPEN_COUNTERS:
                self._counters.popitem(last=False)
        return counter

    def _open(
        self,
        name: str,
        kind: type[_C],
        usable: Callable[[_C], bool],
        new: Callable[[CounterInfo], _C],
        shards: int | None = None,
        *,
        sharded: bool = False,
    ) -> Program[_C]:
        """The counter ``name`` of class ``kind``: the one opened lately if it is
        ``usable``, else one made by ``new`` from the store's configuration, which is
        created on first use — with ``shards`` shards (default 20) for a ``sharded``
        kind, grown to them when they are more; one row otherwise."""
        counter = self._opened(name, kind)
        if counter is not None and usable(counter):
            return counter
        size, grow = (shards or DEFAULT_SHARDS, shards is not None) if sharded else (1, False)
        info = yield from call(Store.open_counter, name, kind.kind, size, grow=grow)
        return self._keep(new(info))

    def _open_sharded(
        self, name: str, shards: int | None, kind: type[_S], new: Callable[[CounterInfo], _S]
    ) -> Program[_S]:
        """The sharded counter ``name`` (of class ``kind``, made by ``new``), created on
        first use with ``shards`` shards (default 20). An existing counter is grown to
        ``shards`` when that is larger and otherwise kept as it is, so every process may
        open it with its own default."""
        check_name(name)
        if shards is not None:
            check_shards(shards, self._options.max_shards)
        return self._open(
            name, kind, lambda c: shards is None or shards <= c._shards, new, shards, sharded=True
        )

    def _open_buffered(
        self,
        name: str,
        interval: float,
        stripes: int | None,
        kind: type[_B],
        new: Callable[[CounterInfo, float, int], _B],
    ) -> Program[_B]:
        """The buffered counter ``name`` (of class ``kind``, made by ``new``), created on
        first use, flushed every ``interval`` seconds by this kit, its increments spread
        over ``stripes`` (None: the cache's default, ``Options.default_stripes``)."""
        check_name(name)
        every = check_interval(interval)
        count = self._options.default_stripes if stripes is None else check_stripes(stripes)
        return self._open(
            name,
            kind,
            lambda c: (c.interval, c.stripes) == (every, count),
            lambda info: new(info, every, count),
        )

    def _save_counters(self) -> Program[None]:
        """With a private cache, whose contents die with the process, flush the buffered
        counters opened lately, folding their generations into one row (see
        ``BufferedCore._retire``), and persist the monotonic counters' values; a failure
        is logged, and the others are saved."""
        if self._options.shared_cache:
            return
        with self._lock:
            counters = list(self._counters.values())
        for counter in counters:
            try:
                if isinstance(counter, BufferedCore):
                    yield from counter._retire()
                elif isinstance(counter, MonotonicCore):
                    yield from MonotonicCore.checkpoint.program(counter)
            except ShardkitError as exc:
                log.warning("could not save counter %r at close: %s", counter.name, exc)

    def _open_monotonic(
        self,
        name: str,
        shards: int | None,
        chance_to_write: float,
        random: Callable[[], float] | None,
        kind: type[_M],
        new: Callable[[CounterInfo, float, Callable[[], float]], _M],
    ) -> Program[_M]:
        """The monotonic counter ``name`` (of class ``kind``, made by ``new``): see
        ``Kit.monotonic``."""
        check_name(name)
        if shards is not None:
            check_shards(shards, self._options.max_shards)
        chance = check_chance(chance_to_write)
        draw = random or self._options.random
        return self._open(
            name,
            kind,
            lambda c: (
                (shards is None or shards <= c.shards)
                and c.chance_to_write == chance
                and random is None
            ),
            lambda info: new(info, chance, draw),
            shards,
            sharded=True,
        )

    def _open_ids(
        self, name: str, block: int, kind: type[_I], new: Callable[[CounterInfo, int], _I]
    ) -> Program[_I]:
        """The id allocator ``name`` (of class ``kind``, made by ``new``): see
        ``Kit.ids``."""
        check_name(name)
        size = check_block(block)
        return self._open(name, kind, lambda c: c.block == size, lambda info: new(info, size))

    @rule
    def purge_keys(self) -> Program[int]:
        """Delete idempotency keys older than the kit's ``key_retention``; return how many."""
        return (yield from call(Store.purge_keys, time.time() - self._options.key_retention))

    def _delete(self, name: str) -> Program[CounterInfo]:
        """Delete counter ``name``: see ``Kit.delete``."""
        return self._end(name, reset=False)

    def _reset(self, name: str) -> Program[CounterInfo]:
        """Reset counter ``name`` to a new, empty incarnation: see ``Kit.reset``."""
        return self._end(name, reset=True)

    def _end(self, name: str, *, reset: bool) -> Program[CounterInfo]:
        """End the incarnation of counter ``name`` in the store (``Store.delete``), then
        forget it: the object this kit holds (which looks at the store on its next call),
        this process's adjustments of its cached value, and its cache keys (a failure
        there is logged: the keys are the ended incarnation's, which only objects that
        still hold it read)."""
        check_name(name)
        deleted = yield from call(Store.delete, name, reset=reset)
        if deleted is None:
            raise CounterNotFound(f"no counter named {name!r} in {self.roles.store.url}")
        with self._lock:
            opened = self._counters.pop(name, None)
        stripes = self._options.default_stripes
        if opened is not None:
            opened._expire()
            stripes = max(stripes, getattr(opened, "stripes", 0))
        yield from call(Adjuster.sync)
        forgetting = _forget(self._options, deleted, stripes)
        yield from best_effort(self._options, _FORGETTING, forgetting)
        return deleted.info

    def _found(self, name: str) -> Program[_K | str]:
        """The counter ``name`` if it was opened lately, else its kind, read from the
        store; ``CounterNotFound`` if there is none."""
        check_name(name)
        with self._lock:
            counter = self._counters.get(name)
        if counter is not None:
            return counter
        info = yield from call(Store.counter, name)
        if info is None:
            raise CounterNotFound(f"no counter named {name!r} in {self.roles.store.url}")
        return info.kind

    @rule
    def counters(self) -> Program[list[CounterInfo]]:
        """Every counter in the store, ordered by name."""
        return (yield from call(Store.counters))

    @rule
    def flush_all(self) -> Program[dict[str, int]]:
        """Flush every buffered counter in the store (a crashed or lost flush's work
        included); return the amount moved per counter that had something pending.
        Idempotent; safe to run concurrently with anything.

        A counter that cannot be flushed does not stop the others: every other one is
        flushed, then ``FlushFailed`` is raised, its ``failed`` naming each failed
        counter with its error and its ``moved`` holding what this call would have
        returned."""
        infos = yield from KitCore.counters.program(self)
        names = [info.name for info in infos if info.kind == BufferedCore.kind]
        return (yield from flush_counters(self._options, names))

    @rule
    def parts(self, names: Iterable[str]) -> Program[dict[str, Parts]]:
        """The stored and pending parts of many buffered counters (``Parts.total`` is each
        one's exact value now): one store read and one cache read for all of them.
        Unknown names read ``Parts(0, 0)``."""
        return (yield from read_parts(self._options, check_names(names)))

    @rule
    def values(self, names: Iterable[str], *, fresh: bool = False) -> Program[dict[str, int]]:
        """Values of many counters: one cache round trip for the cached ones and one
        store query for the rest (all of them when ``fresh``). Unknown names read 0.

        The store's values: a sharded counter's value, a buffered counter's stored part,
        an id allocator's high-water mark. A monotonic counter's value lives in the
        cache: read it with ``kit.monotonic(name).value()``."""
        wanted = check_names(names)
        options = self._options
        keys = {sharded_value_key(options, name): name for name in wanted}
        found: dict[str, int] = {}
        if not fresh:
            yield from call(Adjuster.sync)  # this process's own writes are in what it reads
            try:
                cached = yield from call(Cache.get_many, list(keys))
            except ShardkitError:
                cached = {}
            found = {keys[key]: value for key, value in cached.items()}
        missing = [name for name in wanted if name not in found]
        totals = yield from call(Store.totals, missing)
        if not fresh:
            yield from best_effort(options, _CACHING_VALUES, self._cache_values(totals))
        found.update(totals)
        return {name: found[name] for name in wanted}

    def _cache_values(self, totals: dict[str, int]) -> Program[None]:
        options = self._options
        for name, total in totals.items():
            key = sharded_value_key(options, name)
            yield from call(Cache.add, key, total, options.cache_ttl)


def _forget(options: Options, deleted: Deleted, stripes: int) -> Program[None]:
    """Remove the cache keys of the deleted counter ``deleted``, by its kind (a buffered
    counter's pointers of its first ``stripes`` stripes)."""
    kind = deleted.info.kind
    if kind == BufferedCore.kind:
        yield from forget_buffered(options, deleted, stripes)
    elif kind == MonotonicCore.kind:
        yield from forget_monotonic(options, deleted)
    elif kind == IdCore.kind:
        yield from forget_ids(options, deleted)
    else:
        yield from forget_sharded(options, deleted)


__all__ = ["DEFAULT_CACHE", "DEFAULT_INTERVAL", "DEFAULT_SHARDS", "DEFAULT_STORE", "KitCore"]
