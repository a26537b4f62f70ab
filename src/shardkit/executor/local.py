"""The local executor: a thread pool and a timer thread, inside the process. The default."""

from __future__ import annotations

import atexit
import heapq
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardkit._fork import reset_in_child
from shardkit.errors import ConfigurationError, ShardkitError
from shardkit.executor.base import Marks, Task

log = logging.getLogger("shardkit")


class LocalExecutor:
    """Runs tasks on ``workers`` threads of this process; delayed tasks wait in a heap
    watched by one timer thread. Threads start on the first submission.

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
        self._reset()
        reset_in_child(self, LocalExecutor._reset)
        atexit.register(_close_at_exit, weakref.ref(self))

    def _reset(self) -> None:
        self._lock = threading.Condition()
        self._due: list[tuple[float, int, str, Mapping[str, Any]]] = []
        self._order = itertools.count()
        self._pool: ThreadPoolExecutor | None = None
        self._timer: threading.Thread | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<LocalExecutor workers={self.workers}>"

    def bind(self, tasks: Mapping[str, Task], marks: Marks) -> None:
        self._tasks = tasks
        self._marks = marks

    def submit(
        self,
        task: str,
        args: Mapping[str, Any],
        *,
        delay: float = 0.0,
        dedupe: str | None = None,
        window: float = 60.0,
    ) -> bool:
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
                self._start_pool().submit(self._run, task, args)
            else:
                heapq.heappush(self._due, (time.monotonic() + delay, next(self._order), task, args))
                self._start_timer()
                self._lock.notify()
        return True

    def _start_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="shardkit")
        return self._pool

    def _start_timer(self) -> None:
        if self._timer is None:
            self._timer = threading.Thread(target=self._watch, name="shardkit-timer", daemon=True)
            self._timer.start()

    def _watch(self) -> None:
        """Hand each delayed task to the pool when it comes due."""
        with self._lock:
            while not self._closed:
                if not self._due:
                    self._lock.wait()
                    continue
                wait = self._due[0][0] - time.monotonic()
                if wait > 0:
                    self._lock.wait(wait)
                    continue
                _, _, task, args = heapq.heappop(self._due)
                self._start_pool().submit(self._run, task, args)

    def _run(self, task: str, args: Mapping[str, Any]) -> None:
        try:
            self._tasks[task](args)
        except ShardkitError as exc:
            log.warning("background task %s%s failed: %s", task, dict(args), exc)
        except Exception:
            log.exception("background task %s%s failed", task, dict(args))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            due, self._due = self._due, []
            self._lock.notify()
        # Run here, not on the pool: at interpreter exit the pool takes no more work.
        for _, _, task, args in sorted(due):
            self._run(task, args)
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _close_at_exit(ref: weakref.ref[LocalExecutor]) -> None:
    executor = ref()
    if executor is not None:
        executor.close()
