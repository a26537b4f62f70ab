"""Combining: concurrent calls of one write, from the threads (or the coroutines) of one
process, carried out together in one backend call (group commit).

A caller queues its item; if no batch is being written, it leads: it takes everything
queued and writes it in one call, while the callers that arrive meanwhile queue for the
next batch, which the first of them leads once this one is done. A lone caller leads its
own batch of one at once: combining costs it no wait. Each caller returns (or raises)
with its batch's outcome, so it returns only once its own item has been written.

``Batches`` is the state of that protocol without locks or I/O, driven by
``shardkit.aio.combine.AsyncCombiner`` for coroutines and by the ``Combiner`` generated
from it for threads (``shardkit._sync.combine``).
"""

from __future__ import annotations

from typing import Generic, TypeVar

W = TypeVar("W")


class Batches(Generic[W]):
    """Who writes which batch. Not thread-safe: the driver serialises its calls."""

    def __init__(self) -> None:
        self._queue: list[W] = []
        self._busy = False

    @property
    def busy(self) -> bool:
        """Whether a batch is being written."""
        return self._busy

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
