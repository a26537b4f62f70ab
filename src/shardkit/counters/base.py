"""What every counter kind is given: its backends and the kit's settings."""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any, ClassVar

from shardkit._failures import FailureLog
from shardkit._program import Call, Program, Roles, call
from shardkit._sync.adjuster import Adjuster
from shardkit.cache.base import Cache, Placed, Recording
from shardkit.counters.adjuster import Adjusting, Sending, sending
from shardkit.errors import BackendError, CounterKindMismatch, CounterNotFound
from shardkit.executor.base import Marks
from shardkit.options import DEFAULTS
from shardkit.store.base import CounterInfo, Store

log = logging.getLogger("shardkit")


@dataclass(frozen=True, kw_only=True)
class Options:
    """A kit's settings, as its counters' rules read them (the same for the sync and the
    async kit): its options (``KitOptions``, but the prefix), and more."""

    cache_ttl: float = DEFAULTS["cache_ttl"]
    max_shards: int = DEFAULTS["max_shards"]
    key_retention: float = DEFAULTS["key_retention"]
    adjust_delay: float = DEFAULTS["adjust_delay"]
    fold_after: float = 600.0
    """Seconds after it was recorded before a buffered counter's dead generation (one
    whose cache keys are gone) is folded into its ``RETIRED`` generation by a flush."""
    random: Callable[[], float] = field(default=random.random)
    failures: FailureLog = field(default_factory=FailureLog, compare=False, repr=False)
    """Where the kit's counters log failures that do not fail their call, rate-limited."""

    @property
    def namespace(self) -> str:
        """Prefix of every cache key: ``shardkit:`` and the store's identity, so that
        stores sharing one cache never meet in it."""
        raise NotImplementedError

    @property
    def shared_cache(self) -> bool:
        """Whether other processes see the cache's keys (see ``Cache.shared``)."""
        raise NotImplementedError

    @property
    def roles(self) -> CounterRoles:
        """The backends every counter kind's programs run on."""
        raise NotImplementedError

    @property
    def placement(self) -> Placed | None:
        """The cache, if its keys live on several servers (see ``Placed``)."""
        return None

    @property
    def recording(self) -> Recording | None:
        """The cache, if it can record idempotency keys (see ``Recording``)."""
        return None

    @property
    def default_stripes(self) -> int:
        """How many stripes a buffered counter has unless told: one per server of a
        cache whose keys live on several, else one."""
        return 1 if self.placement is None else len(self.placement.owners())

    def cache_key(self, name: str, part: str, tag: str | None = None) -> str:
        """The cache key of ``part`` of counter ``name``. Where keys are placed on
        several servers, the name (and ``tag``) is the key's hash tag: a counter's keys
        share a server, except those of different ``tag``s."""
        if self.placement is None:
            return f"{self.namespace}{part}:{name}"
        # The tag is a digest of the name: a name may hold braces, which would end it.
        label = hashlib.blake2b(name.encode(), digest_size=8).hexdigest()
        if tag is not None:
            label = f"{label}:{tag}"
        return f"{self.namespace}{{{label}}}:{part}:{name}"


@dataclass(frozen=True, slots=True)
class CounterRoles(Roles):
    """The backends every counter kind's programs run on."""

    store: Store
    cache: Cache
    adjuster: Adjusting
    """Where sharded writes leave their adjustments of cached values."""


@dataclass(frozen=True, kw_only=True)
class Settings(Options):
    """The backends and settings a kit hands each of its counters: its store and cache,
    and an adjuster of cached values on the cache, of the form's ``adjusting`` class
    (``CounterSettings``: the sync kit's; ``shardkit.aio.AsyncSettings``)."""

    store: Any
    cache: Any
    adjuster: Any = field(init=False, compare=False, repr=False)
    """Where sharded writes leave their adjustments of cached values."""
    adjusting: ClassVar[type[Any]]  # the form's Adjuster class

    def __post_init__(self) -> None:
        send = partial(sending, self.failures)
        roles = Sending(self.cache)
        adjuster = self.adjusting(send, roles, self.cache.shared, self.adjust_delay)
        object.__setattr__(self, "adjuster", adjuster)  # frozen, but built from the rest

    @property
    def shared_cache(self) -> bool:
        return bool(self.cache.shared)

    @cached_property
    def placement(self) -> Placed | None:
        return self.cache if isinstance(self.cache, Placed) else None

    @cached_property
    def recording(self) -> Recording | None:
        return self.cache if isinstance(self.cache, Recording) else None

    @cached_property
    def marks(self) -> Marks:
        """The deduplication marks of the kit's background tasks, in its cache."""
        return Marks(self.cache, lambda name: self.cache_key(name, "task"))

    @cached_property
    def roles(self) -> CounterRoles:
        """The backends, as the counters' programs run on them."""
        return CounterRoles(self.store, self.cache, self.adjuster)


