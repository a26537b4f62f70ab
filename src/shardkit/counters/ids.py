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
handed out. Holes (the unused rest of a block) are allowed; duplicates never.

With a shared cache, every process takes ids from the same generation, so ids increase
across processes too (until two writers race to replace a lost generation). With the
in-process cache each process has its own block: ids increase within the process.
"""

from __future__ import annotations

import threading

from shardkit.counters.base import CounterSettings
from shardkit.errors import BackendError, ValidationError
from shardkit.store.base import CounterInfo

# Cache values are ids shifted by this offset: a key the cache lost and an increment
# re-created near 0 can never look like an id of a live block.
_BASE = 2**62
MAX_BLOCK = 2**40
_ATTEMPTS = 5


def check_block(block: object) -> int:
    """Return ``block`` if it is an int in 1 … 2**40 (not a bool)."""
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
        raise ValidationError(f"block must be an int in 1..2**40, not {block!r}")
    return block


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

    def next(self) -> int:
        """A new id: one cache round trip, plus one store round trip per block used."""
        cache = self._settings.cache
        losses = 0
        while True:
            mark, key = self._mark, self._key
            if mark:
                candidate = cache.bump(key, 1) - _BASE
                if mark - self.block < candidate <= mark:
                    return candidate
                if candidate <= mark - self.block:  # the cache lost the block's key
                    losses += 1
                    if losses == _ATTEMPTS:
                        raise BackendError(
                            f"cache {cache.url} kept losing the ids of {self.name!r}"
                        )
            # Used up (by this and other writers) or lost: move to a newer block.
            self._move_on(mark)

    def take(self, count: int) -> list[int]:
        """``count`` new ids, in increasing order."""
        return [self.next() for _ in range(count)]

    def _move_on(self, spent: int) -> None:
        """The generation ``spent`` is used up or lost: adopt a newer one that the cache
        points at, or reserve a block and start one."""
        with self._lock:
            if self._mark != spent:  # another thread moved on meanwhile
                return
            cache = self._settings.cache
            pointer = cache.get(self._pointer_key)
            if pointer is not None and pointer > spent:
                self._adopt(pointer)
                return
            mark = self._settings.store.reserve(self.name, self.block)
            key = self._key_of(mark)
            cache.add(key, _BASE + mark - self.block, None)
            if pointer is not None:
                cache.delete(self._pointer_key)
            # Losing this race leaves two live generations, each with its own block.
            cache.add(self._pointer_key, mark, None)
            self._adopt(mark)

    def _adopt(self, mark: int) -> None:
        self._key = self._key_of(mark)
        self._mark = mark

    def _key_of(self, mark: int) -> str:
        return self._settings.cache_key(self.name, f"ids:{mark}")

    def reserved(self) -> int:
        """The high-water mark: every id handed out so far is at most this."""
        return self._settings.store.total(self.name)
