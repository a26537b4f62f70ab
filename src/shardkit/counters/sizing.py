"""When an automatic sharded counter grows: when more writers than it has shards take
turns on its rows, and their writes wait for each other.

Each writing process times its writes to the store. A write that waits for its row's
lock takes longer than the writer's fastest write by the wait, so over a window of
``WINDOW`` seconds the share of the writes' time spent beyond the fastest one (of this
window and the one before) measures how much they wait. At the end of each window a
process counts its writers among the counter's writers of that second, in the kit's
cache (shared by the processes: with an in-process cache a process sees only itself):
itself, whose writes are combined into one statement at a time, or each of its
threads that wrote on a home shard of its own (on the Django store, which combines
nothing: each write is part of its caller's transaction). When a
window had at least ``BUSY`` writes spending ``CONTENDED`` or more of their time
waiting, and the writers of one of the ``LOOKBACK`` seconds before (each writer
reports once a window, so in one of them at least) outnumber the shards, it grows to as
many shards as writers, rounded up to a power of two so that processes deciding at once
agree (at most the kit's ``max_shards``); then this process takes no
decision for ``SETTLE`` seconds, the time every process takes to pick the new count up,
so a burst grows a counter once. Slow writes alone (a busy machine) grow nothing, nor
does a counter written a few times a second, and no counter ever shrinks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

WINDOW = 1.0
LOOKBACK = 3
BUSY = 20
CONTENDED = 0.5
SETTLE = 10.0


class Window(NamedTuple):
    """One window of a process's writes to a counter."""

    writes: int
    waiting: float
    """The share of the writes' time spent waiting."""
    writers: int
    """How many of this process's writers wrote in it."""

    @property
    def contended(self) -> bool:
        """Whether the writes were many, and waited."""
        return self.writes >= BUSY and self.waiting >= CONTENDED


class Sizing:
    """One process's measure of a counter's contention. Thread-safe: writes not
    combined (a store whose writes belong to their callers' transactions) are timed by
    their threads at once, and one of them closes each window."""

    def __init__(self, maximum: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._maximum = maximum
        self._clock = clock
        self._start = clock()
        self._quiet_until = 0.0
        self._times: list[float] = []  # the window's writes, in seconds
        self._writers: set[object] = set()  # the window's writers
        self._fastest_before = float("inf")  # the window before's fastest write
        # Tried, never waited for: a thread finding it taken leaves the window to the
        # one closing it (and a child forked while it was taken never waits on it).
        self._closing = threading.Lock()

    def timed(self, seconds: float, writer: object = None) -> Window | None:
        """Note a write that took ``seconds``, made by ``writer`` (by default the process:
        one writer); the window, when this write ended one."""
        self._times.append(seconds)
        self._writers.add(writer)
        now = self._clock()
        if now - self._start < WINDOW or not self._closing.acquire(blocking=False):
            return None
        try:
            if now - self._start < WINDOW:  # closed by another thread meanwhile
                return None
            times, self._times, self._start = self._times, [], now
            writers, self._writers = self._writers, set()
        finally:
            self._closing.release()
        if not times:
            return None
        fastest = min(min(times), self._fastest_before)
        self._fastest_before = min(times)
        total = sum(times)
        waiting = sum(t - fastest for t in times) / total if total else 0.0
        return Window(len(times), waiting, len(writers))

    def grow_to(self, window: Window, writers: int, shards: int) -> int | None:
        """The shard count to grow to after ``window``, ``writers`` having written in
        a second lately; None: not now."""
        now = self._clock()
        if now < self._quiet_until or not window.contended or writers <= shards:
            return None
        if shards >= self._maximum:
            return None
        self._quiet_until = now + SETTLE
        # A power of two: processes deciding at once, from counts a writer apart, agree.
        return min(self._maximum, 1 << (writers - 1).bit_length())


__all__ = ["BUSY", "CONTENDED", "LOOKBACK", "SETTLE", "WINDOW", "Sizing", "Window"]
