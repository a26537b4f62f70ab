"""The in-process cache: the embedded default. Shared by the threads of one process."""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

from shardkit._fork import reset_in_child


class MemoryCache:
    """A dict of integers with expiry, guarded by a lock.

    Thread-safe and atomic within one process; each process has its own contents (a
    forked child starts empty), so it is a cache for one process, not a shared one.

    Bounded for processes that run for weeks: expired keys are dropped as time passes,
    whether or not anything reads them again (each add sweeps what has expired, oldest
    first: O(log n) a key), and past ``max_keys`` keys the least recently used one is
    evicted — a loss that every counter tolerates, as it tolerates a shared cache's
    evictions.
    """

    url = "memory://"
    shared = False

    def __init__(self, max_keys: int = 1_000_000) -> None:
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._data: dict[str, tuple[int, float]] = {}  # least recently used first
        self._expiries: list[tuple[float, str]] = []  # a heap of the keys with a TTL
        reset_in_child(self, MemoryCache._after_fork)

    def _after_fork(self) -> None:
        # Another thread may have held the lock at the fork: the child's copy would
        # never be released. The contents go too: a child writing on into its copy of
        # the parent's keys would make two diverging histories of one buffered counter.
        self._lock = threading.Lock()
        self._data = {}
        self._expiries = []

    def size(self) -> int:
        """How many keys it holds (expired ones not swept yet included)."""
        return len(self._data)

    def _live(self, key: str, now: float) -> tuple[int, float] | None:
        """The entry under ``key`` unless it has expired (then dropped); it becomes the
        most recently used."""
        entry = self._data.pop(key, None)
        if entry is None or entry[1] <= now:
            return None
        self._data[key] = entry
        return entry

    def _sweep(self, now: float) -> None:
        """Drop the keys that have expired, oldest first."""
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            when, old = heapq.heappop(expiries)
            entry = self._data.get(old)
            if entry is not None and entry[1] == when:  # not set again since
                del self._data[old]

    def _store(self, key: str, value: int, expires: float) -> None:
        """Set ``key`` (as the most recently used); past ``max_keys``, drop the least
        recently used keys."""
        self._data[key] = (value, expires)
        if expires != math.inf:
            heapq.heappush(self._expiries, (expires, key))
        while len(self._data) > self.max_keys:
            del self._data[next(iter(self._data))]

    def get(self, key: str) -> int | None:
        with self._lock:
            entry = self._live(key, time.monotonic())
        return None if entry is None else entry[0]

    def get_many(self, keys: Iterable[str]) -> dict[str, int]:
        now = time.monotonic()
        with self._lock:
            entries = {key: self._live(key, now) for key in keys}
        return {key: entry[0] for key, entry in entries.items() if entry is not None}

    def add(self, key: str, value: int, ttl: float | None) -> bool:
        now = time.monotonic()
        with self._lock:
            self._sweep(now)
            if self._live(key, now) is not None:
                return False
            self._store(key, value, math.inf if ttl is None else now + ttl)
            return True

    def add_many(self, values: Mapping[str, int], ttl: float | None) -> None:
        for key, value in values.items():
            self.add(key, value, ttl)

    def incr(self, key: str, delta: int) -> int | None:
        with self._lock:
            entry = self._live(key, time.monotonic())
            if entry is None:
                return None
            self._data[key] = (entry[0] + delta, entry[1])  # its TTL, already in the heap
            return entry[0] + delta

    def incr_many(self, deltas: Mapping[str, int]) -> None:
        for key, delta in deltas.items():
            self.incr(key, delta)

    def bump(self, key: str, delta: int) -> int:
        now = time.monotonic()
        with self._lock:
            entry = self._live(key, now)
            if entry is not None:
                self._data[key] = (entry[0] + delta, entry[1])
                return entry[0] + delta
            self._sweep(now)
            self._store(key, delta, math.inf)
            return delta

    def incr_once(
        self, sums: Sequence[str], writes: Sequence[tuple[str, int, int]], ttl: float
    ) -> tuple[list[int], list[bool]] | None:
        now = time.monotonic()
        with self._lock:
            entries = [self._live(key, now) for key in sums]
            present = [entry for entry in entries if entry is not None]
            if len(present) < len(entries):
                return None
            values = [value for value, _ in present]
            recorded: dict[str, None] = {}
            applied = []
            for record, index, delta in writes:
                fresh = record not in recorded and self._live(record, now) is None
                if fresh:
                    recorded[record] = None
                    values[index] += delta
                applied.append(fresh)
            for key, value, (_, expires) in zip(sums, values, present, strict=True):
                self._data[key] = (value, expires)  # its TTL, already in the heap
            self._sweep(now)
            for record in recorded:
                self._store(record, 1, now + ttl)
            return values, applied

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._expiries.clear()
