"""The local executor: worker threads and a timer thread, inside the process. The default."""

from __future__ import annotations

import atexit
import heapq
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardkit._failures import FailureLog
from shardkit._fork import reset_in_child
from shardkit.errors import ConfigurationError
from shardkit.executor.base import Marks, Task, Timing, When, reported
from shardkit.executor.queue import Entry, TaskQueue

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("shardkit")


class LocalExecutor:
    """Runs tasks on ``workers`` threads of this process; delayed tasks wait in a heap
    watched by one timer thread. Threads start on the first submission.

    Tasks due wait for a worker in a ``TaskQueue``, whose rules the async kit's executor
    shares. Tasks submitted from outside the workers (and delayed tasks, when due) run
    first come, first served, ahead of follow-ups (below) — but when both wait, a worker
    takes one of each in turn, so a steady stream from outside (flushes that fall behind)
    cannot hold follow-ups (a job's ranges) back for ever. A task submitted with
    ``merge`` that comes due while another with the same ``merge`` waits for a worker is
    taken into that one: when the workers fall behind, each counter has at most one flush
    waiting, however long they take (the flush lag metric shows how far behind, and one
    line is logged).

    Tasks that a running task submits — its follow-up work, such as a mapping range's
    children — run newest first: a tree of tasks is walked depth first, so what waits is
    about ``fanout * depth`` tasks per worker, not a task for every pending node of the
    tree.

    ``close()`` — called by ``Kit.close()`` and at interpreter exit — runs every delayed
    task at once and waits for all of them, so nothing submitted is dropped by a clean
    exit. A process that dies loses what it had queued: tasks are idempotent and
    ``Kit.flush_all`` (or ``shardkit worker``) picks up what they would have done.
    A forked child starts empty: its parent keeps running what the parent submitted.
    """

    def __init__(self, workers: int = 4) -> None:
        if workers < 1:
            raise ConfigurationError("a local executor needs at least 1 worker")
        self.workers = workers
        self.url = f"local://?workers={workers}"
        self._tasks: Mapping[str, Task] = {}
        self._marks: Marks | None = None
        self._failures = FailureLog(log)
        self._reset()
        reset_in_child(self, LocalExecutor._reset)
        _OPEN.add(self)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # workers wait here for tasks
        self._timed = threading.Condition(self._lock)  # the timer waits here
        self._due: list[tuple[float, int, str, Mapping[str, Any], str | None]] = []
        self._order = itertools.count()
        self._queue = TaskQueue(self.url)
        self._threads: list[threading.Thread] = []
        self._waiting = 0  # workers waiting for a task
        self._timer: threading.Thread | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<LocalExecutor workers={self.workers}>"

    @property
    def queued(self) -> int:
        """How many tasks are due and wait for a worker."""
        with self._lock:
            return len(self._queue)

    @property
    def idle(self) -> int:
        """How many workers wait with no task queued for them: what a running task may
        hand work to (a mapping range splits for them)."""
        with self._lock:
            return max(0, self._waiting - len(self._queue))

    def bind(self, tasks: Mapping[str, Task], marks: Marks) -> None:
        self._tasks = tasks
        self._marks = marks

    def submit(self, task: str, args: Mapping[str, Any], **when: Unpack[When]) -> bool:
        delay, dedupe, window, merge = Timing(**when)
        if task not in self._tasks:
            raise ConfigurationError(f"no task named {task!r} is bound to {self.url}")
        if self._closed:  # checked before claiming: a claim must be followed by a run
            raise ConfigurationError(f"{self.url} is closed")
        if dedupe is not None:
            if self._marks is None:
                raise ConfigurationError(f"{self.url} is bound to no kit")
            if not self._marks.claim(dedupe, max(delay, 0.0) + window):
                return False
        with self._lock:
            if self._closed:
                raise ConfigurationError(f"{self.url} is closed")
            if delay <= 0:
                followup = threading.current_thread() in self._threads
                self._put(Entry(task, args, merge), followup=followup)
            else:
                due = (time.monotonic() + delay, next(self._order), task, args, merge)
                heapq.heappush(self._due, due)
                self._start_timer()
                self._timed.notify()
        return True

    def _put(self, entry: Entry, *, followup: bool) -> None:
        """Queue a task for the workers, starting them if need be, unless a queued task
        has its merge key (then that one does its work). Holds the lock."""
        if not self._queue.put(entry, followup=followup):
            return
        if not self._threads:
            for n in range(self.workers):
                thread = threading.Thread(target=self._work, name=f"shardkit-{n}", daemon=True)
                self._threads.append(thread)
                thread.start()
        self._ready.notify()

    def _work(self) -> None:
        """A worker: run queued tasks until the executor is closed and none is left."""
        while True:
            with self._lock:
                while (entry := self._queue.take()) is None:
                    if self._closed:
                        return
                    self._waiting += 1
                    try:
                        self._ready.wait()
                    finally:
                        self._waiting -= 1
            self._run(entry.task, entry.args)

    def _start_timer(self) -> None:
        if self._timer is None:
            self._timer = threading.Thread(target=self._watch, name="shardkit-timer", daemon=True)
            self._timer.start()

    def _watch(self) -> None:
        """Queue each delayed task when it comes due."""
        with self._lock:
            while not self._closed:
                if not self._due:
                    self._timed.wait()
                    continue
                wait = self._due[0][0] - time.monotonic()
                if wait > 0:
                    self._timed.wait(wait)
                    continue
                _, _, task, args, merge = heapq.heappop(self._due)
                self._put(Entry(task, args, merge), followup=False)

    def _run(self, task: str, args: Mapping[str, Any]) -> None:
        with reported(self._failures, task, args):
            self._tasks[task](args)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            due, self._due = self._due, []
            self._timed.notify()
            self._ready.notify_all()
        # Run here, not on the workers: they stop once nothing is queued.
        for _, _, task, args, _ in sorted(due):
            self._run(task, args)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()


# The executors alive in this process, closed at interpreter exit by one hook (weakly
# held: an executor that is gone needs nothing, and leaves nothing registered).
_OPEN: weakref.WeakSet[LocalExecutor] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for executor in list(_OPEN):
        executor.close()
