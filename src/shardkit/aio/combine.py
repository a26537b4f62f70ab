"""Combining for coroutines: ``AsyncCombiner``, ``shardkit._combine.Combiner``'s
protocol (``Batches``) driven by a task of the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from shardkit._combine import Batches
from shardkit.errors import BackendError

T = TypeVar("T")
R = TypeVar("R")


class AsyncCombiner(Generic[T, R]):
    """Combines concurrent calls from coroutines of one event loop: ``await
    combiner(item)`` returns ``write``'s result for ``item``, as ``Combiner`` does for
    threads (``write`` takes a batch, returns one result per item or raises for all).

    A batch is written by a task of its own, so cancelling a caller (or its timeout)
    never interrupts a write half-way: a caller cancelled while its item is queued takes
    it out (it is never written); one cancelled while its batch is being written leaves
    the write to finish, and its item applies or not with the batch.
    """

    def __init__(self, write: Callable[[Sequence[T]], Awaitable[Sequence[R]]]) -> None:
        self._write = write
        self._batches: Batches[tuple[T, asyncio.Future[R]]] = Batches()
        self._task: asyncio.Task[None] | None = None  # the task writing batches
        # Done once the batch being written now is written (``settled``).
        self._written: asyncio.Future[None] | None = None

    @property
    def waiting(self) -> int:
        """How many calls are queued for the next batch."""
        return self._batches.waiting

    async def settled(self) -> None:
        """Return once the batch being written now, if any, is written: its items, its
        cancelled callers' included, have then applied or failed."""
        if self._written is not None:
            await asyncio.shield(self._written)

    async def __call__(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        waiter = (item, future)
        if self._batches.join(waiter):
            self._task = asyncio.create_task(self._drain())
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not self._batches.leave(waiter):
                # Being written: its outcome is nobody's now (an error is not logged).
                future.add_done_callback(lambda done: done.cancelled() or done.exception())
            raise

    async def _drain(self) -> None:
        """Write the queued batches, one after another, until nobody waits."""
        while True:
            batch = self._batches.take()
            if batch:
                self._written = written = asyncio.get_running_loop().create_future()
                try:
                    results = await self._write([item for item, _ in batch])
                except Exception as exc:
                    for _, future in batch:
                        future.set_exception(exc)
                except BaseException:  # this task cancelled (the loop closing): fail all
                    lost = BackendError("a combined write was interrupted")
                    for _, future in batch + self._batches.take():
                        future.set_exception(lost)
                    self._batches.finish()
                    raise
                else:
                    for (_, future), result in zip(batch, results, strict=True):
                        future.set_result(result)
                finally:
                    self._written = None
                    written.set_result(None)
            if self._batches.finish() is None:
                self._task = None
                return


__all__ = ["AsyncCombiner"]
