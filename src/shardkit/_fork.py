"""Fork safety: objects that hold connections drop them in a forked child."""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from typing import Any


def reset_in_child(owner: Any, reset: Callable[[Any], None]) -> None:
    """Call ``reset(owner)`` in every child forked while ``owner`` is alive.

    Connections (sockets) opened by the parent must never be used by the child: pre-fork
    servers such as gunicorn would otherwise interleave two processes' traffic on one
    socket. Only a weak reference is held, so registering does not keep ``owner`` alive.
    """
    if sys.platform == "win32":  # no fork there
        return
    ref = weakref.ref(owner)

    def after_in_child() -> None:
        alive = ref()
        if alive is not None:
            reset(alive)

    os.register_at_fork(after_in_child=after_in_child)
