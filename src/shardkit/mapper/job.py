"""What a job's functions receive, and the handle to a running job."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection

from shardkit.errors import ConfigurationError, JobFailed, JobTimeout
from shardkit.mapper.ledger import CANCELLED, FAILED, FINISHED, JobStatus

if TYPE_CHECKING:
    from shardkit.mapper.runner import Mapper


@dataclass(frozen=True)
class Batch:
    """One page of a range, handed to the job's function.

    ``rows`` are the source's rows in key order (row mappings for a table source).
    ``conn`` is the connection of the transaction in which the page's checkpoint
    commits — only in a transactional job: writes made through it commit with the
    checkpoint or not at all, so no row is ever applied twice.
    """

    rows: list[Any]
    job: str
    range: str
    _conn: Connection | None = None

    @property
    def conn(self) -> Connection:
        if self._conn is None:
            raise ConfigurationError(
                "batch.conn is given to transactional jobs only: kit.map(…, transactional=True)"
            )
        return self._conn


@dataclass(frozen=True)
class Completion:
    """Handed to ``on_complete``, once, in the transaction that marks the job complete:
    writes through ``conn`` commit with it. If ``on_complete`` raises, the job is left
    failed (not complete) and ``Job.resume()`` runs it again."""

    job: str
    rows: int
    conn: Connection


class Job:
    """A handle to a mapping job; any process with a kit on the same store can open one
    (``kit.job(id)``)."""

    def __init__(self, mapper: Mapper, job_id: str) -> None:
        self._mapper = mapper
        self.id = job_id

    def __repr__(self) -> str:
        return f"<Job {self.id}>"

    def status(self) -> JobStatus:
        """The job's progress, from the ledger."""
        return self._mapper.status(self.id)

    def wait(self, timeout: float | None = None, *, poll: float = 0.1) -> JobStatus:
        """Block until the job is complete and return its status. Raises ``JobFailed``
        if it failed or was cancelled, ``JobTimeout`` after ``timeout`` seconds. Reads
        only the job's state: every ``poll`` seconds, and at once when this handle's kit
        finishes a job (so a job run on its local executor is seen to end when it does);
        its status is read at the end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = self._mapper.finished
        while True:
            state = self._mapper.state(self.id)
            if state in (FAILED, CANCELLED):
                status = self.status()
                raise JobFailed(f"job {self.id} {status.state}: {status.error or 'no error'}")
            if state in FINISHED:
                return self.status()
            if deadline is not None and time.monotonic() >= deadline:
                status = self.status()
                raise JobTimeout(
                    f"job {self.id} still running after {timeout} s "
                    f"({status.rows} rows, {status.pending} ranges pending)"
                )
            left = poll if deadline is None else min(poll, deadline - time.monotonic())
            seen = self._mapper.await_finish(seen, max(left, 0.0))

    def cancel(self) -> bool:
        """Stop the job: pending ranges are no longer picked up (a page in progress
        finishes). Returns False if the job had already finished."""
        return self._mapper.cancel(self.id)

    def resume(self) -> int:
        """Run a stopped or stalled job again: a failed job is set running, every pending
        range is submitted again (each restarts from its checkpoint; one that is already
        running makes the copy a no-op), and completion is checked. Returns how many
        ranges were submitted. Idempotent."""
        return self._mapper.resume(self.id)


__all__ = ["Batch", "Completion", "Job"]
