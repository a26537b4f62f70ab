"""The executor interface: background work, submitted by task name with JSON arguments.

A kit binds its tasks (functions of one JSON-able ``dict``) to an executor when it is
connected; counters then submit them by name, optionally after a delay and optionally
deduplicated by a name. Deduplication marks live in the kit's cache, so processes that
share a cache share their marks: of many submissions under one name within its window,
one runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypedDict, runtime_checkable

from shardkit._failures import FailureLog
from shardkit._program import role
from shardkit.cache.base import Cache
from shardkit.errors import ShardkitError

if TYPE_CHECKING:
    from typing_extensions import Unpack

Task = Callable[[Mapping[str, Any]], object]
"""A background task: called with the JSON-able arguments it was submitted with. Tasks
must be idempotent: an executor may run a submission more than once (a redelivered
message), or not at all (a process that dies with it queued)."""


log = logging.getLogger("shardkit")


class Marks:
    """Deduplication marks: the first claim of a name within its window wins."""

    def __init__(self, cache: Cache, key: Callable[[str], str]) -> None:
        self.cache = cache  # the kit's: an async kit's is awaited (see ``claim``)
        self._key = key  # a claim's name -> its cache key

    def claim(self, name: str, ttl: float) -> bool:
        """Whether this call is the first to claim ``name`` in the last ``ttl`` seconds.
        Atomic across every process sharing the cache. (On an async kit's cache, an
        awaitable of it.)"""
        return self.cache.add(self._key(name), 1, ttl)

    def release(self, name: str) -> None:
        """Drop a claim whose submission failed, so that the next one may run."""
        self.cache.delete(self._key(name))


@contextlib.contextmanager
def reported(failures: FailureLog, task: str, args: Mapping[str, Any]) -> Iterator[None]:
    """Run a background task's call inside: nobody else would see how it ended, so a
    failure is logged here — a ``ShardkitError`` (a backend that is down fails every
    task) as an outage, once (``failures``), any other error with its traceback — and a
    success ends the task's outage."""
    try:
        yield
    except ShardkitError as exc:
        failures.failed(task, "background task %s%s failed: %s", task, dict(args), exc)
    except Exception:
        log.exception("background task %s%s failed", task, dict(args))
    else:
        failures.worked(task)


class When(TypedDict, total=False):
    """When a submitted task runs, and whether: ``Executor.submit``'s options."""

    delay: float
    """Seconds from now, at the earliest (default 0)."""
    dedupe: str | None
    """A name: the submission is a no-op if one under the same name was made within the
    last ``delay + window`` seconds by anyone sharing the cache."""
    window: float
    """Seconds a ``dedupe`` name is held beyond ``delay`` (default 60)."""
    merge: str | None
    """For a task whose one run does the work of every run queued before it (a flush
    moves all that is pending): when this submission comes due while an earlier one with
    the same ``merge`` is due and has not started, it is taken into that one and does not
    run. An executor whose queue is elsewhere (a broker) may run both."""


class Timing(NamedTuple):
    """``When`` with its defaults: ``Timing(**when)``."""

    delay: float = 0.0
    dedupe: str | None = None
    window: float = 60.0
    merge: str | None = None


@role("executor")
@runtime_checkable
class Executor(Protocol):
    """Runs a kit's tasks in the background. Thread-safe."""

    url: str
    """What the executor is, for messages: ``local://…`` or ``celery://…``."""

    def bind(self, tasks: Mapping[str, Task], marks: Marks) -> None:
        """Serve ``tasks`` by name and keep deduplication marks in ``marks``. Called once by
        ``connect``; an executor serves one kit, so binding again replaces both."""

    def submit(self, task: str, args: Mapping[str, Any], **when: Unpack[When]) -> bool:
        """Run ``task(args)`` in the background, as ``when`` says (at once by default);
        True when submitted, False when ``dedupe`` made it a no-op. ``args`` must be
        JSON-able."""

    def close(self) -> None:
        """Stop taking work; run or hand over what was submitted (see each executor)."""
