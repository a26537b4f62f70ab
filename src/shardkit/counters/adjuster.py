"""Cached values moved by writes, off the writers' path.

A sharded counter's cached value is moved by every write's delta. Sent one by one, those
adjustments cost a cache round trip per write, on top of the write's own; an
adjuster sums them per key in the process instead, and a background thread (or task) sends
what has gathered ``delay`` seconds after the first of it, every key in one call
(``Cache.incr_many``). The writer's call returns once its write is committed: the
adjustment follows within about ``delay``. Here: the role (``Adjusting``) and the
program that sends a batch; the adjuster itself is ``shardkit.aio.adjuster``'s, written
once for an event loop's task and generated for a thread (``shardkit._sync.adjuster``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

from shardkit import metrics
from shardkit._failures import FailureLog
from shardkit._program import Program, Roles, call, role
from shardkit.cache.base import Cache
from shardkit.errors import BackendError

_ADJUSTING = metrics.action("adjusting cached values")


@dataclass(frozen=True, slots=True)
class Sending(Roles):
    """What ``sending`` runs on."""

    cache: Cache


@role("adjuster")
class Adjusting(Protocol):
    """The role of the kit's adjuster in the counters' programs (``Adjuster``, or
    ``AsyncAdjuster``, whose ``sync`` and ``close`` are awaited).

    * ``add(key, delta)`` moves the cached value under ``key`` (if present) by
      ``delta``, soon: it costs no round trip with a shared cache; with an in-process
      one (nothing to gain) it adjusts at once.
    * A batch that fails to be sent is dropped, and so are its keys (best effort), so
      that reads go to the store rather than serve a value missing the adjustment.
      A cache outage therefore never fails a write: at worst a value is stale for its
      TTL, when the cache fails to drop it as well.
    * ``sync()`` waits until what was added before it has been sent: a process reads
      its own writes.
    * ``close()`` sends what is left. Adjustments not yet sent when a process exits
      without it are lost: those values are stale until their TTL.
    """

    def add(self, key: str, delta: int) -> None: ...
    def sync(self) -> Any: ...
    def close(self) -> Any: ...


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
