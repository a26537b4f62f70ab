"""The range ledger: a job's key ranges in the store, the truth about its progress.

Every range is a row with a deterministic id (job + bounds), a checkpoint (the last key
done), a state (``pending`` or ``done``) and the rows it has visited. A page's checkpoint,
the range's children and its own ``done`` are written in one transaction, so a task that
runs twice changes nothing the second time; the job is complete when no range is
pending, and the statement that marks it complete can succeed once. No counters of
outstanding tasks: they break when a task runs twice.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from shardkit._program import Program, call, run
from shardkit.mapper.keys import Key, KeyRange, dump_key, load_key
from shardkit.mapper.tables import LedgerStore, LedgerTables, ledger_tables
from shardkit.store.sql import Sql
from shardkit.store.sql.dialect import Compiled

PENDING, DONE = "pending", "done"
STAY, SPLIT, LAST = "stay", "split", "last"  # how a page leaves its range (checkpoint)
RUNNING, COMPLETE, CANCELLED, FAILED = "running", "complete", "cancelled", "failed"
FINISHED = (COMPLETE, CANCELLED, FAILED)


@dataclass(frozen=True)
class RangeRow:
    """A range as the ledger holds it: ``visited`` rows so far, and the rows ``planned``
    in it (by its parent's estimate, or this run's; None: not planned)."""

    id: str
    range: KeyRange
    after: Key | None
    depth: int
    visited: int
    planned: int | None


class Child(NamedTuple):
    """A range to record: its bounds, its starting checkpoint and its planned rows."""

    range: KeyRange
    after: Key | None = None
    planned: int | None = None


@dataclass(frozen=True)
class JobStatus:
    """A job's progress, read from the ledger in one query.

    ``rows`` counts rows visited (a page retried in a non-transactional job counts once
    per commit); ``estimate`` is the source's row count when the job started (None until
    its first task ran); ``pending`` ranges are queued or in flight; ``depth`` is the
    deepest split so far; ``failures`` counts the failed attempts of its ranges (each
    retried, until ``retries`` is spent; ``resume()`` clears the pending ones');
    ``taken_over`` counts the runs of its ranges begun while an earlier run of the range
    had not ended with a word (done, stopped, or its failure recorded): its worker died
    or was cut off mid-range (the executor delivered its task again), or a failure of it
    the store could not record (``resume()`` clears the pending ones' too). The ledger
    cannot tell a live run from a dead one: a task delivered again while its run still
    runs (a broker's visibility timeout shorter than the run) counts too, and stays
    counted once both runs have ended.
    """

    id: str
    """The job's id."""
    state: str
    """``running``, ``complete``, ``failed`` or ``cancelled``."""
    rows: int
    """Rows visited so far."""
    estimate: int | None
    """The source's row count when the job started."""
    pending: int
    """Ranges queued or in flight."""
    done: int
    """Ranges finished."""
    depth: int
    """The deepest split so far."""
    pages: int
    """Pages visited so far."""
    created_at: float
    """When the job started (Unix time)."""
    finished_at: float | None
    """When it finished, or None."""
    error: str | None
    """Why it failed, or None."""
    failures: int = 0
    """Failed attempts of its ranges."""
    taken_over: int = 0
    """Runs of its ranges begun while an earlier run had not ended with a word (its
    worker died, or its task was delivered again while it ran)."""

    @property
    def finished(self) -> bool:
        """Whether the job has stopped (complete, failed or cancelled)."""
        return self.state in FINISHED


@dataclass(frozen=True)
class RangeInfo:
    """A range of a job, as the ledger holds it: its bounds, the range it was split from
    (None for the root), its state, and what was done in it so far."""

    id: str
    parent: str | None
    range: KeyRange
    state: str
    depth: int
    rows: int
    pages: int
    failures: int
    runs: int
    """Runs of it begun (since its job was last resumed)."""
    error: str | None


class RangeLedger:
    """The ledger's statements, on its tables in a SQL store, created there if missing.
    Thread-safe."""

    def __init__(self, store: LedgerStore) -> None:
        self.store = store
        self.tables = ledger_tables(store.prefix)
        self.tables.create(store)
        self.jobs = self.tables.jobs
        self.ranges = self.tables.ranges
        # The statements of every page, built once: bound by the names p_job, p_range, …
        r, j = self.ranges, self.jobs
        self._this = sa.and_(r.c.job == sa.bindparam("p_job"), r.c.id == sa.bindparam("p_range"))
        self._running = sa.exists().where(j.c.id == sa.bindparam("p_job"), j.c.state == RUNNING)
        read = (r.c.lo, r.c.hi, r.c.after, r.c.depth, r.c.rows, r.c.planned)
        self._lock = (
            sa.update(r)
            .where(self._this, r.c.state == PENDING, self._running)
            .values(pages=r.c.pages + 1)
        )
        self._start = (
            sa.update(r)
            .where(self._this, r.c.state == PENDING)
            .values(runs=sa.func.coalesce(r.c.runs, 0) + 1)
        )
        # MySQL has no UPDATE … RETURNING: it reads the locked row back.
        self._read_locked = sa.select(*read).where(self._this)
        if not store.dialect.is_mysql:
            self._lock = self._lock.returning(*read)
        self._read = (
            sa.select(*read, r.c.state, j.c.state.label("job_state"))
            .join(j, j.c.id == r.c.job)
            .where(self._this)
        )
        pending = sa.exists().where(r.c.job == sa.bindparam("p_job"), r.c.state == PENDING)
        self._claim = (
            sa.update(j)
            .where(j.c.id == sa.bindparam("p_job"), j.c.state == RUNNING, ~pending)
            .values(state=COMPLETE, finished_at=sa.bindparam("p_now"))
        )
        self._any_pending = sa.select(pending)
        other = r.alias("shardkit_other")
        self._another = (
            sa.select(other.c.id)
            .where(other.c.job == sa.bindparam("p_job"), other.c.state == PENDING)
            .where(other.c.id != sa.bindparam("p_range"))
            .limit(1)
            .with_for_update(skip_locked=True)
        )
        self._checkpoints = {
            shape: self._checkpoint_statement(*shape)
            for shape in itertools.product((False, True), (False, True), (STAY, SPLIT, LAST))
        }
        # A page's checkpoint that keeps its range pending, on PostgreSQL through psycopg
        # (not Django's: its transactions are its caller's): run through libpq, as a query
        # that fails when the range moved on, so that sent with its transaction's COMMIT
        # in one round trip, it keeps the COMMIT from running.
        self._direct = {
            (fresh, count_page): Compiled(
                _failing_unless_written(self._checkpoints[fresh, count_page, STAY]),
                store.engine.dialect,
            )
            for fresh, count_page in itertools.product((False, True), (False, True))
            if store.combinable and store.engine.dialect.driver == "psycopg"
        }

    def _range_is(self, job: str, range_id: str) -> Any:
        return sa.and_(self.ranges.c.job == job, self.ranges.c.id == range_id)

    def _checkpoint_statement(self, fresh: bool, count_page: bool, end: str) -> sa.Update:
        """The checkpoint's compare-and-set: of a pending range of a running job, with no
        checkpoint yet (``fresh``) or at ``p_was``; counting a page; keeping the range
        pending (``STAY``) or marking it done — the ``LAST`` of it also returns another
        pending range, locked (where the database has ``UPDATE … RETURNING``)."""
        r = self.ranges
        values: dict[str, Any] = {
            "after": sa.bindparam("p_after"),
            "rows": r.c.rows + sa.bindparam("p_rows"),
            "tries": 0,  # a page went through: a later failure is the next page's first
        }
        if count_page:
            values["pages"] = r.c.pages + 1
        if end != STAY:
            values.update(state=DONE, done_at=sa.bindparam("p_now"))
        was = r.c.after.is_(None) if fresh else r.c.after == sa.bindparam("p_was")
        statement = (
            sa.update(r).where(self._this, r.c.state == PENDING, was, self._running).values(values)
        )
        if end == LAST and not self.store.dialect.is_mysql:
            statement = statement.returning(self._another.scalar_subquery())
        return statement

    # -- jobs ----------------------------------------------------------------------------

    def create(self, job: str, spec: str) -> bool:
        """Record a job and its root range (the whole key space) unless the job exists;
        return whether it was created."""
        now = time.time()
        root = KeyRange()

        def work(conn: Connection) -> bool:
            row = {"id": job, "state": RUNNING, "spec": spec, "created_at": now}
            if not self.store.dialect.insert_ignore(conn, self.jobs, row):
                return False
            self._insert(conn, job, None, [Child(root)], 0, now)
            return True

        return self.store.transaction(f"starting job {job!r}", work)

    def state(self, job: str) -> str | None:
        """The job's state (None if there is no such job): one row read by its key."""
        return run(job_state(self.tables, job), self.store.roles)

    def states(self, jobs: Sequence[str]) -> dict[str, str]:
        """The state of each of ``jobs`` that exists: one read."""
        statement = sa.select(self.jobs.c.id, self.jobs.c.state).where(self.jobs.c.id.in_(jobs))
        rows = self.store.read("reading job states", statement, autocommit=True)
        return {row.id: row.state for row in rows}

    def spec(self, job: str) -> str | None:
        rows = self.store.read(
            f"reading job {job!r}", sa.select(self.jobs.c.spec).where(self.jobs.c.id == job)
        )
        return rows[0].spec if rows else None

    def set_estimate(self, job: str, estimate: int) -> None:
        statement = (
            sa.update(self.jobs)
            .where(self.jobs.c.id == job, self.jobs.c.estimate.is_(None))
            .values(estimate=estimate)
        )
        self.store.transaction(f"estimating job {job!r}", lambda conn: conn.execute(statement))

    def set_state(
        self, job: str, to: str, *, when: Sequence[str], error: str | None = None
    ) -> bool:
        """Move a job in one of the states ``when`` to ``to``; whether it moved."""
        values: dict[str, Any] = {"state": to, "error": error}
        values["finished_at"] = time.time() if to in FINISHED else None
        statement = (
            sa.update(self.jobs)
            .where(self.jobs.c.id == job, self.jobs.c.state.in_(when))
            .values(values)
        )
        return self.store.transaction(
            f"updating job {job!r}", lambda conn: conn.execute(statement).rowcount == 1
        )

    def claim_completion(self, conn: Connection, job: str) -> bool:
        """Mark a running job with no pending range complete, in ``conn``'s transaction;
        whether this call did (at most one ever does)."""
        return conn.execute(self._claim, {"p_job": job, "p_now": time.time()}).rowcount == 1

    def any_pending(self, job: str) -> bool:
        """Whether a range of ``job`` is pending, read outside any transaction (one round
        trip): it sees every range whose transaction committed before it."""
        statement = self._any_pending.params(p_job=job)
        return bool(self.store.read(f"reading job {job!r}", statement, autocommit=True)[0][0])

    def rows_done(self, conn: Connection, job: str) -> int:
        statement = sa.select(sa.func.coalesce(sa.func.sum(self.ranges.c.rows), 0)).where(
            self.ranges.c.job == job
        )
        return int(conn.execute(statement).scalar_one())

    def purge(self, finished_before: float) -> int:
        """Delete the jobs complete or cancelled before the epoch time ``finished_before``,
        with their ranges, in one transaction; return how many jobs. Failed jobs stay:
        they may be resumed."""
        jobs, ranges = self.jobs, self.ranges
        old = sa.select(jobs.c.id).where(
            jobs.c.state.in_((COMPLETE, CANCELLED)), jobs.c.finished_at < finished_before
        )

        def work(conn: Connection) -> int:
            ids = list(conn.execute(old).scalars())
            for start in range(0, len(ids), 500):
                some = ids[start : start + 500]
                conn.execute(sa.delete(ranges).where(ranges.c.job.in_(some)))
                conn.execute(sa.delete(jobs).where(jobs.c.id.in_(some)))
            return len(ids)

        return self.store.transaction("purging finished jobs", work)

    def statuses(self, job: str | None = None) -> list[JobStatus]:
        """The status of ``job``, or of every job (newest first)."""
        return run(job_statuses(self.tables, job), self.store.roles)

    # -- ranges --------------------------------------------------------------------------

    def pending(self, job: str, parent: str | None = None) -> list[str]:
        """Ids of the job's pending ranges (only the children of ``parent``, if given)."""
        where = [self.ranges.c.job == job, self.ranges.c.state == PENDING]
        if parent is not None:
            where.append(self.ranges.c.parent == parent)
        statement = sa.select(self.ranges.c.id).where(*where)
        return [row.id for row in self.store.read(f"reading the ranges of {job!r}", statement)]

    def reset_failures(self, job: str) -> None:
        statement = (
            sa.update(self.ranges)
            .where(self.ranges.c.job == job, self.ranges.c.state == PENDING)
            .values(failures=0, tries=0, runs=0)
        )
        self.store.transaction(f"resuming job {job!r}", lambda conn: conn.execute(statement))

    def started(self, job: str, range_id: str) -> None:
        """Count a run of a pending range begun (a statement of its own, committed
        whatever becomes of the run): a run beyond its failures' retries took it over
        from one that ended unrecorded."""
        params = {"p_job": job, "p_range": range_id}
        self.store.standalone(
            f"starting a range of job {job!r}", lambda conn: conn.execute(self._start, params)
        )

    def take(self, conn: Connection, job: str, range_id: str) -> RangeRow | None:
        """In ``conn``'s transaction, lock a pending range of a running job and read it (a
        second runner of the same range waits here, then finds it moved on); None if the
        range is not pending or the job not running (``read_range`` tells which)."""
        params = {"p_job": job, "p_range": range_id}
        if self.store.dialect.is_mysql:
            if conn.execute(self._lock, params).rowcount != 1:
                return None
            found = conn.execute(self._read_locked, params).first()
        else:
            found = conn.execute(self._lock, params).first()
        return None if found is None else _range_row(range_id, found)

    def read_range(self, conn: Connection, job: str, range_id: str) -> tuple[str, RangeRow] | None:
        """The range's state and row, with its job's state folded in: a range of a job
        that is not running reads as that job's state."""
        row = conn.execute(self._read, {"p_job": job, "p_range": range_id}).first()
        if row is None:
            return None
        state = row.state if row.job_state == RUNNING else row.job_state
        return state, _range_row(range_id, row)

    def checkpoint(
        self,
        conn: Connection,
        job: str,
        row: RangeRow,
        *,
        after: Key | None,
        rows: int,
        children: Sequence[Child] | None,
        count_page: bool,
        commit: bool = False,
    ) -> tuple[list[str], bool] | None:
        """In ``conn``'s transaction: record a page of ``rows`` rows ending at ``after``,
        if the range is still pending at the checkpoint ``row`` holds and its job still
        running. With ``children``, record them and mark the range done; with None, keep
        it pending; with ``[]``, mark it done (nothing left) and lock another pending
        range of the job that no other transaction holds, if there is one: its next run
        waits for this transaction to commit, so it finishes after it (SQLite, with one
        writer at a time, needs no lock). With ``commit``, the checkpoint is the last
        statement of ``conn``'s transaction, which a checkpoint run through libpq
        commits in the same round trip (its owner's COMMIT then has nothing to do).
        Returns the children's ids and whether another range is held; None if another
        run got there first, or the job stopped, or (a checkpoint run through libpq)
        the session had lost its prepared statement: in a transaction, the transaction
        is then to be rolled back and the page visited again."""
        end = STAY if children is None else SPLIT if children else LAST
        params = _checkpoint_params(job, row, after, rows)
        direct = self._direct.get((row.after is None, count_page)) if end == STAY else None
        if direct is not None:
            try:
                ran = direct.run(conn, params, commit=commit)
            except DBAPIError as exc:
                if getattr(exc.orig, "sqlstate", None) == _NOT_WRITTEN:
                    return None
                raise
            return None if ran is None else ([], False)
        statement = self._checkpoints[row.after is None, count_page, end]
        result = conn.execute(statement, params)
        if end == LAST and not self.store.dialect.is_mysql:
            found = result.first()
            return None if found is None else ([], found[0] is not None)
        if result.rowcount != 1:
            return None
        if children is None:
            return [], False
        if not children:  # MySQL, without UPDATE … RETURNING
            return [], conn.execute(self._another, params).first() is not None
        return self._insert(conn, job, row.id, children, row.depth + 1, time.time()), False

    def _insert(
        self,
        conn: Connection,
        job: str,
        parent: str | None,
        ranges: Sequence[Child],
        depth: int,
        now: float,
    ) -> list[str]:
        ids = [child.range.id(job) for child in ranges]
        rows = [
            {
                "job": job,
                "id": range_id,
                "parent": parent,
                "lo": dump_key(child.range.lo),
                "hi": dump_key(child.range.hi),
                "after": dump_key(child.after),
                "state": PENDING,
                "depth": depth,
                "rows": 0,
                "planned": child.planned,
                "pages": 0,
                "failures": 0,
                "created_at": now,
            }
            for range_id, child in zip(ids, ranges, strict=True)
        ]
        self.store.dialect.insert_ignore_many(conn, self.ranges, rows)
        return ids

    def record_failure(self, job: str, range_id: str, error: str) -> int:
        """Count a failed attempt at a pending range (in its ``failures``, and in its
        ``tries``, which its next checkpoint resets); return its tries: the failed
        attempts since its last page (0 if the range is no longer pending)."""
        r = self.ranges
        bump = (
            sa.update(r)
            .where(self._range_is(job, range_id), r.c.state == PENDING)
            .values(
                failures=r.c.failures + 1, tries=sa.func.coalesce(r.c.tries, 0) + 1, error=error
            )
        )
        read = sa.select(r.c.tries).where(self._range_is(job, range_id))

        def work(conn: Connection) -> int:
            if conn.execute(bump).rowcount != 1:
                return 0
            return int(conn.execute(read).scalar_one())

        return self.store.transaction(f"recording a failure in job {job!r}", work)


def _failing_unless_written(update: sa.Update) -> sa.Select[Any]:
    """``update`` as a query that fails with a division by zero (``_NOT_WRITTEN``) when
    it changes no row."""
    written = update.returning(sa.literal_column("1")).cte("written")
    return sa.select(sa.text("1 / count(*)")).select_from(written)


_NOT_WRITTEN = "22012"  # division_by_zero: see _failing_unless_written


def _checkpoint_params(job: str, row: RangeRow, after: Key | None, rows: int) -> dict[str, Any]:
    """The parameters of a checkpoint of ``rows`` rows ending at ``after`` on ``row``."""
    return {
        "p_job": job,
        "p_range": row.id,
        "p_was": dump_key(row.after),
        "p_after": dump_key(after),
        "p_rows": rows,
        "p_now": time.time(),
    }


def _range_row(range_id: str, row: Any) -> RangeRow:
    return RangeRow(
        range_id,
        KeyRange(load_key(row.lo), load_key(row.hi)),
        load_key(row.after),
        row.depth,
        row.rows,
        row.planned,
    )


__all__ = ["Child", "JobStatus", "RangeInfo", "RangeLedger", "RangeRow"]


def job_state(tables: LedgerTables, job: str) -> Program[str | None]:
    """The state of ``job`` (None if there is no such job): one row read by its key,
    outside any transaction."""
    statement = sa.select(tables.jobs.c.state).where(tables.jobs.c.id == job)
    rows = yield from call(Sql.read, f"reading job {job!r}", statement, autocommit=True)
    return str(rows[0].state) if rows else None


def job_statuses(tables: LedgerTables, job: str | None = None) -> Program[list[JobStatus]]:
    """The status of ``job``, or of every job (newest first): one query."""
    jobs, ranges = tables.jobs, tables.ranges
    # A range's runs beyond its first that no recorded failure accounts for.
    unexplained = sa.func.coalesce(ranges.c.runs, 0) - 1 - ranges.c.failures
    per_job = (
        sa.select(
            ranges.c.job,
            sa.func.sum(sa.case((ranges.c.state == PENDING, 1), else_=0)).label("pending"),
            sa.func.sum(sa.case((ranges.c.state == DONE, 1), else_=0)).label("done"),
            sa.func.sum(ranges.c.rows).label("rows"),
            sa.func.sum(ranges.c.pages).label("pages"),
            sa.func.max(ranges.c.depth).label("depth"),
            sa.func.sum(ranges.c.failures).label("failures"),
            sa.func.sum(sa.case((unexplained > 0, unexplained), else_=0)).label("taken_over"),
        )
        .group_by(ranges.c.job)
        .subquery()
    )
    figures = ("pending", "done", "rows", "pages", "depth", "failures", "taken_over")
    counts = [per_job.c[name] for name in figures]
    statement = (
        sa.select(jobs, *counts)
        .outerjoin(per_job, per_job.c.job == jobs.c.id)
        .order_by(jobs.c.created_at.desc(), jobs.c.id)
    )
    if job is not None:
        statement = statement.where(jobs.c.id == job)
    rows = yield from call(Sql.read, "reading job status", statement)
    return [
        JobStatus(
            id=row.id,
            state=row.state,
            rows=int(row.rows or 0),
            estimate=None if row.estimate is None else int(row.estimate),
            pending=int(row.pending or 0),
            done=int(row.done or 0),
            depth=int(row.depth or 0),
            pages=int(row.pages or 0),
            created_at=float(row.created_at),
            finished_at=None if row.finished_at is None else float(row.finished_at),
            error=row.error,
            failures=int(row.failures or 0),
            taken_over=int(row.taken_over or 0),
        )
        for row in rows
    ]


def job_ranges(tables: LedgerTables, job: str, limit: int) -> Program[list[RangeInfo]]:
    """The first ``limit`` ranges of ``job`` by depth (its tree from the root down), in
    one query."""
    ranges = tables.ranges
    statement = (
        sa.select(ranges)
        .where(ranges.c.job == job)
        .order_by(ranges.c.depth, ranges.c.created_at, ranges.c.id)
        .limit(limit)
    )
    rows = yield from call(Sql.read, f"reading the ranges of job {job!r}", statement)
    return [
        RangeInfo(
            id=row.id,
            parent=row.parent,
            range=KeyRange(load_key(row.lo), load_key(row.hi)),
            state=row.state,
            depth=row.depth,
            rows=int(row.rows),
            pages=row.pages,
            failures=row.failures,
            runs=row.runs or 0,
            error=row.error,
        )
        for row in rows
    ]
