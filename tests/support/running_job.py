"""A process with one range of a mapping job in flight, for the metrics tests: run with
``$PROMETHEUS_MULTIPROC_DIR`` set, it starts a job over TABLE on one worker whose ``fn``
never returns, prints the job's id once the range runs, and waits to be killed.

    python running_job.py STORE PREFIX TABLE
"""

from __future__ import annotations

import sys
import threading

import sqlalchemy as sa

import shardkit
from shardkit.executor import LocalExecutor


def main() -> None:
    store, prefix, table = sys.argv[1:]
    kit = shardkit.connect(store, prefix=prefix, executor=LocalExecutor(workers=1))
    entered, never = threading.Event(), threading.Event()

    def visit(batch: object) -> None:
        entered.set()
        never.wait()

    source = sa.Table(table, sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    job = kit.map(source, visit, key="id")
    if not entered.wait(60):
        sys.exit("the job's range never started")
    print(job.id, flush=True)
    never.wait()


if __name__ == "__main__":
    main()
