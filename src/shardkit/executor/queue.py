"""The queue of tasks due and waiting for a worker, with its rules of order and merging,
shared by the local executor (worker threads) and the async kit's (tasks of the event
loop). It does no I/O and takes no lock: its executor serialises the calls."""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

log = logging.getLogger("shardkit")


class Entry(NamedTuple):
    """A task due: its name, its JSON-able arguments and its ``merge`` key (or None)."""

    task: str
    args: Mapping[str, Any]
    merge: str | None


class TaskQueue:
    """Tasks due, waiting for a worker of the executor ``url``.

    Tasks from outside the workers run first come, first served, ahead of follow-ups
    (those a running task submits, run newest first) — but when both wait, one of each
    is taken in turn, so a steady stream from outside cannot hold follow-ups back for
    ever. A task whose ``merge`` key is that of a task waiting here is taken into that
    one (it does not run): when the workers fall behind, each key has at most one task
    waiting, however long the workers take; the first merge logs one line. A task's key
    is free again once it is taken by a worker: what comes due then is news to it."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._arrived: collections.deque[Entry] = collections.deque()  # from outside: FIFO
        self._followups: list[Entry] = []  # from the workers' tasks: a stack
        self._followups_turn = False  # whether a follow-up goes next, when both wait
        self._merging: set[str] = set()  # the merge keys of the tasks waiting
        self._merged_once = False

    def __len__(self) -> int:
        """How many tasks wait."""
        return len(self._arrived) + len(self._followups)

    def put(self, entry: Entry, *, followup: bool = False) -> bool:
        """Queue ``entry`` (a ``followup`` of a running task, or from outside); False if
        it was taken into a waiting task of its merge key instead."""
        if entry.merge is not None:
            if entry.merge in self._merging:
                if not self._merged_once:
                    self._merged_once = True
                    log.warning(
                        "background tasks fall behind: %s came due while the last one "
                        "still waited for a worker, which does the work of both (%s)",
                        entry.merge,
                        self._url,
                    )
                return False
            self._merging.add(entry.merge)
        (self._followups if followup else self._arrived).append(entry)
        return True

    def take(self) -> Entry | None:
        """The task a worker runs next (None if none waits); its merge key is free."""
        if not self:
            return None
        both = bool(self._arrived and self._followups)
        if self._arrived and not (both and self._followups_turn):
            entry = self._arrived.popleft()
        else:
            entry = self._followups.pop()
        self._followups_turn = both and not self._followups_turn
        if entry.merge is not None:
            self._merging.discard(entry.merge)
        return entry


__all__ = ["Entry", "TaskQueue"]
