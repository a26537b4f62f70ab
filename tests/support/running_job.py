"""A process with one range of a mapping job in flight, for the metrics tests: run with
``$PROMETHEUS_MULTIPROC_DIR`` set, it starts a job over TABLE on one worker whose ``fn``
never returns, prints the job's id once the range runs, and waits to be killed. Given
FINISHED, it first runs that many jobs over TABLE to completion and prints their ids on
a line of their own.

    python running_job.py STORE PREFIX TABLE [FINISHED]
"""

from __future__ import annotations

import sys
import threading

import sqlalchemy as sa

import shardkit
from shardkit.executor import LocalExecutor


def main() -> None:
    store, prefix, table, *finished = sys.argv[1:]
    kit = shardkit.connect(store, prefix=prefix, executor=LocalExecutor(workers=1))
    entered, never = threading.Event(), threading.Event()
    source = sa.Table(table, sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    if finished:
        jobs = [kit.map(source, lambda batch: None, key="id") for _ in range(int(finished[0]))]
        print(" ".join(job.wait(60).id for job in jobs), flush=True)

    def visit(batch: object) -> None:
        entered.set()
        never.wait()

    job = kit.map(source, visit, key="id")
    if not entered.wait(60):
        sys.exit("the job's range never started")
    print(job.id, flush=True)
    never.wait()


if __name__ == "__main__":
    main()
