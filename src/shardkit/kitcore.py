"""What the sync and async kits share (``KitCore``): the counters opened lately, and the
rules of opening, reading, flushing and ending counters, as programs on the backends of
``CounterRoles``."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Generic, Literal, TypeVar, cast

from shardkit import metrics
from shardkit._program import Program, call, rule
from shardkit.cache import Cache
from shardkit.counters.adjuster import Adjusting
from shardkit.counters.base import CounterCore, CounterRoles, Options, best_effort, log
from shardkit.counters.buffered import BufferedCore
from shardkit.counters.buffered import forget as forget_buffered
from shardkit.counters.generations import Parts, flush_counters, read_parts
from shardkit.counters.ids import SUB_BLOCK, IdCore
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


_CACHING_VALUES = metrics.action("caching values")
_FORGETTING = metrics.action("removing a deleted counter's cache keys")
_S = TypeVar("_S", bound=ShardedCore)  # a form's counters of each kind
_B = TypeVar("_B", bound=BufferedCore)
_M = TypeVar("_M", bound=MonotonicCore)
_I = TypeVar("_I", bound=IdCore)
_C = TypeVar("_C", bound=CounterCore)


class KitCore(Generic[_S, _B, _M, _I]):
    """What the sync and async kits share: the counters opened lately, and the rules of
    opening, reading and ending counters (programs on ``CounterRoles``). A form names
    its counter classes of each kind (``sharded_form`` …)."""

    roles: CounterRoles
    executor: Any
    # The form's counter classes, made with the kit's settings (and executor).
    sharded_form: Callable[[CounterInfo, Any], _S]
    buffered_form: Callable[[CounterInfo, Any, Any, float, int], _B]
    monotonic_form: Callable[[CounterInfo, Any, float, Callable[[], float]], _M]
    ids_form: Callable[[CounterInfo, Any, int, int], _I]

    def __init__(self, options: Options) -> None:
        self._options = options
        self.roles = options.roles
        self._lock = threading.Lock()
        # The counters opened lately, so that opening one again costs no round trip;
        # bounded, since applications open a counter per entity (poll, video, …).
        self._counters: OrderedDict[str, _S | _B | _M | _I] = OrderedDict()
        self.turnover = 0
        """How many times an object this kit held stopped being the one it holds for its
        name (replaced by one opened anew, dropped for room, or its counter ended): what
        a caller opened through the kit while this stands still is what the kit would
        hand it (the Django app's counts keep what they opened so)."""

    def _open(
        self,
        name: str,
        core: type[CounterCore],
        usable: Callable[[_C], bool],
        new: Callable[[CounterInfo], _C],
        shards: int | None = None,
        *,
        sharded: bool = False,
        grow: bool = False,
    ) -> Program[_C]:
        """The counter ``name`` of kind ``core``: the one opened lately if it is
        ``usable``, else one made by ``new`` from the store's configuration, which is
        created on first use — with ``shards`` shards (default 20) for a ``sharded``
        kind, grown to them when more and asked to ``grow``; one row otherwise.
        ``CounterKindMismatch`` if the one opened lately is of another kind."""
        with self._lock:
            held = self._counters.get(name)
            if held is not None:
                self._counters.move_to_end(name)
        if held is not None and not isinstance(held, core):
            raise CounterKindMismatch(
                f"{name!r} is a {held.kind} counter, not a {core.kind} counter"
            )
        kept = cast("_C | None", held)  # of kind ``core``: one the form made, by ``new``
        if kept is not None and usable(kept):
            return kept
        size = shards or DEFAULT_SHARDS if sharded else 1
        info = yield from call(Store.open_counter, name, core.kind, size, grow=grow)
        counter = new(info)
        with self._lock:
            replaced = self._counters.get(name) is not None
            self._counters[name] = counter  # type: ignore[assignment]  # one of the form's
            self._counters.move_to_end(name)
            if len(self._counters) > _OPEN_COUNTERS:
                self._counters.popitem(last=False)
                replaced = True
            self.turnover += replaced
        return counter

    def held(self, name: str) -> _S | _B | _M | _I | None:
        """The counter ``name`` if this kit holds it open (opened lately), else None:
        no round trip."""
        with self._lock:
            return self._counters.get(name)

    @rule
    def sharded(self, name: str, shards: int | Literal["auto"] | None = "auto") -> Program[_S]:
        """The sharded counter ``name``. By default (``shards="auto"``, or None) it is
        created with 1 shard on first use, and grown by this process's writes when they
        wait on their rows (``counters.sizing``; never on SQLite, whose one lock more
        shards cannot spread); an existing counter keeps its count, and grows so too.
        With ``shards=N`` it is created with N shards, or grown to N when that is more,
        and grows no further by itself."""
        check_name(name)
        auto = shards is None or shards == "auto"
        if not auto:
            check_shards(shards, self._options.max_shards)
        fixed = None if auto else cast("int", shards)
        counter = yield from self._open(
            name,
            ShardedCore,
            lambda c: fixed is None or fixed <= c._shards,
            lambda info: self.sharded_form(info, self._options),
            1 if auto else fixed,
            sharded=True,
            grow=fixed is not None,
        )
        if auto:
            counter.size_automatically(self.roles.store.row_locks)
        return counter

    @rule
    def buffered(
        self, name: str, interval: float = DEFAULT_INTERVAL, stripes: int | None = None
    ) -> Program[_B]:
        """The buffered (write-behind) counter ``name``, created on first use, whose
        increments this kit flushes to the store every ``interval`` seconds (a setting
        of this process, not of the counter: processes may flush at their own pace; an
        async kit's flushes run on its event loop).

        ``stripes`` (1 … 256) spreads its increments over that many cache keys, each
        written at random; on Redis Cluster they are placed on the primaries in turn,
        and the default is one per primary (elsewhere, 1). Also this process's setting:
        a flush reads every stripe any process wrote."""
        check_name(name)
        every = check_interval(interval)
        count = self._options.default_stripes if stripes is None else check_stripes(stripes)
        return self._open(
            name,
            BufferedCore,
            lambda c: (c.interval, c.stripes) == (every, count),
            lambda info: self.buffered_form(info, self._options, self.executor, every, count),
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

    @rule
    def monotonic(
        self,
        name: str,
        shards: int | None = None,
        chance_to_write: float = 0.1,
        *,
        random: Callable[[], float] | None = None,
    ) -> Program[_M]:
        """The cache-held monotonic counter ``name``, created on first use with ``shards``
        shards (default 20; grown like a sharded counter's). ``chance_to_write`` is the
        probability that an increment persists its value; ``random`` (default
        ``random.random``) may be injected for tests. Not for ids: see ``ids``."""
        check_name(name)
        if shards is not None:
            check_shards(shards, self._options.max_shards)
        chance = check_chance(chance_to_write)
        draw = random or self._options.random
        return self._open(
            name,
            MonotonicCore,
            lambda c: (
                (shards is None or shards <= c.shards)
                and c.chance_to_write == chance
                and random is None
            ),
            lambda info: self.monotonic_form(info, self._options, chance, draw),
            shards,
            sharded=True,
            grow=shards is not None,
        )

    @rule
    def ids(self, name: str, block: int = 1000, sub_block: int = SUB_BLOCK) -> Program[_I]:
        """The id allocator ``name``: unique ids, reserved in the store ``block`` at a
        time (with sub-blocks on a shared cache, up to 64 times that while writers find a
        block used up before the next is published), and taken from a block by this
        process ``sub_block`` at a time (one cache round trip each; both 1 … 2**40,
        settings of this process: processes may use their own). Ids increase within a
        process; across the processes that share a cache too when each of them uses
        ``sub_block=1`` (one cache round trip per id)."""
        check_name(name)
        size = check_block(block)
        share = check_block(sub_block, "sub_block")
        return self._open(
            name,
            IdCore,
            lambda c: c.block == size and c.sub_block == share,
            lambda info: self.ids_form(info, self._options, size, share),
        )

    @rule
    def get(self, name: str) -> Program[_S | _B | _M | _I]:
        """The existing counter ``name``, of whatever kind it is, as the store holds it
        now (one round trip, even for a counter this kit holds open: another process may
        have deleted it, reset it or made it again); raises ``CounterNotFound`` if there
        is none. The object this kit holds is returned while the name holds a counter of
        its kind, moved to the incarnation the store holds."""
        check_name(name)
        info = yield from call(Store.counter, name)
        held = self.held(name)
        if held is not None and info is not None and info.kind == held.kind:
            held._hold(info)
            return held
        if held is not None:  # ended elsewhere: its object stands for nothing now
            with self._lock:
                if self._counters.get(name) is held:
                    del self._counters[name]
            held._expire()
        if info is None:
            raise CounterNotFound(f"no counter named {name!r} in {self.roles.store.url}")
        if info.kind == BufferedCore.kind:
            return (yield from KitCore.buffered.program(self, name))
        if info.kind == MonotonicCore.kind:
            return (yield from KitCore.monotonic.program(self, name))
        if info.kind == IdCore.kind:
            return (yield from KitCore.ids.program(self, name))
        return (yield from KitCore.sharded.program(self, name))

    @rule
    def purge_keys(self) -> Program[int]:
        """Delete idempotency keys older than the kit's ``key_retention``; return how many."""
        return (yield from call(Store.purge_keys, time.time() - self._options.key_retention))

    @rule
    def delete(self, name: str) -> Program[CounterInfo]:
        """Delete counter ``name`` (``CounterNotFound`` if there is none) and return what
        it was. What a delete guarantees: see ``reset``."""
        return self._end(name, reset=False)

    @rule
    def reset(self, name: str) -> Program[CounterInfo]:
        """Reset counter ``name`` (``CounterNotFound`` if there is none) to a new, empty
        incarnation of the same kind and shards, in one transaction of the store, and
        return what it was. An id allocator is never reset (``ValidationError``, nothing
        changed): delete it, and the next allocator of the name starts above every id
        it reserved.

        What a delete or a reset removes is gone in every process: the counter's shard
        rows, idempotency keys, flushed generations and maxima, in one transaction;
        then its cache keys, with a buffered counter's pending increments. A counter
        created again under the name is a new incarnation, and nothing of the old one
        shows in it, but for a sharded counter's cached value, for ``cache_ttl`` seconds
        at most (as any cached read may be that stale).

        A counter object stands for its name. One of the old incarnation, held in this
        process or another, looks at the store and moves to the incarnation the name
        holds then, created anew (empty) if it holds none and the call writes, as
        opening would (a read raises ``CounterNotFound``): in this
        process at its next call; elsewhere at once for a buffered or monotonic counter
        that shares this kit's cache (its keys are gone), at its next block for an id
        allocator, and otherwise within ``cache_ttl`` seconds (10 s for a sharded
        counter). Until then, a sharded counter's writes count in the counter the name
        holds next (they are made after the delete); a buffered or monotonic counter's,
        with a cache of its process's own, in keys nothing reads again, and a monotonic
        one goes on from its old value; an id allocator hands out the rest of its block
        (no id is ever handed out twice).
        """
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
            self.turnover += opened is not None
        stripes = self._options.default_stripes
        if opened is not None:
            opened._expire()
            stripes = max(stripes, getattr(opened, "stripes", 0))
        yield from call(Adjusting.sync)
        forgetting = _forget(self._options, deleted, stripes)
        yield from best_effort(self._options, _FORGETTING, forgetting)
        return deleted.info

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
            yield from call(Adjusting.sync)  # this process's own writes are in what it reads
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
        values = {sharded_value_key(options, name): total for name, total in totals.items()}
        yield from call(Cache.add_many, values, options.cache_ttl)


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
