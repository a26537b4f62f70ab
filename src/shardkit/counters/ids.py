"""The id allocator: ids that are never handed out twice, from blocks reserved in the
store before any of their ids is handed out.

Each *generation* of an allocator owns one block: the store raises the allocator's
high-water mark by the block's size (atomically, durably) and the block ``mark - size +
1 … mark`` belongs to that generation alone. Its ids are handed out by incrementing one cache
key, ``ids:<mark>``, created once at the block's start. An id is handed out only if it
lies inside the block of the key that produced it, so ids of different generations can
never meet, and within a generation the cache's atomic increment hands each id out once.
When the block is used up, or the cache loses the key (eviction, restart, FLUSHALL), a
writer reserves a new block — above every block ever reserved, hence above every id ever
handed out. Holes (the unused rest of a block) are allowed; duplicates never. The key
of a block is created only by the writer that reserved it, and the cache's ``incr`` never
creates one, so a lost key is never re-created below the ids it handed out.

A process takes the ids of a block ``sub_block`` at a time: one ``incr`` of the block's
key by ``sub_block`` takes the ids up to its new value (those within the block: its end
cuts a sub-block short), and the process hands them out from memory, one by one, to all
its threads (under a lock); so ids increase within a process, and most of them cost no
round trip. The writers of a process take sub-blocks one at a time (the guard), so that
each follows the last and is used up before the next is taken; a sub-block of 1 leaves
no rest to share, and its writers take their ids concurrently. The rest of a sub-block
that no one hands out (its process ends, or the allocator is deleted) is a hole, as is
the rest of a forked child's parent's: the child starts without it.

With a shared cache, the processes take ids from the generation the cache points at:
of the writers that find a block used up, one claims the next (an add-if-absent in the
cache) and the others wait for it. With a sub-block of 1, ids increase across processes
too (one sequence). With a larger one — the default, as a PostgreSQL sequence's
``CACHE`` — only within each process: a process hands out the rest of its sub-block
after others have moved past it, and after a cache loss, before it moves to a new block;
and the process that reserved a block publishes the next ahead once it takes a
sub-block of it, so that the writers that use a block up find the next one published
instead of waiting for it (a process that starts takes its ids from the newest). Blocks
are of ``block`` ids, but when a writer found the block in use used up before the next
was published all the same, the blocks published from then on are twice as large (up
to 64 times ``block``, for a minute: a size in the cache that every process sharing it
reserves), until a block outlasts the publication of the next. Only the process that
reserved a block needs to know its size. With the in-process cache each process has its
own blocks, of ``block`` ids: ids increase within the process.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from shardkit import metrics
from shardkit._fork import reset_in_child
from shardkit._program import Blocking, Clock, Program, call, role, rule
from shardkit.cache.base import Cache
from shardkit.counters.base import (
    CounterCore,
    CounterRoles,
    CounterSettings,
    Options,
    best_effort,
    incarnation_key,
)
from shardkit.errors import BackendError
from shardkit.store.base import CounterInfo, Deleted, Store
from shardkit.validation import check_block, check_count

if TYPE_CHECKING:
    import asyncio

R = TypeVar("R")

# Blocks whose key the cache lost at once, or failed to increment, before giving up.
_ATTEMPTS = 5
# How long a writer waits for the writer that claimed the next block to publish it,
# before reserving one itself (that writer may have died).
_CLAIM_WAIT = 5.0
# How many times ``block`` the blocks published ahead may grow to.
_GROWTH = 64
# Seconds a grown size lasts, from its first growth: then blocks start from ``block`` again.
_GROWN_FOR = 60.0
_PREPARING = metrics.action("publishing the next id block ahead")
SUB_BLOCK = 50
"""Ids a process takes from a block at a time by default: one cache round trip per 50
ids."""


@role("guard")
class Guard:
    """The lock that lets one writer of a process at a time take a sub-block or leave a
    generation: one ``make()`` makes (``threading.Lock``, or ``asyncio.Lock``), and a
    forked child makes its own (another thread of the parent may have held the parent's
    when it forked, and would never release the child's copy). Acquiring it is a call
    the runner carries out (awaited on an event loop); it returns the lock's release,
    which never blocks, so that a program's ``finally`` block releases it even when the
    program is closed."""

    def __init__(self, make: Callable[[], threading.Lock | asyncio.Lock]) -> None:
        self._make = make
        self._renew()
        reset_in_child(self, Guard._renew)

    def _renew(self) -> None:
        self._lock = self._make()

    def acquire(self) -> Any:
        """The lock's release, once it is held (or an awaitable of it)."""
        acquiring = self._lock.acquire()
        return self._then(acquiring) if inspect.isawaitable(acquiring) else self._lock.release

    async def _then(self, acquiring: Awaitable[Any]) -> Callable[[], None]:
        await acquiring
        return self._lock.release


@dataclass(frozen=True, slots=True)
class IdRoles(CounterRoles):
    """What an id allocator's programs run on."""

    guard: Guard
    clock: Clock


class IdCore(CounterCore):
    """The id allocator's rules, for its sync and async forms (see ``IdAllocator``); its
    programs run on ``IdRoles``: the kit's backends, and the form's ``guard`` (a lock of
    its kind) and ``clock`` (what waits), checked as it is built."""

    kind = "ids"
    """The counter's kind."""
    roles: IdRoles

    def __init__(
        self,
        info: CounterInfo,
        options: Options,
        block: int,
        sub_block: int,
        guard: Guard,
        clock: Clock,
    ) -> None:
        super().__init__(info, options)
        roles = options.roles
        self.roles = IdRoles(roles.store, roles.cache, roles.adjuster, guard, clock)
        self.block = check_block(block)
        """Ids reserved in the store at a time, at least: with sub-blocks on a shared
        cache, blocks grow up to 64 times that while they are used up before the next
        is published."""
        self.sub_block = check_block(sub_block, "sub_block")
        """Ids this process takes from a block at a time, through the cache."""
        # Processes that share sub-blocks of a block publish the next one ahead (not
        # with a sub-block of 1: writers that join would take ids above those of the
        # block still in use).
        self._ahead = sub_block > 1 and options.shared_cache
        self._pointer_key = pointer_key(options, info)
        self._mark = 0  # the generation written to: its block ends at this id
        self._key = ""
        # The generation this process published last, and its block's size, until the
        # process takes ids of it (and publishes the next ahead).
        self._published = (0, 0)
        self._forked()
        reset_in_child(self, IdCore._forked)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} block={self.block}>"

    def _forked(self) -> None:
        """Hold no sub-block, behind a free lock (as a forked child must: its parent's
        sub-block is its parent's)."""
        self._spare = threading.Lock()  # held only to read or change the two below
        self._next, self._last = 1, 0  # the sub-block's ids not handed out yet

    def _drop(self) -> None:
        """Let go of the sub-block: its ids not handed out yet become a hole."""
        with self._spare:
            self._next, self._last = 1, 0

    def _key_of(self, mark: int) -> str:
        return block_key(self._options, self.name, mark)

    @rule
    def next(self) -> Program[int]:
        """A new id: from this process's sub-block, in memory; one cache round trip per
        sub-block, plus one store round trip per block used."""
        return metrics.timed(self.kind, self._new_id())

    def _new_id(self) -> Program[int]:
        found = self._spared()
        return found if found is not None else (yield from self._refill())

    def _spared(self) -> int | None:
        """The next id of the sub-block, None if it is used up."""
        with self._spare:
            found = self._next
            if found > self._last:
                return None
            self._next = found + 1
            return found

    def _refill(self) -> Program[int]:
        """An id for a writer that found the sub-block used up: the next of the one
        another writer of the process took meanwhile, else the first of a new one,
        whose rest is left for the process's writers. A sub-block of 1 has no rest:
        its writers take theirs without the guard, concurrently."""
        if self.sub_block == 1:
            first, _ = yield from self._take_sub_block(self._move_on)
            return first
        release: Callable[[], None] = yield from call(Guard.acquire)
        try:
            found = self._spared()
            if found is not None:
                return found
            first, last = yield from self._take_sub_block(self._leave)
            with self._spare:
                self._next, self._last = first + 1, last
            return first
        finally:
            release()

    def _take_sub_block(self, move_on: Callable[[int], Program[bool]]) -> Program[tuple[int, int]]:
        """The first and last id of a new sub-block: up to ``sub_block`` ids of the
        current generation's block, taken by one ``incr`` of its key; ``move_on(mark)``
        leaves a generation whose block is used up or lost (``_move_on``, or ``_leave``
        for a writer that holds the guard).

        A block whose key the cache fails to increment is left behind, as if lost (its
        unused ids become a hole). (memcached's refusals of a key holding a number are
        repaired by the cache itself; this is for a cache that gives up.)"""
        losses = refusals = 0
        size = self.sub_block
        while True:
            mark, key = self._mark, self._key
            if mark:
                try:
                    top = yield from call(Cache.incr, key, size)
                except BackendError:
                    refusals += 1
                    if refusals == _ATTEMPTS:
                        raise
                    top = None
                if top is not None and top - size < mark:
                    if self._ahead:
                        yield from best_effort(
                            self._options, _PREPARING, self._prepare(mark, top - size + 1, top)
                        )
                    return top - size + 1, min(top, mark)
            # Used up (by this and other writers), lost, or none yet: move on.
            if (yield from move_on(mark)):
                losses += 1
                if losses == _ATTEMPTS:
                    raise BackendError(f"the cache kept losing the ids of {self.name!r}")

    @rule
    def take(self, count: int) -> Program[list[int]]:
        """``count`` (1 … 1,000,000) new ids, in increasing order."""
        ids = []
        for _ in range(check_count(count)):
            ids.append((yield from IdCore.next.program(self)))
        return ids

    def _move_on(self, spent: int) -> Program[bool]:
        """Leave generation ``spent``: adopt a newer one that the cache points at, or
        start one. Of the writers leaving ``spent`` one claims the next block (through
        the cache) and the others wait for it, so a shared block is replaced once.
        Returns whether this call had to start a generation because ``spent`` had lost
        its key while current."""
        release: Callable[[], None] = yield from call(Guard.acquire)
        try:
            return (yield from self._leave(spent))
        finally:
            release()

    def _leave(self, spent: int) -> Program[bool]:
        if self._mark != spent:  # another writer moved on meanwhile
            return False
        pointer = yield from call(Cache.get, self._pointer_key)
        if pointer is not None and pointer > spent:
            self._adopt(pointer)
            return False
        claim = incarnation_key(self._options, self.info, f"ids:claim:{spent}")
        if not (yield from call(Cache.add, claim, 1, _CLAIM_WAIT * 2)):
            newer = yield from self._wait_for_newer(spent, claim)
            if newer is not None:
                self._adopt(newer)
                return False
        lost = bool(spent) and (yield from call(Cache.get, self._key_of(spent))) is None
        yield from self._released_if_failing(claim, self._start())
        if spent:
            yield from call(Cache.delete, self._key_of(spent))  # used up or lost
        if lost:
            metrics.meter.lost_block()
        return lost

    def _wait_for_newer(self, spent: int, claim: str) -> Program[int | None]:
        """The generation after ``spent`` once the holder of ``claim`` publishes it; None
        if it releases the claim without one, or if none shows within ``_CLAIM_WAIT``
        seconds."""
        deadline = time.monotonic() + _CLAIM_WAIT
        pause = 0.0005
        while time.monotonic() < deadline:
            found = yield from call(Cache.get_many, [self._pointer_key, claim])
            pointer = found.get(self._pointer_key)
            if pointer is not None and pointer > spent:
                return pointer
            if claim not in found:
                return None
            yield from call(Clock.sleep, pause)
            pause = min(pause * 2, 0.05)
        return None

    def _prepare(self, mark: int, first: int, top: int) -> Program[None]:
        """For the first writer of the process that published generation ``mark`` to
        take a sub-block of it (``first … top``): publish the next generation, so that
        the writers that find ``mark`` used up adopt it at once instead of claiming it
        and waiting. If one found it used up before (its sub-block past the end: it
        waited), the blocks published from then on are twice the one just published
        (``_grow``), unless that one is already larger than ``mark``'s. For the writer
        whose sub-block holds the block's last id: delete the spent key once the next
        generation is published (the publisher deletes it if it finds it spent by then:
        one of the two sees the other's step; and a writer that has to start a
        generation itself deletes the key it leaves)."""
        published, block = self._published
        if mark == published:
            self._published = (0, 0)
            claim = incarnation_key(self._options, self.info, f"ids:claim:{mark}")
            if (yield from call(Cache.add, claim, 1, _CLAIM_WAIT * 2)):
                _, size = yield from self._released_if_failing(claim, self._publish())
                count = yield from call(Cache.get, self._key_of(mark))
                if count is not None and count >= mark:
                    yield from call(Cache.delete, self._key_of(mark))
                    if count >= mark + self.sub_block and size <= block:
                        yield from self._grow(size)
        if first <= mark <= top:
            pointer = yield from call(Cache.get, self._pointer_key)
            if pointer is not None and pointer > mark:
                yield from call(Cache.delete, self._key_of(mark))

    def _released_if_failing(self, claim: str, step: Program[R]) -> Program[R]:
        """``step``, deleting ``claim`` if it fails: no block is coming from the claim
        (the store is down, most likely), so the others try for themselves instead of
        waiting."""
        try:
            return (yield from step)
        except BackendError:
            with contextlib.suppress(BackendError):
                yield from call(Cache.delete, claim)
            raise

    def _start(self) -> Program[None]:
        """Start a generation: publish one (``_publish``) and write to it."""
        mark, _ = yield from self._publish()
        self._adopt(mark)

    def _publish(self) -> Program[tuple[int, int]]:
        """Reserve a block in the store (of the allocator's current incarnation:
        ``CounterCore._follow``) of ``block`` ids, or with sub-blocks on a shared cache
        of as many as the blocks have grown to (``_grow``), and publish its generation
        in the cache; its mark and size (``_published`` too)."""
        yield from self._follow()
        size = self.block
        if self._ahead:
            grown = yield from call(Cache.get, self._size_key())
            size = min(max(grown or 0, self.block), self.block * _GROWTH)
        mark = yield from call(Store.reserve, self.name, size)
        metrics.meter.reserved(size)
        yield from call(Cache.add, self._key_of(mark), mark - size, None)
        yield from call(Cache.delete, self._pointer_key)
        yield from call(Cache.add, self._pointer_key, mark, None)
        self._published = (mark, size)
        return self._published

    def _grow(self, size: int) -> Program[None]:
        """Have the blocks published from now on be twice ``size`` (at most ``_GROWTH``
        times ``block``), by every process that shares the cache: for ``_GROWN_FOR``
        seconds from the first growth, then they start from ``block`` again."""
        if 2 * size <= self.block * _GROWTH:
            key = self._size_key()
            if (yield from call(Cache.incr, key, size)) is None:
                yield from call(Cache.add, key, 2 * size, _GROWN_FOR)

    def _size_key(self) -> str:
        """The cache key of the size the blocks published ahead have grown to."""
        return incarnation_key(self._options, self.info, "ids:block")

    def _moved(self) -> None:
        self._pointer_key = pointer_key(self._options, self.info)
        self._drop()  # the ended incarnation's

    def _expire(self) -> None:
        """Also let go of the sub-block: the next id comes through the cache, which
        tells whether the allocator still stands (its keys go with it)."""
        super()._expire()
        self._drop()

    def _adopt(self, mark: int) -> None:
        self._key = self._key_of(mark)
        self._mark = mark

    @rule
    def reserved(self) -> Program[int]:
        """The high-water mark: every id handed out so far is at most this."""
        return (yield from call(Store.total, self.name))


