"""An application at work, for the real-Prometheus test: run with
``$PROMETHEUS_MULTIPROC_DIR`` set, it does known work on a timeline and logs, as JSON
Lines, what it did and when, so that every documented query can be checked against it.

    python metered_work.py STORE CACHE PREFIX NAME TABLE LOG

- ``healthy`` seconds: paced writes of every kind (``RATE`` a second each; a buffered
  counter flushed every ``INTERVAL`` seconds, its flushes seen by a thread that polls
  the store), and a mapping job over TABLE on two workers whose ranges are held in
  flight together for ``HOLD`` seconds, and two of whose pages fail once each;
- then ``failing`` seconds, the same writes and known failures: increments refused by an
  overflowing counter, a kit whose cache server has stopped (its fallbacks), a job that
  fails;
- then a last flush, and the totals.

Each log line is ``{"t": time, "event": ..., ...}``; ``counts`` lines give the applied
writes of each kind so far (every ``TICK`` seconds).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import sqlalchemy as sa

import shardkit
from servers import RedisServer, running
from shardkit.executor import LocalExecutor

RATE = 40  # writes a second, of each kind
INTERVAL = 1.0  # the buffered counter's flush interval
HOLD = 4.0  # seconds two ranges of the job stay in flight together
FAILURES_A_SECOND = 20  # overflowing increments in the failing phase
TICK = 0.25
HEALTHY, FAILING = 64.0, 12.0
JOB_AT = 4.0  # the job starts after the first scrapes have seen the process
INT64_MAX = 2**63 - 1


class Log:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        with self._lock:
            self._file.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")
            self._file.flush()


class Job:
    """The mapping job's ``fn``: 50 ms a page; the first two ranges to be in flight
    together are held there; the first two pages visited after ``fail_after`` fail once."""

    def __init__(self, log: Log, fail_after: float) -> None:
        self.log = log
        self.fail_after = fail_after
        self.lock = threading.Lock()
        self.inside = 0
        self.held_until: float | None = None
        self.failed: set[Any] = set()
        self.rows = 0

    def __call__(self, batch: Any) -> None:
        first = batch.records[0].id
        with self.lock:
            self.inside += 1
            if self.inside == 2 and self.held_until is None:
                self.held_until = time.time() + HOLD
                self.log("held", until=self.held_until)
            fail = (
                time.time() > self.fail_after and len(self.failed) < 2 and first not in self.failed
            )
            if fail:
                self.failed.add(first)
        try:
            time.sleep(0.05)
            while self.held_until is not None and time.time() < self.held_until:
                time.sleep(0.01)
            if fail:
                self.log("page failed", key=first)
                raise RuntimeError(f"a known failure of the page from {first}")
        finally:
            with self.lock:
                self.inside -= 1
        with self.lock:
            self.rows += len(batch.records)
            self.log("rows", rows=self.rows)


def failing_fn(batch: Any) -> None:
    raise RuntimeError("a job made to fail")


def main() -> None:
    store, cache, prefix, name, table_name, log_path = sys.argv[1:]
    log = Log(log_path)
    kit = shardkit.connect(store, cache, prefix=prefix)
    jobs_kit = shardkit.connect(store, cache, prefix=prefix, executor=LocalExecutor(workers=2))
    table = sa.Table(table_name, sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    views = kit.sharded(f"{name}:views")
    hits = kit.buffered(f"{name}:hits", interval=INTERVAL)
    seq = kit.monotonic(f"{name}:seq")
    ids = kit.ids(f"{name}:ids", block=100)
    big = kit.sharded(f"{name}:big")
    writes = {
        "sharded": views.incr,
        "buffered": hits.incr,
        "monotonic": seq.incr,
        "ids": ids.next,
    }
    counts = dict.fromkeys(writes, 0)
    seconds: dict[str, list[float]] = {kind: [] for kind in writes}
    big.incr(INT64_MAX)
    counts["sharded"] += 1

    stop = threading.Event()
    flushes: list[float] = []

    def watch_flushes() -> None:
        stored = 0
        while not stop.is_set():
            now_stored = hits.parts().stored
            if now_stored != stored:
                stored = now_stored
                flushes.append(time.time())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch_flushes)
    watcher.start()
    started = time.time()
    log("started", interval=INTERVAL)
    job_fn = Job(log, fail_after=started + JOB_AT + 3)
    job = None
    failed_writes = 0
    fragile_kit = None
    with running(RedisServer) as fragile_server:
        step = 1 / (RATE * len(writes))
        due = started
        last_tick = 0.0
        kinds = list(writes)
        turn = 0
        failing_at = started + HEALTHY
        while (now := time.time()) < failing_at + FAILING:
            if job is None and now >= started + JOB_AT:
                job = jobs_kit.map(table, job_fn, key="id", page_size=50, fanout=4)
                log("job", id=job.id)
            if now >= failing_at and fragile_kit is None:
                log("failing")
                fragile_kit = shardkit.connect(
                    store, fragile_server.url, prefix=prefix, adjust_delay=0
                )
                fragile = fragile_kit.sharded(f"{name}:fragile")
                fragile.incr()
                counts["sharded"] += 1
                fragile_server.stop()
                broken = jobs_kit.map(table, failing_fn, key="id", retries=0)
                log("broken job", id=broken.id)
            kind = kinds[turn % len(kinds)]
            turn += 1
            began = time.perf_counter()
            writes[kind]()
            if now < failing_at:
                seconds[kind].append(time.perf_counter() - began)
            counts[kind] += 1
            if fragile_kit is not None and turn % (RATE // 5) == 0:
                fragile.incr()
                fragile.value()
                counts["sharded"] += 1
            if now >= failing_at and turn % max(1, (RATE * len(kinds)) // FAILURES_A_SECOND) == 0:
                try:
                    big.incr()
                except shardkit.CounterOverflow:
                    failed_writes += 1
            if now - last_tick >= TICK:
                last_tick = now
                log("counts", counts=counts, failed=failed_writes)
            due += step
            time.sleep(max(0.0, due - time.time()))
        log("counts", counts=counts, failed=failed_writes)
        if fragile_kit is not None:
            fragile_kit.close()
    assert job is not None
    job.wait(120)
    stop.set()
    watcher.join()
    hits.flush()
    status = job.status()
    log(
        "done",
        counts=counts,
        failed=failed_writes,
        seconds=seconds,
        flushes=flushes,
        job={
            "id": job.id,
            "state": status.state,
            "rows": status.rows,
            "estimate": status.estimate,
            "failures": status.failures,
        },
        ids_taken=counts["ids"],
    )
    kit.close()
    jobs_kit.close()


if __name__ == "__main__":
    main()
