"""An application at work, for the real-Prometheus test: run with
``$PROMETHEUS_MULTIPROC_DIR`` set, it does known work on a timeline and logs, as JSON
Lines, what it did and when, so that every documented query can be checked against it.

    python metered_work.py STORE CACHE PREFIX NAME TABLE LOG LATE_STORE

- ``healthy`` seconds: paced writes of every kind (``RATE`` a second each; a buffered
  counter flushed every ``INTERVAL`` seconds, its flushes seen by a thread that polls
  the store), and a mapping job over TABLE on two workers whose ranges are held in
  flight together for ``HOLD`` seconds, and two of whose pages fail once each; beside
  them, a kit on LATE_STORE (a PostgreSQL of the test's own) falls behind (``Late``);
- then ``failing`` seconds, the same writes and known failures: increments refused by an
  overflowing counter, a kit whose cache server restarts under an id block (the block
  is lost) and then stops (its fallbacks), a job that fails, and the late kit catching
  up, after which LATE_STORE refuses writes and its flushes fail;
- then a last flush, and the totals.

Each log line is ``{"t": time, "event": ..., ...}``; ``counts`` lines give the applied
writes of each kind so far (every ``TICK`` seconds).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sqlalchemy as sa

import shardkit
from backends import numbered_table
from servers import RedisServer, running
from shardkit.executor import LocalExecutor

RATE = 40  # writes a second, of each kind
INTERVAL = 1.0  # the buffered counter's flush interval
HOLD = 4.0  # seconds two ranges of the job stay in flight together
FAILURES_A_SECOND = 20  # overflowing increments in the failing phase
TICK = 0.25
HEALTHY, FAILING = 64.0, 12.0
JOB_AT = 4.0  # the job starts after the first scrapes have seen the process
LAG_INTERVAL = 2.0  # the late kit's buffered counter's flush interval
LAG_EVERY = 0.5  # seconds between its increments
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


class Late:
    """A kit on a store of its own whose one executor worker a mapping job holds until
    ``release``: the flushes of its buffered counter, incremented every ``LAG_EVERY``
    seconds from when ``behind`` is set, fall behind (one waits, the later ones merged
    into it). Released, the job ends and that flush lands, late by the whole wait (logged
    as ``caught up``); then the store refuses writes (``default_transaction_read_only``,
    as a standby would) and the flushes of the increments made until ``stop`` fail."""

    def __init__(self, url: str, cache: str, prefix: str, name: str, log: Log) -> None:
        self.url, self.log = url, log
        self.kit = shardkit.connect(url, cache, prefix=prefix, executor=LocalExecutor(workers=1))
        self.counter = self.kit.buffered(f"{name}:lagging", interval=LAG_INTERVAL)
        self.count = 0  # increments applied
        self.seconds: list[float] = []  # their durations, until released
        self.behind = threading.Event()
        self.release = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        engine = sa.create_engine(self.url)
        entered = threading.Event()

        def hold(batch: Any) -> None:
            entered.set()
            self.release.wait()

        with numbered_table(engine, "held", 1) as table:
            job = self.kit.map(table, hold, key="id")
            assert entered.wait(60), "the held job never ran"
            since = time.time() // LAG_INTERVAL * LAG_INTERVAL  # of the flush that waits
            self._incr()
            self.behind.set()
            while not self.release.wait(LAG_EVERY):
                self._incr()
            job.wait(60)
            deadline = time.monotonic() + 60
            while self.counter.parts().stored != self.count:
                assert time.monotonic() < deadline, "the late flush never landed"
                time.sleep(0.01)
            self.log("caught up", lag=time.time() - since, increments=self.count)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("ALTER SYSTEM SET default_transaction_read_only = on"))
            conn.execute(sa.text("SELECT pg_reload_conf()"))
        deadline = time.monotonic() + 60
        while not self._refusing(engine):  # a new session has it: every one was told
            assert time.monotonic() < deadline, "the store never refused writes"
            time.sleep(0.01)
        engine.dispose()
        self.log("refusing writes")
        while not self.stop.is_set():
            self._incr()
            self.stop.wait(LAG_EVERY)

    def _incr(self) -> None:
        began = time.perf_counter()
        self.counter.incr()
        if not self.release.is_set():
            self.seconds.append(time.perf_counter() - began)
        self.count += 1

    def _refusing(self, engine: sa.Engine) -> bool:
        with engine.connect() as conn:
            return conn.execute(sa.text("SHOW default_transaction_read_only")).scalar() == "on"


def main() -> None:
    store, cache, prefix, name, table_name, log_path, late_store = sys.argv[1:]
    log = Log(log_path)
    kit = shardkit.connect(store, cache, prefix=prefix)
    jobs_kit = shardkit.connect(store, cache, prefix=prefix, executor=LocalExecutor(workers=2))
    late = Late(late_store, cache, prefix, name, log)
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
    began = time.perf_counter()
    big.incr(INT64_MAX)  # timed too: every write of the healthy phase is in its p99
    seconds["sharded"].append(time.perf_counter() - began)
    counts["sharded"] += 1

    def tally() -> dict[str, int]:
        """The writes applied so far, the late kit's among them."""
        return {**counts, "buffered": counts["buffered"] + late.count}

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

    with (
        ThreadPoolExecutor(1) as behind,
        running(RedisServer) as fragile_server,
    ):
        lagging = behind.submit(late.run)
        try:
            assert late.behind.wait(60), "the late kit never fell behind"
            watcher = threading.Thread(target=watch_flushes)
            watcher.start()
            started = time.time()
            log("started", interval=INTERVAL)
            job_fn = Job(log, fail_after=started + JOB_AT + 3)
            job = None
            failed_writes = 0
            fragile_kit = None
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
                    late.release.set()
                    fragile_kit = shardkit.connect(
                        store, fragile_server.url, prefix=prefix, adjust_delay=0
                    )
                    fragile = fragile_kit.sharded(f"{name}:fragile")
                    fragile.incr()
                    # One id a round trip: the next finds the lost key at once.
                    fragile_ids = fragile_kit.ids(f"{name}:fragile-ids", block=100, sub_block=1)
                    taken = [fragile_ids.next()]
                    fragile_server.restart()  # without persistence: every key is lost
                    taken.append(fragile_ids.next())  # its block's key gone: a new block
                    log("lost block", ids=taken)
                    counts["sharded"] += 1
                    counts["ids"] += len(taken)
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
                every = max(1, (RATE * len(kinds)) // FAILURES_A_SECOND)
                if now >= failing_at and turn % every == 0:
                    try:
                        big.incr()
                    except shardkit.CounterOverflow:
                        failed_writes += 1
                if now - last_tick >= TICK:
                    last_tick = now
                    log("counts", counts=tally(), failed=failed_writes, lagging=late.count)
                due += step
                time.sleep(max(0.0, due - time.time()))
        finally:
            late.release.set()
            late.stop.set()
        lagging.result()
        log("counts", counts=tally(), failed=failed_writes, lagging=late.count)
        assert fragile_kit is not None
        ids_reserved = ids.reserved() + fragile_ids.reserved()
        fragile_kit.close()
    late.kit.close()  # its last flush fails too
    assert job is not None
    job.wait(120)
    stop.set()
    watcher.join()
    hits.flush()
    status = job.status()
    log(
        "done",
        counts=tally(),
        failed=failed_writes,
        seconds={**seconds, "buffered": seconds["buffered"] + late.seconds},
        flushes=flushes,
        job={
            "id": job.id,
            "state": status.state,
            "rows": status.rows,
            "estimate": status.estimate,
            "failures": status.failures,
        },
        ids_taken=counts["ids"],
        ids_reserved=ids_reserved,
    )
    kit.close()
    jobs_kit.close()


if __name__ == "__main__":
    main()
