"""What a job's functions receive, and the handle to a running job."""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Result, Row

from shardkit._program import Blocking, Program, call, role, rule
from shardkit.errors import ConfigurationError, JobFailed, JobNotFound, JobTimeout
from shardkit.mapper.ledger import (
    CANCELLED,
    FAILED,
    FINISHED,
    JobStatus,
    RangeInfo,
    RangeLedger,
    job_ranges,
    job_state,
    job_statuses,
)
from shardkit.mapper.tables import LedgerStore, LedgerTables
from shardkit.store.sql import SqlRoles
from shardkit.validation import check_count


class RowDict(dict[str, Any]):
    """A row of a table source as ``Batch.rows`` gives it: a dict of its columns by name
    (``row["id"]``), whose columns are attributes too (``row.id``)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class RowDicts(Sequence[RowDict]):
    """A page's rows of a table source as ``RowDict``s, each made as it is read and not
    kept: a function that reads each row once makes no more long-lived objects than
    ``records`` holds (so no more work for Python's garbage collector), and pays about
    what ``row.id`` on a record costs."""

    __slots__ = ("_make", "_values")

    def __init__(self, values: list[tuple[Any, ...]], fields: tuple[str, ...]) -> None:
        self._values = values
        self._make = functools.partial(zip, fields)

    def __len__(self) -> int:
        return len(self._values)

    @overload
    def __getitem__(self, index: int) -> RowDict: ...
    @overload
    def __getitem__(self, index: slice) -> list[RowDict]: ...
    def __getitem__(self, index: int | slice) -> RowDict | list[RowDict]:
        if isinstance(index, slice):
            return list(map(RowDict, map(self._make, self._values[index])))
        return RowDict(self._make(self._values[index]))

    def __iter__(self) -> Iterator[RowDict]:
        return map(RowDict, map(self._make, self._values))

    def __repr__(self) -> str:
        return f"<RowDicts of {len(self)} rows>"


_PART = 100
"""Rows taken from a result at a time by ``Records.read``: fewer than the 700 new objects
after which CPython's collector runs, so that no part's rows are alive when it does."""


def _no_row(values: tuple[Any, ...]) -> Row[Any]:
    """What an empty page makes its rows with: none is ever asked for."""
    raise IndexError("the page is empty")


class Records(Sequence[Row[Any]]):
    """A page's rows of a table source as ``Batch.records`` gives them: SQLAlchemy
    ``Row``s, each made as it is read and not kept (two reads of a row give equal rows).

    The page is held as tuples of its values, which CPython's collector stops tracking
    the first time it looks at them. Held as rows, each would stay tracked as long as
    its worker holds the page (through fn and the checkpoint): with 2,000-row pages, a
    full collection of the whole heap every hundred pages or so. Rows are made by
    SQLAlchemy's public ``result_tuple``, keyed by the columns' names and, given the
    statement's ``columns``, by those columns too (``row._mapping[table.c.id]``), as
    the result's own rows are."""

    __slots__ = ("_fields", "_make", "_values")

    def __init__(self, rows: Iterable[Row[Any]], columns: Iterable[Any] | None = None) -> None:
        iterator = iter(rows)
        first = next(iterator, None)
        if first is None:
            self._values: list[tuple[Any, ...]] = []
            self._fields: tuple[str, ...] = ()
            self._make: Callable[[tuple[Any, ...]], Row[Any]] = _no_row
            return
        self._values = [tuple(first), *map(tuple, iterator)]
        self._fields = first._fields
        # Made of values as the result gives them, already converted by column type.
        extra = None if columns is None else [(column,) for column in columns]
        self._make = sa.result_tuple(self._fields, extra)

    @classmethod
    def read(cls, result: Result[Any], columns: Iterable[Any] | None = None) -> Records:
        """All of ``result``'s rows, taken ``_PART`` at a time; ``columns``: its
        statement's selected columns."""
        return cls(itertools.chain.from_iterable(result.partitions(_PART)), columns)

    def again(self, values: list[tuple[Any, ...]]) -> Records:
        """Rows of the same columns as these, made as these are, of ``values``: tuples of
        a row's values each, as these rows' result would give them."""
        records = Records.__new__(Records)
        records._values, records._fields, records._make = values, self._fields, self._make
        return records

    def __len__(self) -> int:
        return len(self._values)

    @overload
    def __getitem__(self, index: int) -> Row[Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[Row[Any]]: ...
    def __getitem__(self, index: int | slice) -> Row[Any] | list[Row[Any]]:
        if isinstance(index, slice):
            return list(map(self._make, self._values[index]))
        return self._make(self._values[index])

    def __iter__(self) -> Iterator[Row[Any]]:
        return map(self._make, self._values)

    def __repr__(self) -> str:
        return f"<Records of {len(self)} rows>"

    def dicts(self) -> RowDicts:
        """The same rows as ``RowDict``s."""
        return RowDicts(self._values, self._fields)


@dataclass(frozen=True)
class Batch:
    """One page of a range, handed to the job's function.

    ``records`` are the source's rows in key order as read: SQLAlchemy ``Row`` objects
    for a table source (``row.id``, ``row[0]``), each made as it is read (``Records``),
    model instances for a queryset. ``rows`` are the same rows with a table source's as
    dicts of their columns by name (``RowDict``: ``row["id"]``, also ``row.id``), each
    made as it is read too (``RowDicts``), about as cheap as reading ``records``.
    ``conn`` is the connection of the transaction in which the page's checkpoint commits
    — only in a transactional job: writes made through it commit with the checkpoint or
    not at all, so no row is ever applied twice.
    """

    records: Sequence[Any]
    """The page's rows, in key order, as read."""
    job: str
    """The job's id."""
    range: str
    """The id of the range the page belongs to."""
    _conn: Connection | None = None

    @property
    def rows(self) -> Sequence[Any]:
        """The page's rows as dicts (``row["id"]``; model instances for a queryset)."""
        records = self.records
        if records and not isinstance(records, Records) and isinstance(records[0], Row):
            records = Records(records)  # a source of one's own that reads SQLAlchemy rows
        return records.dicts() if isinstance(records, Records) else records

    @property
    def conn(self) -> Connection:
        """The transaction that commits the page's checkpoint (transactional jobs only:
        ``ConfigurationError`` otherwise)."""
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
    """The job's id."""
    rows: int
    """Rows the job visited."""
    conn: Connection
    """The transaction that marks the job complete."""


@role("finishes")
class Finishes(Protocol):
    """The role that tells a waiter of jobs this process finished: the sync kit's
    mapper (its local executor runs jobs; a waiter wakes when one ends), or, in the
    async kit, a clock (jobs are run elsewhere: a waiter polls)."""

    def finished(self) -> int:
        """How many jobs this process has finished so far."""
        ...

    def await_finish(self, seen: int, timeout: float) -> int:
        """Wait until ``finished()`` passes ``seen``, or ``timeout`` seconds; return it."""
        ...


@dataclass(frozen=True, slots=True)
class JobRoles(SqlRoles):
    """What a job handle's programs run on."""

    finishes: Finishes


class JobCore:
    """A job handle's reads, for its sync and async forms: programs on ``JobRoles``."""

    roles: JobRoles

    def __init__(self, url: str, tables: LedgerTables, job_id: str) -> None:
        self._url = url  # the store's, for messages
        self._tables = tables
        self.id = job_id
        """The job's id: ``kit.job(id)`` opens it from any process on the store."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    @rule
    def status(self) -> Program[JobStatus]:
        """The job's progress, from the ledger."""
        found = yield from job_statuses(self._tables, self.id)
        if not found:
            raise JobNotFound(f"no job {self.id!r} in {self._url}")
        return found[0]

    @rule
    def ranges(self, limit: int = 1000) -> Program[list[RangeInfo]]:
        """The job's ranges, root first then level by level (at most ``limit``, 1 …
        1,000,000): its tree of splits, each range with its state and progress."""
        return (yield from job_ranges(self._tables, self.id, check_count(limit)))

    @rule
    def wait(self, timeout: float | None = None, *, poll: float = 0.1) -> Program[JobStatus]:
        """Wait until the job is complete and return its status. Raises ``JobFailed`` if
        it failed or was cancelled, ``JobTimeout`` after ``timeout`` seconds. Reads only
        the job's state: every ``poll`` seconds, and at once when this handle's kit
        finishes a job (so a job run on its local executor is seen to end when it does);
        its status is read at the end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = yield from call(Finishes.finished)
        while True:
            state = yield from job_state(self._tables, self.id)
            if state is None:
                raise JobNotFound(f"no job {self.id!r} in {self._url}")
            if state in (FAILED, CANCELLED):
                status = yield from JobCore.status.program(self)
                raise JobFailed(f"job {self.id} {status.state}: {status.error or 'no error'}")
            if state in FINISHED:
                return (yield from JobCore.status.program(self))
            if deadline is not None and time.monotonic() >= deadline:
                status = yield from JobCore.status.program(self)
                raise JobTimeout(
                    f"job {self.id} still running after {timeout} s "
                    f"({status.rows} rows, {status.pending} ranges pending)"
                )
            left = poll if deadline is None else min(poll, deadline - time.monotonic())
            seen = yield from call(Finishes.await_finish, seen, max(left, 0.0))


class Jobs(Finishes, Protocol):
    """What a job handle uses of the mapper that opened it (``shardkit.mapper.Mapper``):
    its store and ledger, and the stops and restarts of jobs."""

    @property
    def store(self) -> LedgerStore: ...
    @property
    def ledger(self) -> RangeLedger: ...
    def cancel(self, job: str) -> bool: ...
    def resume(self, job: str) -> int: ...


class Job(JobCore, Blocking):
    """A handle to a mapping job; any process with a kit on the same store can open one
    (``kit.job(id)``)."""

    def __init__(self, mapper: Jobs, job_id: str) -> None:
        super().__init__(mapper.store.url, mapper.ledger.tables, job_id)
        self._mapper = mapper
        self.roles = JobRoles(mapper.store.roles.sql, mapper)

    def cancel(self) -> bool:
        """Stop the job: pending ranges are no longer picked up, and a running range's
        page in progress gets no checkpoint (a transactional page rolls back with fn's
        writes). Returns False if the job had already finished."""
        return self._mapper.cancel(self.id)

    def resume(self) -> int:
        """Run a stopped or stalled job again: a failed job is set running, every pending
        range is submitted again (each restarts from its checkpoint; one that is already
        running makes the copy a no-op), and completion is checked. Returns how many
        ranges were submitted. Idempotent."""
        return self._mapper.resume(self.id)


__all__ = [
    "Batch",
    "Completion",
    "Finishes",
    "Job",
    "JobCore",
    "Jobs",
    "Records",
    "RowDict",
    "RowDicts",
]
