"""The in-process cache: the embedded default. Shared by the threads of one process."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable

from shardkit._fork import reset_in_child


class MemoryCache:
    """A dict of integers with expiry, guarded by a lock.

    Thread-safe and atomic within one process; each process has its own contents (a
    forked child starts empty), so it is a cache for one process, not a shared one.
    """

    url = "memory://"
    shared = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, tuple[int, float]] = {}
        reset_in_child(self, MemoryCache._after_fork)

    def _after_fork(self) -> None:
        # Another thread may have held the lock at the fork: the child's copy would
        # never be released. The contents go too: a child writing on into its copy of
        # the parent's keys would make two diverging histories of one buffered counter.
        self._lock = threading.Lock()
        self._data = {}

    def _live(self, key: str, now: float) -> tuple[int, float] | None:
        entry = self._data.get(key)
        if entry is not None and entry[1] <= now:
            del self._data[key]
            return None
        return entry

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
            if self._live(key, now) is not None:
                return False
            self._data[key] = (value, math.inf if ttl is None else now + ttl)
            return True

    def incr(self, key: str, delta: int) -> int | None:
        with self._lock:
            entry = self._live(key, time.monotonic())
            if entry is None:
                return None
            self._data[key] = (entry[0] + delta, entry[1])
            return entry[0] + delta

    def bump(self, key: str, delta: int) -> int:
        with self._lock:
            entry = self._live(key, time.monotonic())
            value, expires = entry if entry is not None else (0, math.inf)
            self._data[key] = (value + delta, expires)
            return value + delta

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def close(self) -> None:
        with self._lock:
            self._data.clear()
