"""The mapper: jobs of range tasks that visit a page, checkpoint, and split what is left.

A range task (``run_range``, submitted to the kit's executor as ``map_range`` with JSON
arguments ``{"job", "range"}``) takes one page of its range, hands it to the job's
function and checkpoints, page after page. After a full page it decides whether to split
what is left of its range into up to ``fanout`` children, from what the database already
knows and a few index probes — never by reading the range (see ``Mapper._plan``). A
range planned at a leaf's size or less goes on in place. The tree grows until it has
about a leaf per worker of a local executor (``fanout**2`` leaves on another: a Celery
deployment's workers are not known here), each at least ``fanout`` pages, and again
wherever a range holds more rows than planned, or a local executor's worker waits with
nothing to do (split on demand).

Transactional jobs run the page, the function and the checkpoint in one transaction on
the store's database: exactly once. Others call the function outside any transaction
and checkpoint with a compare-and-set: at least once per page (a page whose checkpoint
is lost to a crash or a concurrent run is visited again). Either way a run keeps its
range's checkpoint in memory from page to page: the checkpoint's compare-and-set is the
only ledger statement of a page.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from sqlalchemy.engine import Connection

from shardkit import metrics
from shardkit._failures import FailureLog
from shardkit.errors import ConfigurationError, JobNotFound, ShardkitError
from shardkit.executor import Executor, LocalExecutor
from shardkit.mapper.job import Batch, Completion, Job
from shardkit.mapper.keys import Key, KeyRange
from shardkit.mapper.ledger import (
    CANCELLED,
    COMPLETE,
    DONE,
    FAILED,
    FINISHED,
    PENDING,
    RUNNING,
    JobStatus,
    RangeLedger,
    RangeRow,
)
from shardkit.mapper.planning import Children, Planner
from shardkit.mapper.source import Statistics, StatisticsSource
from shardkit.mapper.spec import MapSpec, Signer
from shardkit.mapper.tables import LedgerStore
from shardkit.mapper.task import TASK

log = logging.getLogger("shardkit")

_RETRY_DELAY = 0.05  # seconds before the first retry of a failed range; doubles
_MAX_RETRY_DELAY = 30.0
# A kind of failure: those the store could not record.
_UNRECORDED = metrics.action("mapping ranges")
# Failed jobs whose functions only this process holds (closures with no secret to sign
# them), kept for ``resume()``: the newest this many.
_KEEP_FAILED = 100

# The page each worker thread read last, let go when it reads the next (see ``_read``).
_last_page = threading.local()


class _Next(NamedTuple):
    """What follows a page: go on in place (``pending``, from the range as ``row`` now
    holds it), stop (``done``, having split into ``children``, or the state of a range or
    job that stops the task); and whether to try to complete the job."""

    state: str
    children: Sequence[str] = ()
    complete: bool = False
    row: RangeRow | None = None


class _Page(NamedTuple):
    """A page read from a range, and what follows it (see ``Mapper._plan``): its
    ``children``, and the rows now ``planned`` in the range. ``taken``: the range was
    locked, and the page counted, by this transaction."""

    row: RangeRow
    rows: Sequence[Any]
    after: Key | None
    children: Children | None
    planned: int | None
    taken: bool


class _Moved(Exception):
    """A transactional page's checkpoint found its range moved on by another run (or its
    job stopped): the page's transaction, fn's writes with it, rolls back."""


class _Held(NamedTuple):
    """A running job's spec, and whether only this process has it (the ledger's copy
    cannot rebuild it)."""

    spec: MapSpec
    only_here: bool


class Mapper:
    """Starts jobs, runs their range tasks, reports on them. Thread-safe.

    The functions of jobs started in this process are kept here, so closures need no
    pickling on a local executor; other processes rebuild a job from its stored spec.
    A job's spec is held while it runs and released when it finishes, so a process that
    runs jobs for weeks holds those that run, not those that ran: when this mapper
    finishes it, or when the mapper takes up another job and the ledger shows it
    finished elsewhere. A failed job whose functions only this process has keeps them
    for ``resume()`` (the newest ``_KEEP_FAILED`` such jobs; an older one is resumed by
    starting it again under its id).
    """

    def __init__(self, store: LedgerStore, executor: Executor, signer: Signer | None) -> None:
        self.store = store
        self.ledger = RangeLedger(store)
        self.executor = executor
        self.signer = signer
        self._specs: dict[str, _Held] = {}  # the running jobs'
        self._stopped: dict[str, MapSpec] = {}  # failed, only here; oldest first
        self._lock = threading.Lock()
        self._news = threading.Condition()  # notified when this mapper finishes a job
        self._stats: dict[str, Statistics] = {}  # the running jobs' sources'
        self._unrecorded: dict[tuple[str, str], int] = {}  # failures the store missed
        self._failures = FailureLog(log)
        self._finished = 0  # how many times it has
        self.planner = Planner(executor)

    # -- news for waiters ----------------------------------------------------------------

    def finished(self) -> int:
        """How many times this mapper (its kit) has finished a job: completed, failed or
        cancelled it."""
        with self._news:
            return self._finished

    def await_finish(self, seen: int, timeout: float) -> int:
        """Block until this mapper finishes a job past the ``seen``-th time, or for
        ``timeout`` seconds; return ``finished``. Jobs finished elsewhere (another kit,
        another process) wake no one here: waiters poll for those."""
        with self._news:
            self._news.wait_for(lambda: self._finished != seen, timeout)
            return self._finished

    def _set_state(
        self, job: str, to: str, *, when: Sequence[str], error: str | None = None
    ) -> bool:
        moved = self.ledger.set_state(job, to, when=when, error=error)
        if moved and to in FINISHED:
            self._release({job: to})
            self._announce()
        return moved

    def _announce(self) -> None:
        with self._news:
            self._finished += 1
            self._news.notify_all()

    # -- jobs ----------------------------------------------------------------------------

    def start(self, job: str, spec: MapSpec) -> Job:
        """Record and start ``job``; a job of that id that exists is resumed instead."""
        text, missing = spec.dumps(self.signer)
        if missing and not isinstance(self.executor, LocalExecutor):
            raise ConfigurationError(
                f"the job's {', '.join(missing)} must travel to {self.executor.url}: use "
                "importable functions (module-level, 'package.module:name'), or give the "
                "kit a secret (connect(secret=…) or $SHARDKIT_SECRET) to sign closures"
            )
        self._hold(job, spec, only_here=bool(missing), replace=True)
        if not self.ledger.create(job, text):
            self.resume(job)
            return Job(self, job)
        # Once the job is there to be seen: a Django store's caller may hold it in a
        # transaction, which the range's task, on another connection, would not see.
        self.store.after_commit(lambda: self._submit(job, [KeyRange().id(job)]))
        return Job(self, job)

    def job(self, job: str) -> Job:
        self.status(job)
        return Job(self, job)

    def status(self, job: str) -> JobStatus:
        found = self.ledger.statuses(job)
        if not found:
            raise JobNotFound(f"no job {job!r} in {self.store.url}")
        return found[0]

    def state(self, job: str) -> str:
        """The job's state alone: cheaper than its ``status``, which counts its ranges."""
        state = self.ledger.state(job)
        if state is None:
            raise JobNotFound(f"no job {job!r} in {self.store.url}")
        return state

    def statuses(self) -> list[JobStatus]:
        return self.ledger.statuses()

    def cancel(self, job: str) -> bool:
        self.status(job)
        return self._set_state(job, CANCELLED, when=[RUNNING])

    def resume(self, job: str) -> int:
        status = self.status(job)
        if status.state in (COMPLETE, CANCELLED):
            self._release({job: status.state})
            return 0
        with self._lock:
            kept = self._stopped.pop(job, None)
        # A job this process cannot run is refused by _load.
        spec = self._load(job) if kept is None else self._hold(job, kept, only_here=True)
        self._set_state(job, RUNNING, when=[RUNNING, FAILED])
        self.ledger.reset_failures(job)
        pending = self.ledger.pending(job)
        self.store.after_commit(lambda: self._submit(job, pending))
        if not pending:
            self._complete(job, spec)
        return len(pending)

    def _spec(self, job: str) -> MapSpec | None:
        """The spec of a job whose ranges run: held here, or rebuilt from the ledger and
        held while the job runs. None if it is not running (its ranges have nothing to
        do): a stray task of a finished job rebuilds nothing."""
        spec = self._held(job)
        if spec is not None or self.ledger.states([job]).get(job) != RUNNING:
            return spec
        return self._load(job)

    def _held(self, job: str) -> MapSpec | None:
        with self._lock:
            held = self._specs.get(job)
            return held.spec if held is not None else self._stopped.get(job)

    def _load(self, job: str) -> MapSpec:
        """The job's spec, held here or rebuilt from the ledger (and held)."""
        spec = self._held(job)
        if spec is not None:
            return spec
        text = self.ledger.spec(job)
        if text is None:
            raise JobNotFound(f"no job {job!r} in {self.store.url}")
        return self._hold(job, MapSpec.loads(text, self.store.engine, self.signer))

    def _hold(
        self, job: str, spec: MapSpec, *, only_here: bool = False, replace: bool = False
    ) -> MapSpec:
        """Hold ``job``'s spec while it runs (unless one is held and not ``replace``) and
        return the one held. A job new to this mapper first releases those the ledger
        shows finished elsewhere: what is held stays about the jobs running."""
        with self._lock:
            held = list(self._specs) if job not in self._specs else []
        if held:
            self._release(self.ledger.states(held), finished_only=True)
        with self._lock:
            if replace or job not in self._specs:
                self._specs[job] = _Held(spec, only_here)
                self._stopped.pop(job, None)
            return self._specs[job].spec

    def _release(self, states: dict[str, str], *, finished_only: bool = False) -> None:
        """Forget the specs of the jobs in ``states`` (job -> state), or only of those
        finished: a failed job's only copy of its functions is kept for ``resume()``."""
        with self._lock:
            for job, state in states.items():
                if finished_only and state not in FINISHED:
                    continue
                held = self._specs.pop(job, None)
                self._stats.pop(job, None)
                self._stopped.pop(job, None)
                if state == FAILED and held is not None and held.only_here:
                    self._stopped[job] = held.spec
                    while len(self._stopped) > _KEEP_FAILED:
                        del self._stopped[next(iter(self._stopped))]
                for key in [key for key in self._unrecorded if key[0] == job]:
                    del self._unrecorded[key]

    def _submit(self, job: str, ranges: Sequence[str], delay: float = 0.0) -> None:
        for range_id in ranges:
            self.executor.submit(TASK, {"job": job, "range": range_id}, delay=delay)

    # -- the range task ------------------------------------------------------------------

    def run_range(self, job: str, range_id: str) -> None:
        """Visit range ``range_id`` of ``job`` page by page until it is done or split.
        Idempotent: a range that is done (or a job that is not running) is left alone,
        except that the pending children of a done range are submitted again (the run
        that split it may have died before submitting them)."""
        metrics.meter.running(job, 1)
        try:
            spec = self._spec(job)
            if spec is None:
                return
            if range_id == KeyRange().id(job):
                self._estimate(job, spec)
            self.ledger.started(job, range_id)
            row: RangeRow | None = None  # the range as this run left it: read it first
            while True:
                try:
                    step = self._step(job, range_id, spec, row)
                    if step is not None and step.state == DONE:
                        self._submit(job, step.children)
                finally:
                    self.planner.unclaim()
                if step is None:
                    row = None  # another run moved the checkpoint first: read it again
                    continue
                if step.state == PENDING:
                    row = step.row
                    continue
                if step.complete:
                    self._complete(job, spec)
                self._ran(job, range_id)
                return
        except Exception as exc:
            self._failed(job, range_id, exc)
        finally:
            _last_page.rows = None
            metrics.meter.running(job, -1)

    def _ran(self, job: str, range_id: str) -> None:
        """A run of the range ended well: forget its failures that the store missed."""
        if self._unrecorded:  # unlocked: empty unless the store was unreachable
            with self._lock:
                self._unrecorded.pop((job, range_id), None)
        self._failures.worked(_UNRECORDED)

    def _statistics(self, job: str, spec: MapSpec) -> Statistics:
        """The source's statistics, read once per job and process on a connection of
        their own (outside any page's transaction, which a failed read would abort);
        none if the source has no such ability or reading them fails (logged once: the
        job plans without them)."""
        with self._lock:
            found = self._stats.get(job)
        if found is None:
            found = Statistics(None)
            if isinstance(spec.source, StatisticsSource):
                try:
                    with self.store.engine.connect() as conn:
                        found = spec.source.statistics(conn)
                except Exception as exc:
                    log.warning("job %s: no statistics of its source: %s", job, _describe(exc))
            with self._lock:
                if job in self._specs:  # held while the job runs: released with it
                    self._stats[job] = found
        return found

    def _estimate(self, job: str, spec: MapSpec) -> None:
        """Record the source's estimated rows as the job's progress estimate, once (the
        root's run, before its first page): the statistics, not a count."""
        rows = self._statistics(job, spec).rows
        if rows is not None:
            self.ledger.set_estimate(job, rows)

    def _step(self, job: str, range_id: str, spec: MapSpec, row: RangeRow | None) -> _Next | None:
        """Visit one page, from ``row`` (None: read the range first). Returns what comes
        next (None: read the range again)."""
        if spec.transactional:

            def visit(tx: Connection) -> _Next:
                page = self._read(tx, tx, job, range_id, spec, row)
                step = page if isinstance(page, _Next) else self._visit(tx, job, spec, page)
                if step is None:
                    raise _Moved  # roll fn's writes back with the page
                return step

            try:
                return self.store.transaction(f"mapping a range of job {job!r}", visit)
            except _Moved:
                return None
        # The read's connection returns to the pool before fn runs, however long; its
        # statements are autocommitted where that is free (no BEGIN, no ROLLBACK).
        with self.store.engine.connect() as conn:
            if self.store.autocommits_free:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            page = self._read(conn, None, job, range_id, spec, row)
        return page if isinstance(page, _Next) else self._visit(None, job, spec, page)

    def _read(
        self,
        conn: Connection,
        tx: Connection | None,
        job: str,
        range_id: str,
        spec: MapSpec,
        row: RangeRow | None,
    ) -> _Next | _Page:
        """Read the range's next page and plan what follows, from ``row`` as this run left
        it (its checkpoint's compare-and-set finds out if another run moved it), or else
        take (in ``tx``) or read the range first; or what follows at once, when the
        range is not there to visit."""
        taken = False
        if row is None:
            row = None if tx is None else self.ledger.take(tx, job, range_id)
            taken = row is not None
        if row is None:
            found = self.ledger.read_range(conn, job, range_id)
            if found is None:
                return _Next(FAILED)
            state, row = found
            if state == DONE:
                # A done range's pending children: the run that split it may have died
                # before submitting them, or before trying to complete the job.
                pending = self.ledger.pending(job, parent=range_id)
                return _Next(DONE, pending, complete=not pending)
            if state != PENDING or tx is not None:  # not taken, yet pending: resumed; again
                return _Next(state)
        rows = spec.source.page(conn, row.range.past(row.after), row.after, spec.page_size)
        # The page before is let go here, just after this one was made, not when its
        # step ended: CPython's collector runs when new objects outnumber those freed by
        # 700, and workers each holding a page through fn's I/O set it off every page or
        # two, each run going through the held pages' objects it still tracks (a table's
        # values, until it has looked at them once; a queryset's model instances).
        _last_page.rows = rows
        after = spec.source.key_of(rows[-1]) if rows else row.after
        stats = self._statistics(job, spec)
        children, planned = self.planner.plan(conn, spec, row, rows, after, stats)
        return _Page(row, rows, after, children, planned, taken)

    def _visit(self, tx: Connection | None, job: str, spec: MapSpec, page: _Page) -> _Next | None:
        """Hand the page to fn (unless it is empty: the range ended with the page before)
        and checkpoint it (in ``tx``, or in a transaction of its own)."""
        if page.rows:
            spec.fn(Batch(page.rows, job, page.row.id, tx))
        return self._checkpoint(tx, job, page)

    def _checkpoint(self, tx: Connection | None, job: str, page: _Page) -> _Next | None:
        """Checkpoint the page: in ``tx``, its last statement (which commits it, where the
        ledger can, in the same round trip), or on its own (then a page that keeps its
        range pending is one autocommitted statement where that is free). None: the
        range moved on (``tx`` is rolled back, or to be)."""
        row, children = page.row, page.children
        after, rows, count_page = page.after, len(page.rows), not page.taken
        going_on = _Next(
            PENDING,
            row=replace(row, after=after, visited=row.visited + rows, planned=page.planned),
        )

        def write(conn: Connection) -> _Next | None:
            done = self.ledger.checkpoint(
                conn,
                job,
                row,
                after=after,
                rows=rows,
                children=children,
                count_page=count_page,
                commit=tx is not None,
            )
            if done is None:
                return None
            if children is None:
                return going_on
            # A range that finishes leaves completing the job to a pending range it holds
            # until it commits (that range's run ends later); if it holds none, it tries.
            ids, held = done
            return _Next(DONE, ids, complete=children == [] and not held)

        if tx is not None:
            return write(tx)
        action = f"checkpointing a range of job {job!r}"
        if children is None:
            return self.store.standalone(action, write)
        return self.store.transaction(action, write)

    # -- completion and failure ----------------------------------------------------------

    def _complete(self, job: str, spec: MapSpec) -> None:
        """Mark the job complete if no range is pending, and run ``on_complete`` in the
        same transaction: at most one call ever commits. Called after a range's last
        commit: of ranges that finish together, the last to look finds none pending, so a
        look outside any transaction spares the others a transaction. A failure here
        fails the job (``resume()`` completes it)."""

        def work(conn: Connection) -> bool:
            if not self.ledger.claim_completion(conn, job):
                return False
            if spec.on_complete is not None:
                spec.on_complete(Completion(job, self.ledger.rows_done(conn, job), conn))
            return True

        try:
            if not self.ledger.any_pending(job) and self.store.transaction(
                f"completing job {job!r}", work
            ):
                log.info("job %s complete", job)
                self._release({job: COMPLETE})
                self._announce()
        except Exception as exc:
            error = _describe(exc)
            self._set_state(job, FAILED, when=[RUNNING], error=f"completing: {error}")
            log.warning("job %s: completing failed: %s", job, error)

    def _failed(self, job: str, range_id: str, exc: Exception) -> None:
        """Count a failed attempt and retry the range later, until ``retries`` attempts
        in a row have failed (with no page gone through between them: a long range may
        meet a passing failure on many of its pages); then fail the job."""
        error = _describe(exc)
        try:
            spec = self._spec(job)
            if spec is None:
                return  # the job stopped: nothing to retry
            tries = self.ledger.record_failure(job, range_id, error)
            if tries == 0:
                return
            if tries > spec.retries:
                self._set_state(job, FAILED, when=[RUNNING], error=error)
                log.warning("job %s failed: range %s: %s", job, range_id, error)
                return
            delay = min(_MAX_RETRY_DELAY, _RETRY_DELAY * 2 ** (tries - 1))
            log.info("job %s: range %s failed (%s), retry in %.2f s", job, range_id, error, delay)
            self._submit(job, [range_id], delay)
        except ShardkitError as again:
            self._retry_unrecorded(job, range_id, error, again)

    def _retry_unrecorded(self, job: str, range_id: str, error: str, again: Exception) -> None:
        """A failure the store could not record (it is down, most likely): retry the range
        all the same, after a delay doubling with each such failure of it in this process,
        so that the job goes on by itself once the store answers. Outside the ledger's
        count: a store that stays down is retried every ``_MAX_RETRY_DELAY`` seconds."""
        with self._lock:
            unrecorded = self._unrecorded.get((job, range_id), 0) + 1
            self._unrecorded[job, range_id] = unrecorded
        delay = min(_MAX_RETRY_DELAY, _RETRY_DELAY * 2 ** (unrecorded - 1))
        self._failures.failed(
            _UNRECORDED,
            "job %s: range %s failed (%s), and recording that failed (%s); retry in %.2f s",
            *(job, range_id, error, again, delay),
        )
        try:
            self._submit(job, [range_id], delay)
        except ShardkitError as lost:
            # Left pending in the ledger: Job.resume() or a redelivery picks it up.
            log.warning("job %s: range %s cannot be retried: %s", job, range_id, lost)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


__all__ = ["Mapper"]
