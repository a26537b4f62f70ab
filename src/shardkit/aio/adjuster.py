"""The async kit's adjuster of cached values: ``AsyncAdjuster``."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from shardkit._failures import FailureLog
from shardkit._program import arun, run
from shardkit.counters.adjuster import SYNC_TIMEOUT, Sending, sending


class AsyncAdjuster:
    """``Adjuster``'s contract for an async kit: a task of the event loop sends what
    has gathered, ``delay`` seconds after the first of it. ``add`` never waits;
    ``sync()`` and ``close()`` are awaited. Belongs to the event loop it is first used
    on."""

    def __init__(self, cache: Any, failures: FailureLog, delay: float) -> None:
        self._cache = cache  # an async cache, or the (never blocking) in-process one
        self._failures = failures
        self._delay = delay
        self._roles = Sending(cache)
        self._pending: dict[str, int] = {}
        self._added = 0
        self._sent = 0
        self._hurry = asyncio.Event()  # a sync or close is waiting: send without the delay
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    def add(self, key: str, delta: int) -> None:
        """Move the cached value under ``key`` (if present) by ``delta``: soon, or at
        once with an in-process cache."""
        if not self._cache.shared:  # the in-process cache: it never blocks
            run(sending(self._failures, {key: delta}), self._roles)
            return
        self._pending[key] = self._pending.get(key, 0) + delta
        self._added += 1
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def sync(self) -> None:
        """Wait until every adjustment added before this call has been sent or dropped
        (at most a few seconds: then the cache is served as it is)."""
        target = self._added
        if self._sent < target:
            self._hurry.set()
            async with self._changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: self._sent >= target), SYNC_TIMEOUT
                    )

    async def close(self) -> None:
        """Send what is pending (waiting a few seconds at most). Idempotent."""
        self._hurry.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), SYNC_TIMEOUT)

    async def _run(self) -> None:
        while self._pending:
            if not self._hurry.is_set():
                with contextlib.suppress(asyncio.TimeoutError):  # a sync or close cuts it short
                    await asyncio.wait_for(self._hurry.wait(), self._delay)
            self._hurry.clear()
            batch, self._pending = self._pending, {}
            upto = self._added
            await self._send(batch)
            self._sent = upto
            async with self._changed:
                self._changed.notify_all()
        self._task = None

    async def _send(self, batch: dict[str, int]) -> None:
        await arun(sending(self._failures, batch), self._roles)


__all__ = ["AsyncAdjuster"]
