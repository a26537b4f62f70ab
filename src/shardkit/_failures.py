"""Warnings about failures that repeat. A cache or database that is down fails every call
made to it, and a warning per call buries the log: a 3 s Redis outage under eight writers
printed thousands of identical lines. A ``FailureLog`` logs the first failure of a kind at
once, then at most one line per kind every ``every`` seconds, counting those it held
back, and one line when that kind of call works again, with how many times it failed."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardkit import metrics
from shardkit._fork import reset_in_child

EVERY = 10.0  # seconds between two warnings of one kind of failure
QUIET = 1.0  # seconds without a failure after which a success ends an outage


@dataclass
class _Outage:
    """The failures of one kind since it last worked."""

    started: float  # when the first of them happened
    last: float  # when the latest did
    logged: float  # when a line was last logged
    total: int = 1
    held: int = 0  # since the last line, not logged


class FailureLog:
    """Logs failures by kind: a constant string naming what failed, such as ``"adjusting
    a cached value"``. Thread-safe.

    * ``failed(kind, message, *args)``: the first failure of a kind opens an outage and
      is logged at once (a warning); the next ones are counted, and the first one
      ``every`` seconds after the last line is logged with how many were held back.
    * ``worked(kind)``: a call of that kind has succeeded. The first success ``quiet``
      seconds or more after the latest failure closes the outage with one line: that
      the kind works again, how many times and for how long it failed (so failures that
      come and go between successes stay one outage). When the kind was not failing,
      this costs one dict lookup: fit for hot paths.

    Every failure is thus logged, counted in a later line, or (if its outage never
    closes and nothing fails again) still held.
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        every: float = EVERY,
        quiet: float = QUIET,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger or logging.getLogger("shardkit")
        self._every = every
        self._quiet = quiet
        self._clock = clock
        self._reset()
        reset_in_child(self, FailureLog._reset)

    def _reset(self) -> None:
        # In a forked child too: the parent's lock may have been held by another thread.
        self._lock = threading.Lock()
        self._outages: dict[str, _Outage] = {}

    def failed(self, kind: str, message: str, *args: object) -> None:
        """Count a failure of ``kind``; log ``message % args`` unless a line of this kind
        was logged less than ``every`` seconds ago."""
        metrics.meter.rode_out(kind)
        now = self._clock()
        with self._lock:
            outage = self._outages.get(kind)
            if outage is None:
                self._outages[kind] = _Outage(now, now, now)
                held = 0
            else:
                outage.total += 1
                outage.last = now
                if now - outage.logged < self._every:
                    outage.held += 1
                    return
                held, outage.held, outage.logged = outage.held, 0, now
        if held:
            self._logger.warning(f"{message} (and %d more not logged)", *args, held)
        else:
            self._logger.warning(message, *args)

    def worked(self, kind: str) -> None:
        """Note that a call of ``kind`` succeeded; say so if that ends an outage."""
        outage = self._outages.get(kind)  # unlocked: a stale answer only delays the line
        if outage is None:
            return
        now = self._clock()
        if now - outage.last < self._quiet:
            return
        with self._lock:
            if self._outages.get(kind) is not outage or now - outage.last < self._quiet:
                return
            del self._outages[kind]
        self._logger.warning(
            "%s works again: %d failures in %.1f s (%d not logged until now)",
            kind,
            outage.total,
            outage.last - outage.started,
            outage.held,
        )


__all__ = ["FailureLog"]
