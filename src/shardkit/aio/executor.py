"""The async kit's executor: background tasks (buffered counters' flushes) as tasks of
the event loop, no threads."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from shardkit._failures import FailureLog
from shardkit.executor.base import Marks, Timing, When, reported

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("shardkit")

AsyncTask = Callable[[Mapping[str, Any]], Awaitable[object]]
_Entry = tuple[str, Mapping[str, Any]]


class LoopExecutor:
    """Runs an async kit's tasks on its event loop, ``delay`` seconds after submission.

    Deduplication marks live in the kit's cache under the same keys as the sync kit's
    executors' (``Marks``), so sync and async processes sharing a cache run one flush
    per counter per interval between them. A submission is shielded from its caller's
    cancellation: once its mark is taken, its task is scheduled. ``close()`` runs the
    delayed tasks at once and waits for every task, so a clean exit drops nothing.
    """

    url = "loop://"

    def __init__(self, marks: Marks) -> None:
        self._marks = marks
        self._tasks: Mapping[str, AsyncTask] = {}
        self._delayed: dict[int, tuple[asyncio.TimerHandle, _Entry]] = {}
        self._numbers = itertools.count()
        self._running: set[asyncio.Task[None]] = set()
        self._failures = FailureLog(log)

    def bind(self, tasks: Mapping[str, AsyncTask]) -> None:
        """Serve ``tasks`` by name."""
        self._tasks = tasks

    async def submit(self, task: str, args: Mapping[str, Any], **when: Unpack[When]) -> bool:
        """``Executor.submit``, awaited. Each task starts when due (nothing waits for a
        worker), so ``merge`` has nothing to take a task into."""
        delay, dedupe, window, _ = Timing(**when)
        return await asyncio.shield(self._submit(task, args, delay, dedupe, window))

    async def _submit(
        self, task: str, args: Mapping[str, Any], delay: float, dedupe: str | None, window: float
    ) -> bool:
        if dedupe is not None:
            claimed: Any = self._marks.claim(dedupe, delay + window)
            if inspect.isawaitable(claimed):  # (the in-process cache answers at once)
                claimed = await claimed
            if not claimed:
                return False
        number = next(self._numbers)
        handle = asyncio.get_running_loop().call_later(delay, self._due, number)
        self._delayed[number] = (handle, (task, args))
        return True

    def _due(self, number: int) -> None:
        _, (task, args) = self._delayed.pop(number)
        self._start(task, args)

    def _start(self, task: str, args: Mapping[str, Any]) -> None:
        running = asyncio.get_running_loop().create_task(self._run(task, args))
        self._running.add(running)
        running.add_done_callback(self._running.discard)

    async def _run(self, task: str, args: Mapping[str, Any]) -> None:
        with reported(self._failures, task, args):
            await self._tasks[task](args)

    async def close(self) -> None:
        """Run the delayed tasks now, and wait for every task."""
        delayed, self._delayed = self._delayed, {}
        for handle, (task, args) in delayed.values():
            handle.cancel()
            self._start(task, args)
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)


__all__ = ["AsyncTask", "LoopExecutor"]