@dataclass(frozen=True, kw_only=True)
class CounterSettings(Settings):
    """The backends and settings a (sync) kit hands each of its counters."""

    store: Store
    cache: Cache
    adjusting = Adjuster

    @cached_property
    def namespace(self) -> str:
        """Prefix of every cache key (read from the store on first use)."""
        return f"shardkit:{self.store.identity()}:"


class CounterCore:
    """What every counter kind's rules share: the counter's name, its configuration as
    the store holds it (``info``, of one incarnation: a delete or reset ends it), and
    the kit's settings. Its programs run on the role ``Store``.

    An object stands for its name: when it finds the incarnation it writes to ended, it
    moves to the one the store holds, created anew (as the kit's opening creates a
    counter) if the name holds none."""

    kind: str
    """The counter's kind: ``sharded``, ``buffered``, ``monotonic`` or ``ids``."""
    roles: CounterRoles

    def __init__(self, info: CounterInfo, options: Options) -> None:
        self.name = info.name
        """The counter's name."""
        self.info = info
        """Its configuration as the store holds it (``CounterInfo``): kind, shards,
        incarnation."""
        self._options = options
        self.roles = options.roles
        self._looked_at = time.monotonic()

    def _look_due(self, every: float) -> bool:
        """Whether ``every`` seconds have passed since ``_follow`` last looked (or the
        object was opened, or ``_expire``)."""
        return time.monotonic() - self._looked_at >= every

    def _expire(self) -> None:
        """Have the next call that may look at the store (``_look_due``) look."""
        self._looked_at = -math.inf

    def _follow(self, *, create: bool = True) -> Program[bool]:
        """Read the counter's configuration from the store; if it is another incarnation
        (or none, or one of another kind: ``CounterKindMismatch`` then), move to it
        (``_moved``), creating it if none (for a write; a read, without ``create``,
        raises ``CounterNotFound`` then). Returns whether it moved."""
        info = yield from call(Store.counter, self.name)
        self._looked_at = time.monotonic()
        if info is None and not create:
            raise CounterNotFound(f"no counter named {self.name!r}: it was deleted")
        if info is None:
            shards = self.info.shards
            info = yield from call(Store.open_counter, self.name, self.kind, shards, grow=False)
        if info.kind != self.kind:
            raise CounterKindMismatch(
                f"{self.name!r} is now a {info.kind} counter, not a {self.kind} counter"
            )
        return self._hold(info)

    def _hold(self, info: CounterInfo) -> bool:
        """Hold ``info``, the counter's configuration as the store holds it now; if it is
        another incarnation, move to it (``_moved``). Returns whether it moved."""
        ended, self.info = info.incarnation != self.info.incarnation, info
        if ended:
            self._moved()
        return ended

    def _moved(self) -> None:
        """Let go of what belonged to the incarnation that ended (its cache keys)."""


def incarnation_key(options: Options, info: CounterInfo, part: str) -> str:
    """The cache key of ``part`` of one incarnation of a counter: a counter created
    again under the name never meets the keys of its forerunners."""
    return options.cache_key(info.name, f"{part}:{info.incarnation}")


def best_effort(options: Options, action: str, step: Iterable[Call[Any]]) -> Program[None]:
    """Carry out ``step``, whose failure must not fail the caller (the write it follows
    has happened already: raising would invite a doubled retry); log the failure
    (``options.failures``: the first of an outage, then a count now and then)."""
    try:
        yield from step
    except BackendError as exc:
        options.failures.failed(
            action, "failed while %s (the call itself succeeded): %s", action, exc
        )
    else:
        options.failures.worked(action)
