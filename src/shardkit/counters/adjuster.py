"""Cached values moved by writes, off the writers' path.

A sharded counter's cached value is moved by every write's delta. Sent one by one, those
adjustments cost a cache round trip per write, on top of the write's own; an
``Adjuster`` sums them per key in the process instead, and a background thread sends
what has gathered ``delay`` seconds after the first of it, every key in one call
(``Cache.incr_many``). The writer's call returns once its write is committed: the
adjustment follows within about ``delay``. ``AsyncAdjuster`` does the same for an async
kit, with a task of its event loop.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from shardkit import metrics
from shardkit._failures import FailureLog
from shardkit._fork import reset_in_child
from shardkit._program import Program, Roles, call, role, run
from shardkit.cache.base import Cache
from shardkit.errors import BackendError

_ADJUSTING = metrics.action("adjusting cached values")
# How long ``sync`` waits for adjustments to be sent before serving the cache as it is,
# and ``close`` for the last of them (a cache that hangs must not hang the kit's close).
SYNC_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class Sending(Roles):
    """What ``sending`` runs on."""

    cache: Cache


@role("adjuster")
class Adjuster:
    """Gathers adjustments of cached values and sends them within ``delay`` seconds.

    * ``add(key, delta)`` costs no round trip with a shared cache; with an in-process
      one (nothing to gain) it adjusts at once.
    * A batch that fails to be sent is dropped, and so are its keys (best effort), so
      that reads go to the store rather than serve a value missing the adjustment.
      A cache outage therefore never fails a write: at worst a value is stale for its
      TTL, when the cache fails to drop it as well.
    * ``sync()`` waits until what was added before it has been sent: a process reads
      its own writes.
    * ``close()`` sends what is left. Adjustments not yet sent when a process exits
      without it are lost: those values are stale until their TTL.

    Thread-safe. A forked child starts empty (its parent's adjustments are the parent's
    to send), its thread started on first use.
    """

    def __init__(self, cache: Cache, failures: FailureLog, delay: float) -> None:
        self._cache = cache
        self._failures = failures
        self._delay = delay
        self._roles = Sending(cache)
        self._reset()
        reset_in_child(self, Adjuster._reset)

    def _reset(self) -> None:
        self._changed = threading.Condition()
        self._pending: dict[str, int] = {}
        self._added = 0  # adjustments added so far
        self._sent = 0  # how many of them were sent (or dropped)
        self._hurry = False  # a sync is waiting: send without the delay
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, key: str, delta: int) -> None:
        """Move the cached value under ``key`` (if present) by ``delta``: soon, or at
        once with an in-process cache or once closed."""
        with self._changed:
            if self._cache.shared and not self._closed:
                if not self._pending:
                    self._changed.notify_all()
                self._pending[key] = self._pending.get(key, 0) + delta
                self._added += 1
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="shardkit-adjuster", daemon=True
                    )
                    self._thread.start()
                return
        self._send({key: delta})

    def sync(self) -> None:
        """Wait until every adjustment added before this call has been sent or dropped
        (at most a few seconds: then the cache is served as it is)."""
        with self._changed:
            target = self._added
            if self._sent < target:
                self._hurry = True
                self._changed.notify_all()
                self._changed.wait_for(lambda: self._sent >= target, SYNC_TIMEOUT)

    def close(self) -> None:
        """Send what is pending and stop the thread (waiting a few seconds at most).
        Idempotent."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(SYNC_TIMEOUT)

    def _run(self) -> None:
        changed = self._changed
        while True:
            with changed:
                changed.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return  # closed, and nothing left
                if not (self._hurry or self._closed):
                    # Gather for ``delay``: a sync or close cuts the wait short.
                    changed.wait_for(lambda: self._hurry or self._closed, self._delay)
                batch, self._pending = self._pending, {}
                upto, self._hurry = self._added, False
            self._send(batch)
            with changed:
                self._sent = upto
                changed.notify_all()

    def _send(self, batch: dict[str, int]) -> None:
        run(sending(self._failures, batch), self._roles)


def sending(failures: FailureLog, batch: dict[str, int]) -> Program[None]:
    """Send a batch of adjustments in one call. A batch that fails is logged and its keys
    deleted (best effort: a value the failing cache keeps has its TTL); nothing raises,
    since the writes it follows are committed, and nobody else would see it."""
    deltas = {key: delta for key, delta in batch.items() if delta}
    try:
        yield from call(Cache.incr_many, deltas)
    except Exception as exc:
        failures.failed(_ADJUSTING, "failed while %s: %s", _ADJUSTING, exc)
        for key in deltas:
            with contextlib.suppress(BackendError):
                yield from call(Cache.delete, key)
    else:
        failures.worked(_ADJUSTING)
