"""Combining: concurrent calls of one write, from threads of one process, carried out
together in one backend call (group commit).

A caller queues its item; if no batch is being written, it leads: it takes everything
queued and writes it in one call, while the callers that arrive meanwhile queue for the
next batch, which the first of them leads once this one is done. A lone caller leads its
own batch of one at once: combining costs it no wait. Each caller returns (or raises)
with its batch's outcome, so it returns only once its own item has been written.

``Batches`` is the state of that protocol without locks or I/O, driven by the
thread-based ``Combiner`` and by ``AsyncCombiner``, for coroutines.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from shardkit._fork import reset_in_child
from shardkit.errors import BackendError

T = TypeVar("T")
W = TypeVar("W")
R = TypeVar("R")


class Batches(Generic[W]):
    """Who writes which batch. Not thread-safe: the driver serialises its calls."""

    def __init__(self) -> None:
        self._queue: list[W] = []
        self._busy = False

    @property
    def waiting(self) -> int:
        """How many waiters are queued for the next batch."""
        return len(self._queue)

    def join(self, waiter: W) -> bool:
        """Queue ``waiter``; True if it must lead now (no batch is being written)."""
        self._queue.append(waiter)
        return self.claim()

    def claim(self) -> bool:
        """True if no batch is being written (nobody waits then): the caller writes the
        next one, and ``finish``es it."""
        if self._busy:
            return False
        self._busy = True
        return True

    def leave(self, waiter: W) -> bool:
        """Take ``waiter`` out of the queue, if it is still there (no batch has taken it
        yet); return whether it was."""
        for index, queued in enumerate(self._queue):
            if queued is waiter:
                del self._queue[index]
                return True
        return False

    def take(self) -> list[W]:
        """The leader takes every queued waiter (its own included) as its batch."""
        batch, self._queue = self._queue, []
        return batch

    def finish(self) -> W | None:
        """The leader's batch is written: the waiter that leads the next one, or None
        when nobody waits."""
        if self._queue:
            return self._queue[0]
        self._busy = False
        return None


class _Call(Generic[T, R]):
    __slots__ = ("error", "item", "leads", "result", "woken")

    def __init__(self, item: T) -> None:
        self.item = item
        self.result: R | None = None
        self.error: BaseException | None = None
        self.woken = threading.Event()  # set when its batch is written, or it is to lead
        self.leads = False

    def outcome(self) -> R:
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]


class Combiner(Generic[T, R]):
    """Combines concurrent calls from threads: ``combiner(item)`` returns ``write``'s
    result for ``item``, where ``write`` takes a batch of items in arrival order and
    returns one result per item, or raises for the whole batch (every caller in it then
    raises that error: the write must be atomic, applying all of the batch or none).

    Thread-safe; a forked child starts with no batch (its parent's are the parent's).
    """

    def __init__(self, write: Callable[[Sequence[T]], Sequence[R]]) -> None:
        self._write = write
        self._reset()
        reset_in_child(self, Combiner._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._batches: Batches[_Call[T, R]] = Batches()

    @property
    def waiting(self) -> int:
        """How many calls are queued for the next batch."""
        with self._lock:
            return self._batches.waiting

    def __call__(self, item: T) -> R:
        call: _Call[T, R] | None = None
        with self._lock:
            if not self._batches.claim():  # a batch is being written: queue for the next
                call = _Call(item)
                self._batches.join(call)
        if call is None:  # nothing being written, nobody waiting: a batch of one, at once
            try:
                return self._write([item])[0]
            finally:
                self._hand_over()
        interrupted = _wait(call.woken)
        if call.leads:
            self._lead()
        if interrupted is not None:
            raise interrupted
        return call.outcome()

    def _lead(self) -> None:
        with self._lock:
            batch = self._batches.take()
        try:
            results = self._write([call.item for call in batch])
            for call, result in zip(batch, results, strict=True):
                call.result = result
        except Exception as exc:
            for call in batch:
                call.error = exc
        except BaseException as exc:  # KeyboardInterrupt, …: only the leader's own
            lost = BackendError(f"a combined write was interrupted ({type(exc).__name__})")
            for call in batch:
                call.error = lost
            batch[0].error = exc  # the leader's call is the first of its batch
            raise
        finally:
            self._hand_over()
            for call in batch:
                call.woken.set()

    def _hand_over(self) -> None:
        """A batch is written: wake the first caller queued meanwhile to lead the next."""
        with self._lock:
            successor = self._batches.finish()
        if successor is not None:
            successor.leads = True
            successor.woken.set()


def _wait(event: threading.Event) -> BaseException | None:
    """Wait for ``event``, even through a signal's exception (KeyboardInterrupt), which
    is returned: a queued call must see its batch through (it may have to lead the next
    one, or the callers behind it would wait forever). The wait lasts one write."""
    interrupted = None
    while True:
        try:
            event.wait()
            return interrupted
        except BaseException as exc:
            interrupted = exc
