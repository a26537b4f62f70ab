# Generated from shardkit/aio/combine.py by tools/generate_sync.py: edit that one.
"""The combiner (``shardkit._combine``'s protocol) of the coroutines of one event loop,
``AsyncCombiner``, and of threads, ``Combiner``: written once here, the thread form
generated from it (``shardkit/_sync/combine.py``, by ``tools/generate_sync.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from shardkit._combine import Batches
from shardkit._concurrency import Event, Lock, shielded
from shardkit._fork import reset_in_child
from shardkit.errors import BackendError

T = TypeVar("T")
R = TypeVar("R")
T_contra = TypeVar("T_contra", contravariant=True)
R_co = TypeVar("R_co", covariant=True)


class Write(Protocol[T_contra, R_co]):
    """A combiner's write: a batch of items in arrival order, one result per item (or
    an error for the whole batch)."""

    def __call__(self, batch: Sequence[T_contra], /) -> Sequence[R_co]: ...


class _Call(Generic[T, R]):
    """A queued caller's item, and its outcome once its batch is written."""

    __slots__ = ("error", "item", "leads", "result", "woken")

    def __init__(self, item: T) -> None:
        self.item = item
        self.result: R | None = None
        self.error: BaseException | None = None
        self.woken = Event()  # set when its batch is written, or it is to lead
        self.leads = False  # set (under the lock) when it is to lead the next batch


class Combiner(Generic[T, R]):
    """Combines concurrent calls: ``combiner(item)`` (awaited, in the async form)
    returns ``write``'s result for ``item``; ``write`` takes a batch of items in arrival
    order and returns one result per item, or raises for the whole batch (every caller
    in it then raises that error: the write must be atomic, applying all of the batch or
    none).

    A batch's write is shielded from its callers' cancellation, so it never stops
    half-way and the callers queued behind it always get their turn. A caller cancelled
    (or interrupted) while its item is queued takes the item out: it is never written;
    one cancelled while its batch is being written stops waiting, and its item applies
    or not with the batch.

    Safe for a process's threads (the thread form) or the coroutines of one event loop
    (the async form); a forked child starts with no batch (its parent's are the
    parent's).
    """

    def __init__(self, write: Write[T, R]) -> None:
        self._write = write
        self._reset()
        reset_in_child(self, Combiner._reset)

    def _reset(self) -> None:
        self._lock = Lock()
        self._batches: Batches[_Call[T, R]] = Batches()
        self._settle: Event | None = None  # set once the batch being written is

    @property
    def waiting(self) -> int:
        """How many calls are queued for the next batch."""
        with self._lock:
            return self._batches.waiting

    def settled(self) -> None:
        """Return once the batch being written now, if any, is written: its items, its
        cancelled callers' included, have then applied or failed."""
        with self._lock:
            if not self._batches.busy:
                return
            if self._settle is None:
                self._settle = Event()
            settle = self._settle
        settle.wait()

    def __call__(self, item: T) -> R:
        with self._lock:
            leads = self._batches.claim()  # nothing being written: it leads at once
            if not leads:
                call: _Call[T, R] = _Call(item)
                self._batches.join(call)
        if leads:
            results = shielded(self._lead, [item])
            return results[0]
        try:
            call.woken.wait()
        except BaseException:
            with self._lock:
                leads = call.leads
                if not leads and self._batches.leave(call):
                    raise  # taken out: never written
            if leads:  # its turn came: the batch goes on without it waiting
                shielded(self._lead, [])
            raise
        if call.leads:
            shielded(self._lead, [])
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def _lead(self, own: list[T]) -> Sequence[R]:
        """Write ``own`` (the items of a caller that leads without having queued) and
        the queued calls' items as one batch; give each call its outcome, and return
        ``own``'s results (or raise the batch's error)."""
        with self._lock:
            batch = self._batches.take()
        if not batch:  # a caller alone: its own items, nobody else's outcome to give
            try:
                return self._write(own)
            finally:
                self._hand_over()
        try:
            results = self._write(own + [call.item for call in batch])
            for call, result in zip(batch, results[len(own) :], strict=True):
                call.result = result
        except Exception as exc:
            for call in batch:
                call.error = exc
            if own:
                raise
            return ()
        except BaseException as exc:  # KeyboardInterrupt, a cancelled loop: only the leader's
            lost = BackendError(f"a combined write was interrupted ({type(exc).__name__})")
            for call in batch:
                call.error = lost
            raise
        finally:
            self._hand_over()
            for call in batch:
                call.woken.set()
        return results

    def _hand_over(self) -> None:
        """A batch is written: wake the first call queued meanwhile to lead the next."""
        with self._lock:
            settle, self._settle = self._settle, None
            successor = self._batches.finish()
            if successor is not None:
                successor.leads = True
        if settle is not None:
            settle.set()
        if successor is not None:
            successor.woken.set()


__all__ = ["Combiner", "Write"]
