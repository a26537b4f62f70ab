"""The primitives the concurrency pieces written once are written on.

A piece (the combiner, the adjuster) is written for asyncio, under ``shardkit/aio/``, on
the ``Async…`` primitives below; its thread form under ``shardkit/_sync/`` is generated
from it by ``tools/generate_sync.py`` (the tests check that it is current), which drops ``async``
and ``await`` and renames each ``Async…`` primitive to its twin here. The twins have the
same names and meanings:

* ``AsyncLock`` / ``Lock``: a section no other caller runs at the same time. A section
  must not await: coroutines of one event loop then never interleave in it, so the
  async lock does nothing, and the thread lock is ``threading.Lock``.
* ``AsyncEvent`` / ``Event``: a flag to wait for, with an optional timeout.
* ``AsyncBackground`` / ``Background``: a routine started beside the caller (a task of
  the loop, a daemon thread), which can be waited for.
* ``ashielded`` / ``shielded``: a call that its caller's cancellation does not
  interrupt (a task of its own, awaited through ``asyncio.shield``). Threads are not
  cancelled: the thread form calls it in place.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

Lock = threading.Lock
Event = threading.Event


class AsyncLock:
    """``Lock`` for coroutines of one event loop, whose sections never await: nothing
    to do."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class AsyncEvent:
    """``threading.Event``'s contract, awaited (``asyncio.Event`` with a timeout)."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait until the flag is set (True), or ``timeout`` seconds have passed
        (False)."""
        if self._event.is_set():
            return True
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


class Background:
    """``routine()`` run by a daemon thread named ``name``, started at once."""

    __slots__ = ("_thread",)

    def __init__(self, routine: Callable[[], object], name: str) -> None:
        self._thread = threading.Thread(target=routine, name=name, daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the routine to end, ``timeout`` seconds at most (not at all from
        within it)."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


class AsyncBackground:
    """``routine()`` run by a task of the running event loop, started at once."""

    __slots__ = ("_task",)

    def __init__(self, routine: Callable[[], Coroutine[Any, Any, object]], name: str) -> None:
        self._task = asyncio.get_running_loop().create_task(routine(), name=name)

    async def join(self, timeout: float) -> None:
        """Wait for the routine to end, ``timeout`` seconds at most (not at all from
        within it). Cancelling the waiter leaves the routine running."""
        if self._task is not asyncio.current_task():
            await asyncio.wait({self._task}, timeout=timeout)


def shielded(function: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """``function(*args, **kwargs)``."""
    return function(*args, **kwargs)


_SHIELDED: set[asyncio.Task[Any]] = set()  # held while they run (the loop holds tasks weakly)


async def ashielded(function: Callable[P, Awaitable[R]], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """``await function(*args, **kwargs)``, run by a task of its own: cancelling the
    caller stops its wait, not the call, which goes on to its end."""
    task = asyncio.ensure_future(function(*args, **kwargs))
    _SHIELDED.add(task)
    task.add_done_callback(_SHIELDED.discard)
    return await asyncio.shield(task)
