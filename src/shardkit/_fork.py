"""Fork safety: objects that hold connections drop them in a forked child, and a fork
waits for other threads to leave what a child must not inherit mid-use (SQLite)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("shardkit")

# Every live registered object and its reset, weakly held: one at-fork hook serves them
# all, so opening and closing kits for weeks leaves no hooks (nor objects) behind.
_OWNERS: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()
_GATES: weakref.WeakSet[ForkGate] = weakref.WeakSet()
_LOCK = threading.Lock()
# How long a fork waits for other threads to leave a gate before it goes on regardless.
FORK_WAIT = 5.0


def reset_in_child(owner: Any, reset: Callable[[Any], None]) -> None:
    """Call ``reset(owner)`` in every child forked while ``owner`` is alive.

    Connections (sockets) opened by the parent must never be used by the child: pre-fork
    servers such as gunicorn would otherwise interleave two processes' traffic on one
    socket. Only a weak reference is held, so registering does not keep ``owner`` alive.
    """
    with _LOCK:
        _OWNERS[owner] = reset


class ForkGate:
    """Holds a fork back while other threads are using something whose state a child must
    not inherit mid-use, and holds new uses back until the fork is done.

    SQLite is such a thing: its locks are in the process's memory (and its mutexes), so a
    child forked while another thread is inside a SQLite statement or transaction
    inherits them held, and hangs or finds the database locked for good. A fork waits at
    most ``FORK_WAIT`` seconds (then goes on, with a warning); the forking thread's own
    uses never hold it back. Thread-safe; a use may end on another thread than began it.
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self._reset()
        reset_in_child(self, ForkGate._reset)
        with _LOCK:
            _GATES.add(self)

    def _reset(self) -> None:
        self._changed = threading.Condition()
        self._uses: dict[object, int] = {}  # the uses under way: the thread of each
        self._forking = False
        self._local = threading.local()  # .aside: this thread's uses are not gated

    def enter(self, use: object) -> None:
        """Begin ``use`` (any hashable naming it) on this thread, once no fork is under
        way (at once, ungated, within ``aside``)."""
        if getattr(self._local, "aside", False):
            return
        with self._changed:
            self._changed.wait_for(lambda: not self._forking)
            self._uses[use] = threading.get_ident()

    def leave(self, use: object) -> None:
        """End ``use`` (nothing if it is not under way, as after a fork)."""
        with self._changed:
            if self._uses.pop(use, None) is not None:
                self._changed.notify_all()

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Within it, the uses this thread begins are not gated: their owner gates each
        of its own uses of them instead (a connection held between statements)."""
        self._local.aside = True
        try:
            yield
        finally:
            self._local.aside = False

    def _hold(self) -> None:
        me = threading.get_ident()
        with self._changed:
            self._forking = True
            if not self._changed.wait_for(
                lambda: all(thread == me for thread in self._uses.values()), FORK_WAIT
            ):
                log.warning(
                    "forking while another thread uses %s: the child may find it locked",
                    self._what,
                )

    def _release(self) -> None:
        with self._changed:
            self._forking = False
            self._changed.notify_all()


def _before_fork() -> None:
    # Gates first, unlocked while they wait: a thread being waited for may be
    # registering something.
    with _LOCK:
        gates = list(_GATES)
    for gate in gates:
        gate._hold()
    _LOCK.acquire()  # no registration is half-done in the child's copy


def _after_in_parent() -> None:
    gates = list(_GATES)
    _LOCK.release()
    for gate in gates:
        gate._release()


def _after_in_child() -> None:
    """Every registered object's reset, each one whatever the others did: one that
    raises is logged, and the rest still drop their parent's connections."""
    global _LOCK
    _LOCK = threading.Lock()
    for owner, reset in list(_OWNERS.items()):
        try:
            reset(owner)
        except Exception:
            log.exception("a forked child failed to reset its %s", type(owner).__qualname__)


if sys.platform != "win32":  # no fork there
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_after_in_child
    )
