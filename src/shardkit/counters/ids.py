"""The id allocator: ids that are never handed out twice, from blocks reserved in the
store before any of their ids is handed out.

Each *generation* of an allocator owns one block: the store raises the allocator's
high-water mark by ``block`` (atomically, durably) and the block ``mark - block + 1 …
mark`` belongs to that generation alone. Its ids are handed out by incrementing one cache
key, ``ids:<mark>``, created once at the block's start. An id is handed out only if it
lies inside the block of the key that produced it, so ids of different generations can
never meet, and within a generation the cache's atomic increment hands each id out once.
When the block is used up, or the cache loses the key (eviction, restart, FLUSHALL), a
writer reserves a new block — above every block ever reserved, hence above every id ever
handed out. Holes (the unused rest of a block) are allowed; duplicates never. The key
of a block is created only by the writer that reserved it, and the cache's ``incr`` never
creates one, so a lost key is never re-created below the ids it handed out.

With a shared cache, every process takes ids from the same generation, so ids increase
across processes too: of the writers that find a block used up, one claims the next
(an add-if-absent in the cache) and the others wait for it. With the in-process cache
each process has its own block: ids increase within the process.
"""

from __future__ import annotations

import contextlib
import threading
import time

from shardkit.counters.base import CounterSettings
from shardkit.errors import BackendError
from shardkit.store.base import CounterInfo
from shardkit.validation import check_block, check_count

# Blocks whose key the cache lost at once, or failed to increment, before giving up.
_ATTEMPTS = 5
# How long a writer waits for the writer that claimed the next block to publish it,
# before reserving one itself (that writer may have died).
_CLAIM_WAIT = 5.0


class IdAllocator:
    """Hands out unique ids (ints ≥ 1), increasing in every process.

    Guarantees: no id is ever handed out twice — across processes, machines, cache loss
    and process death — because every id comes from a block reserved in the store
    before any of its ids is handed out. Ids increase within a process, and across
    processes when they share a cache. Holes are allowed. Thread-safe.
    """

    kind = "ids"

    def __init__(self, info: CounterInfo, settings: CounterSettings, block: int) -> None:
        self.name = info.name
        self.block = check_block(block)
        self._settings = settings
        self._pointer_key = settings.cache_key(self.name, "ids:generation")
        self._lock = threading.Lock()
        self._mark = 0  # the generation written to: its block ends at this id
        self._key = ""

    def __repr__(self) -> str:
        return f"<IdAllocator {self.name!r} block={self.block}>"

    def _key_of(self, mark: int) -> str:
        return self._settings.cache_key(self.name, f"ids:{mark}")

    def next(self) -> int:
        """A new id: one cache round trip, plus one store round trip per block used.

        A block whose key the cache fails to increment is left behind, as if lost (its
        unused ids become a hole). (memcached's refusals of a key holding a number are
        repaired by the cache itself; this is for a cache that gives up.)"""
        cache = self._settings.cache
        losses = refusals = 0
        while True:
            mark, key = self._mark, self._key
            if mark:
                try:
                    candidate = cache.incr(key, 1)
                except BackendError:
                    refusals += 1
                    if refusals == _ATTEMPTS:
                        raise
                    candidate = None
                if candidate is not None and candidate <= mark:
                    return candidate
            # Used up (by this and other writers), lost, or none yet: move on.
            if self._move_on(mark):
                losses += 1
                if losses == _ATTEMPTS:
                    raise BackendError(f"cache {cache.url} kept losing the ids of {self.name!r}")

    def take(self, count: int) -> list[int]:
        """``count`` (1 … 1,000,000) new ids, in increasing order."""
        return [self.next() for _ in range(check_count(count))]

    def _move_on(self, spent: int) -> bool:
        """Leave generation ``spent``: adopt a newer one that the cache points at, or
        start one. Of the writers leaving ``spent`` one claims the next block (through
        the cache) and the others wait for it, so a shared block is replaced once.
        Returns whether this call had to start a generation because ``spent`` had lost
        its key while current."""
        with self._lock:
            if self._mark != spent:  # another thread moved on meanwhile
                return False
            cache = self._settings.cache
            pointer = cache.get(self._pointer_key)
            if pointer is not None and pointer > spent:
                self._adopt(pointer)
                return False
            claim = self._settings.cache_key(self.name, f"ids:claim:{spent}")
            if not cache.add(claim, 1, _CLAIM_WAIT * 2):
                newer = self._wait_for_newer(spent, claim)
                if newer is not None:
                    self._adopt(newer)
                    return False
            lost = bool(spent) and cache.get(self._key_of(spent)) is None
            try:
                self._start()
            except BackendError:
                # No block is coming from this claim (the store is down, most likely):
                # release it, so that the others try for themselves instead of waiting.
                with contextlib.suppress(BackendError):
                    cache.delete(claim)
                raise
            if spent:
                cache.delete(self._key_of(spent))  # used up or lost: nobody needs it
            return lost

    def _wait_for_newer(self, spent: int, claim: str) -> int | None:
        """The generation after ``spent`` once the holder of ``claim`` publishes it; None
        if it releases the claim without one, or if none shows within ``_CLAIM_WAIT``
        seconds."""
        cache = self._settings.cache
        deadline = time.monotonic() + _CLAIM_WAIT
        pause = 0.0005
        while time.monotonic() < deadline:
            found = cache.get_many([self._pointer_key, claim])
            pointer = found.get(self._pointer_key)
            if pointer is not None and pointer > spent:
                return pointer
            if claim not in found:
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return None

    def _start(self) -> None:
        """Reserve a block in the store and publish its generation in the cache."""
        cache = self._settings.cache
        mark = self._settings.store.reserve(self.name, self.block)
        cache.add(self._key_of(mark), mark - self.block, None)
        cache.delete(self._pointer_key)
        cache.add(self._pointer_key, mark, None)
        self._adopt(mark)

    def _adopt(self, mark: int) -> None:
        self._key = self._key_of(mark)
        self._mark = mark

    def reserved(self) -> int:
        """The high-water mark: every id handed out so far is at most this."""
        return self._settings.store.total(self.name)
