"""A pre-fork server in miniature, for the metrics tests: run with
``$PROMETHEUS_MULTIPROC_DIR`` set, it opens a kit, forks ``WORKERS`` children that each
increment a sharded counter ``COUNT`` times and exit (as a server's workers do), and
marks each dead as gunicorn's ``child_exit`` hook would.

    python metrics_workers.py STORE CACHE PREFIX NAME WORKERS COUNT
"""

from __future__ import annotations

import os
import sys

import prometheus_client.multiprocess

import shardkit


def main() -> None:
    store, cache, prefix, name, workers, count = sys.argv[1:]
    kit = shardkit.connect(store, cache, prefix=prefix)
    children = []
    for _ in range(int(workers)):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                counter = kit.sharded(name)
                for _ in range(int(count)):
                    counter.incr()
                kit.close()
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    for pid in children:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"worker {pid} failed")
        prometheus_client.multiprocess.mark_process_dead(pid)
    kit.close()


if __name__ == "__main__":
    main()
