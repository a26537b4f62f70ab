"""The adjuster of cached values (see ``shardkit.counters.adjuster``) of an async kit,
``AsyncAdjuster``, sending from a task of its event loop, and of a sync kit,
``Adjuster``, sending from a thread: written once here, the thread form generated from
it (``shardkit/_sync/adjuster.py``, by ``tools/generate_sync.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from shardkit._concurrency import AsyncBackground, AsyncEvent, AsyncLock
from shardkit._fork import reset_in_child
from shardkit._program import Program, Roles, arun, run

# How long ``sync`` waits for adjustments to be sent before serving the cache as it is,
# and ``close`` for the last of them (a cache that hangs must not hang the kit's close).
SYNC_TIMEOUT = 10.0


class AsyncAdjuster:
    """Plays ``Adjusting``: gathers adjustments of cached values and sends them, every
    key in one call, ``delay`` seconds after the first of them, from a routine of its
    own (a task of the event loop it is first used on, or a thread), which ends when
    nothing is left to send. ``add`` never waits; a sync or close cuts the delay short.

    A batch is sent by the program ``send(batch)`` (``shardkit.counters.adjuster``'s
    ``sending``), run on ``roles``; with a cache that is not ``shared`` (in-process:
    nothing to gain) each adjustment is sent at once, by the caller.

    Safe for a process's threads (the thread form) or the coroutines of one event loop
    (the async form). A forked child starts empty: its parent's adjustments are the
    parent's to send.
    """

    def __init__(
        self,
        send: Callable[[dict[str, int]], Program[None]],
        roles: Roles,
        shared: bool,
        delay: float,
    ) -> None:
        self._send = send
        self._roles = roles
        self._shared = shared
        self._delay = delay
        self._reset()
        reset_in_child(self, AsyncAdjuster._reset)

    def _reset(self) -> None:
        self._lock = AsyncLock()
        self._pending: dict[str, int] = {}
        self._added = 0  # adjustments added so far
        self._sent = 0  # how many of them were sent (or dropped)
        self._hurry = AsyncEvent()  # a sync or close waits: send without the delay
        self._progress = AsyncEvent()  # set (and made anew) when a batch has been sent
        self._closed = False
        self._sender: AsyncBackground | None = None  # while something is left to send

    def add(self, key: str, delta: int) -> None:
        """Move the cached value under ``key`` (if present) by ``delta``: soon, or at
        once with an in-process cache."""
        if not self._shared:  # in-process: sent at once, which never blocks
            run(self._send({key: delta}), self._roles)
            return
        with self._lock:
            self._pending[key] = self._pending.get(key, 0) + delta
            self._added += 1
            if self._sender is None:
                self._sender = AsyncBackground(self._send_pending, "shardkit-adjuster")

    async def sync(self) -> None:
        """Wait until every adjustment added before this call has been sent or dropped
        (``SYNC_TIMEOUT`` seconds at most: then the cache is served as it is)."""
        deadline = time.monotonic() + SYNC_TIMEOUT
        with self._lock:
            target = self._added
            if self._sent < target:
                self._hurry.set()
        while True:
            with self._lock:
                if self._sent >= target:
                    return
                progress = self._progress
            left = deadline - time.monotonic()
            if left <= 0 or not await progress.wait(left):
                return

    async def close(self) -> None:
        """Send what is pending, without the delay (waiting ``SYNC_TIMEOUT`` seconds at
        most). Idempotent; what is added afterwards is sent without the delay too."""
        with self._lock:
            self._closed = True
            self._hurry.set()
            sender = self._sender
        if sender is not None:
            await sender.join(SYNC_TIMEOUT)

    async def _send_pending(self) -> None:
        """The sender: each batch ``delay`` after the last, until nothing is left."""
        try:
            while True:
                await self._hurry.wait(self._delay)  # a sync or close cuts it short
                with self._lock:
                    batch, self._pending = self._pending, {}
                    upto = self._added
                    if not self._closed:
                        self._hurry.clear()
                    if not batch:
                        self._sender = None
                        return
                await arun(self._send(batch), self._roles)
                with self._lock:
                    self._sent = upto
                    progress, self._progress = self._progress, AsyncEvent()
                progress.set()
        except BaseException:  # a cancelled task (its loop closing): the next add starts one
            with self._lock:
                self._sender = None
            raise


__all__ = ["AsyncAdjuster"]
