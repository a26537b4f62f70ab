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
from shardkit.errors import ConfigurationError
from shardkit.executor.base import Marks, Timing, When, reported
from shardkit.executor.queue import Entry, TaskQueue

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("shardkit")

AsyncTask = Callable[[Mapping[str, Any]], Awaitable[object]]


class LoopExecutor:
    """Runs an async kit's tasks on its event loop, ``delay`` seconds after submission,
    at most ``workers`` at a time: those due wait in a ``TaskQueue``, under the local
    executor's rules, so a task submitted with ``merge`` that comes due while another
    with the same ``merge`` waits is taken into that one (when flushes fall behind, each
    counter has at most one waiting, and one line is logged).

    Deduplication marks live in the kit's cache under the same keys as the sync kit's
    executors' (``Marks``), so sync and async processes sharing a cache run one flush
    per counter per interval between them. A submission is shielded from its caller's
    cancellation: once its mark is taken, its task is scheduled. ``close()`` runs the
    delayed tasks at once and waits for every task, so a clean exit drops nothing.
    """

    def __init__(self, marks: Marks, workers: int = 4) -> None:
        if workers < 1:
            raise ConfigurationError("a loop executor needs at least 1 worker")
        self.workers = workers
        self.url = f"loop://?workers={workers}"
        self._marks = marks
        self._tasks: Mapping[str, AsyncTask] = {}
        self._delayed: dict[int, tuple[asyncio.TimerHandle, Entry]] = {}
        self._numbers = itertools.count()
        self._queue = TaskQueue(self.url)
        self._running: set[asyncio.Task[None]] = set()
        self._failures = FailureLog(log)

    @property
    def queued(self) -> int:
        """How many tasks are due and wait for a worker."""
        return len(self._queue)

    def bind(self, tasks: Mapping[str, AsyncTask]) -> None:
        """Serve ``tasks`` by name."""
        self._tasks = tasks

    async def submit(self, task: str, args: Mapping[str, Any], **when: Unpack[When]) -> bool:
        """``Executor.submit``, awaited."""
        delay, dedupe, window, merge = Timing(**when)
        return await asyncio.shield(self._submit(Entry(task, args, merge), delay, dedupe, window))

    async def _submit(self, entry: Entry, delay: float, dedupe: str | None, window: float) -> bool:
        if dedupe is not None:
            claimed: Any = self._marks.claim(dedupe, delay + window)
            if inspect.isawaitable(claimed):  # (the in-process cache answers at once)
                claimed = await claimed
            if not claimed:
                return False
        if delay <= 0:
            self._put(entry)
            return True
        number = next(self._numbers)
        handle = asyncio.get_running_loop().call_later(delay, self._due, number)
        self._delayed[number] = (handle, entry)
        return True

    def _due(self, number: int) -> None:
        _, entry = self._delayed.pop(number)
        self._put(entry)

    def _put(self, entry: Entry) -> None:
        """Queue a task due (unless one waiting takes it in), and start what waits."""
        if self._queue.put(entry):
            self._start_waiting()

    def _start_waiting(self) -> None:
        """Start the tasks waiting, while fewer than ``workers`` run (called again as
        each ends)."""
        while len(self._running) < self.workers and (entry := self._queue.take()) is not None:
            running = asyncio.get_running_loop().create_task(self._run(entry))
            self._running.add(running)
            running.add_done_callback(self._ended)

    def _ended(self, running: asyncio.Task[None]) -> None:
        self._running.discard(running)
        self._start_waiting()

    async def _run(self, entry: Entry) -> None:
        with reported(self._failures, entry.task, entry.args):
            await self._tasks[entry.task](entry.args)

    async def close(self) -> None:
        """Run the delayed tasks now, and wait for every task."""
        delayed, self._delayed = self._delayed, {}
        for handle, entry in sorted(delayed.values(), key=lambda due: due[0].when()):
            handle.cancel()
            self._put(entry)
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)


__all__ = ["AsyncTask", "LoopExecutor"]
