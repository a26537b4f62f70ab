"""The functions of the mapper's fault tests, and a process that runs a job with them.

They are importable by path (``mapper_workers:add_ten``) in every process that runs the
job's ranges: the test's own subprocesses (``python mapper_workers.py …``) and Celery
workers (which find this directory on ``PYTHONPATH``). Everything they need comes from
environment variables:

* ``SHARDKIT_MAPPER_TABLE``: the source table (key column ``k``, column ``balance``);
  ``add_ten`` adds 10 to the page's rows, ``record_completion`` inserts a row into
  ``<table>_done``;
* ``SHARDKIT_MAPPER_FAULTS``: a directory where faults are counted. A page fails
  (exception) with probability ``FAIL_PROBABILITY``, and every ``FORCED_EVERY``-th page of
  a process while a kind of failure has not struck yet; every process SIGKILLs itself
  once, at a page picked at random among its first pages, as long as one of the
  ``SHARDKIT_MAPPER_KILLS`` kill slots is free (each is a file created with O_EXCL, so
  the slots are shared by every process). Each fault strikes after the page's update,
  either in ``fn`` or as the checkpoint statement is about to run (each at least once,
  then either at random): both before the transaction commits, so neither may leave a
  trace.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa

FAIL_PROBABILITY = 0.04
FORCED_EVERY = 10  # until both kinds of failure have struck, every 10th page of a process
KILL_WITHIN = (5, 15)  # a process kills itself at one of its pages in this range

_pages = itertools.count(1)
_kill_at = random.randint(*KILL_WITHIN)


class InjectedFault(Exception):
    """The failure a test injects into a page."""


def _table(suffix: str = "") -> Any:
    name = os.environ["SHARDKIT_MAPPER_TABLE"] + suffix
    return sa.table(name, sa.column("k"), sa.column("balance"), sa.column("job"), sa.column("rows"))


def _claim_kill() -> int | None:
    """Claim a free kill slot; its number, or None when all are spent."""
    faults = Path(os.environ["SHARDKIT_MAPPER_FAULTS"])
    for slot in range(int(os.environ.get("SHARDKIT_MAPPER_KILLS", "0"))):
        try:
            os.close(os.open(faults / f"kill-{slot}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        return slot
    return None


def add_ten(batch: Any) -> None:
    """Add 10 to the balance of the page's rows through the job's transaction; then,
    sometimes, fail or die before that transaction commits: here, or at the statement
    that writes the page's checkpoint, after this function returned."""
    _arm(batch.conn)
    table = _table()
    keys = [row["k"] for row in batch.rows]
    batch.conn.execute(
        sa.update(table).where(table.c.k.in_(keys)).values(balance=table.c.balance + 10)
    )
    page = next(_pages)
    if page == _kill_at:
        slot = _claim_kill()
        if slot is not None:
            if slot % 2 == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            _pending().add("kill")
            return
    if random.random() < FAIL_PROBABILITY or (page % FORCED_EVERY == 0 and not _both_struck()):
        if _in_fn():
            _fail(batch.range, "in fn")
        _pending().add("fail")


def _struck() -> str:
    """The failures log: a line per failure injected, in any process."""
    log = Path(os.environ["SHARDKIT_MAPPER_FAULTS"]) / "failures"
    return log.read_text() if log.exists() else ""


def _both_struck() -> bool:
    struck = _struck()
    return "in fn" in struck and "at checkpoint" in struck


def _in_fn() -> bool:
    """Whether a failure strikes in fn rather than at the checkpoint: where one kind has
    not struck yet (in any process), that one; then either, at random."""
    struck = _struck()
    if "in fn" not in struck:
        return True
    return "at checkpoint" in struck and random.random() < 0.5


def _fail(range_id: str, where: str) -> None:
    with open(Path(os.environ["SHARDKIT_MAPPER_FAULTS"]) / "failures", "a") as log:
        log.write(f"{os.getpid()} {range_id} {where}\n")
    raise InjectedFault(f"injected into range {range_id} {where}")


_local = threading.local()


def _pending() -> set[str]:
    """The faults this thread left for its next checkpoint."""
    if not hasattr(_local, "faults"):
        _local.faults = set()
    return _local.faults  # type: ignore[no-any-return]


# The checkpoint's UPDATE (on its own, or within the query that runs it through libpq).
_CHECKPOINT = re.compile(r"""UPDATE \S*ranges SET [`"]?after[`"]?=""")


def _strike(statement: str) -> None:
    """Strike the faults this thread left for its checkpoint, if ``statement`` is it."""
    if not _CHECKPOINT.search(statement):
        return
    faults = _pending()
    if "kill" in faults:
        os.kill(os.getpid(), signal.SIGKILL)
    if "fail" in faults:
        faults.discard("fail")
        _fail("?", "at checkpoint")


def _arm(conn: Any) -> None:
    """Strike the faults left for the checkpoint as its statement is about to be sent on
    ``conn`` (a page's function and its checkpoint run in one thread, on one connection):
    with psycopg, through its cursors and the statements run through libpq directly (the
    checkpoint of a page that keeps its range pending), else through SQLAlchemy's event."""
    if conn.dialect.driver == "psycopg":
        conn.connection.dbapi_connection.cursor_factory = _striking_cursor()
        _strike_through_libpq()
    else:
        _listen(conn.engine)


@functools.cache
def _strike_through_libpq() -> None:
    """Strike before each run of a statement through libpq (``LibpqStatement.redoable``
    and ``committing``, as the mapper's checkpoint runs)."""
    from shardkit.store.sql.dialect import LibpqStatement

    def striking(
        running: Callable[[LibpqStatement, Any], Callable[[Sequence[Any]], Any]],
    ) -> Callable[[LibpqStatement, Any], Callable[[Sequence[Any]], Any]]:
        def on(self: LibpqStatement, conn: Any) -> Callable[[Sequence[Any]], Any]:
            run = running(self, conn)

            def strike_then_run(values: Sequence[Any]) -> Any:
                _strike(self.sql)
                return run(values)

            return strike_then_run

        return on

    LibpqStatement.redoable = striking(LibpqStatement.redoable)  # type: ignore[method-assign]
    LibpqStatement.committing = striking(LibpqStatement.committing)  # type: ignore[method-assign]


@functools.cache
def _striking_cursor() -> type:
    import psycopg

    class Striking(psycopg.Cursor[Any]):
        def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            _strike(str(query))
            return super().execute(query, *args, **kwargs)

    return Striking


@functools.cache
def _listen(engine: sa.Engine) -> None:
    @sa.event.listens_for(engine, "before_cursor_execute")
    def strike(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        _strike(statement)


def record_completion(completion: Any) -> None:
    """Record the job's completion, in the transaction that marks it complete."""
    done = _table("_done")
    completion.conn.execute(sa.insert(done).values(job=completion.job, rows=completion.rows))


def main(store: str, prefix: str, job: str) -> None:
    """Start (or resume) ``job`` over the table on a local executor, and wait for it."""
    import shardkit
    from shardkit.executor import LocalExecutor

    with shardkit.connect(store, prefix=prefix, executor=LocalExecutor(workers=4)) as kit:
        table = sa.Table(
            os.environ["SHARDKIT_MAPPER_TABLE"], sa.MetaData(), autoload_with=kit.store.engine
        )
        kit.map(
            table,
            "mapper_workers:add_ten",
            key="k",
            transactional=True,
            page_size=500,
            on_complete="mapper_workers:record_completion",
            job=job,
        ).wait(timeout=300)


if __name__ == "__main__":
    main(*sys.argv[1:])
