"""Fork safety: objects that hold connections drop them in a forked child."""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

# Every live registered object and its reset, weakly held: one at-fork hook serves them
# all, so opening and closing kits for weeks leaves no hooks (nor objects) behind.
_OWNERS: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def reset_in_child(owner: Any, reset: Callable[[Any], None]) -> None:
    """Call ``reset(owner)`` in every child forked while ``owner`` is alive.

    Connections (sockets) opened by the parent must never be used by the child: pre-fork
    servers such as gunicorn would otherwise interleave two processes' traffic on one
    socket. Only a weak reference is held, so registering does not keep ``owner`` alive.
    """
    with _LOCK:
        _OWNERS[owner] = reset


def _before_fork() -> None:
    _LOCK.acquire()  # no registration is half-done in the child's copy


def _after_in_parent() -> None:
    _LOCK.release()


def _after_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()
    for owner, reset in list(_OWNERS.items()):
        reset(owner)


if sys.platform != "win32":  # no fork there
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_after_in_child
    )