def pointer_key(options: Options, info: CounterInfo) -> str:
    """The cache key that points an id allocator's incarnation ``info`` at the block its
    ids come from (its mark)."""
    return incarnation_key(options, info, "ids:generation")


def block_key(options: Options, name: str, mark: int) -> str:
    """The cache key that hands out the ids of the block ending at ``mark`` (no
    incarnation: a mark is never reserved twice for a name)."""
    return options.cache_key(name, f"ids:{mark}")


def forget(options: Options, deleted: Deleted) -> Program[None]:
    """Remove the cache keys of the deleted id allocator ``deleted``: its pointer, and
    the block it points at (a writer still holding the allocator then finds the block
    gone, and moves to the next allocator of the name)."""
    key = pointer_key(options, deleted.info)
    mark = yield from call(Cache.get, key)
    if mark is not None:
        yield from call(Cache.delete, block_key(options, deleted.info.name, mark))
    yield from call(Cache.delete, key)


class IdAllocator(IdCore, Blocking):
    """Hands out unique ids (ints ≥ 1), increasing in every process.

    Guarantees: no id is ever handed out twice — across processes, machines, threads,
    forks, cache loss and process death — because every id comes from a block reserved
    in the store before any of its ids is handed out, and from one process's sub-block
    of it. Ids increase within a process, and across the processes that share a cache
    when each of them uses ``sub_block=1``. Holes are allowed. Thread-safe.
    """

    def __init__(
        self, info: CounterInfo, settings: CounterSettings, block: int, sub_block: int
    ) -> None:
        super().__init__(info, settings, block, sub_block, Guard(threading.Lock), time)
