"""The Celery executor, end to end: real ``celery worker`` processes (importing
``celery_app``) run the flushes a kit in this process schedules, through Redis and
RabbitMQ brokers, and workers SIGKILLed in the middle of a flush neither lose nor double
a count."""

from __future__ import annotations

import json
import logging
import random
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import prometheus_client
import prometheus_client.multiprocess
import pytest
import redis
from celery import Celery

import shardkit
from backends import (
    CELERY_BROKERS,
    NEVER,
    PREFIX,
    run_together,
    wait_for,
)
from celery_app import Config, build
from celery_workers import Workers, config_for
from shardkit.contrib.celery import CeleryExecutor

WRITERS = 3  # kits in this process, each with its own app: like three web processes
INTERVAL = 0.5  # seconds between a buffered counter's flushes
DEADLINE = 15.0  # seconds anything else awaited may take


def entries(records: redis.Redis, config: Config, part: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in records.lrange(config.key(part), 0, -1)]


class RecordingExecutor(CeleryExecutor):
    """A Celery executor that remembers every submission and whether it was made."""

    def __init__(self, app: Celery, *, queue: str | None = None) -> None:
        super().__init__(app, queue=queue)
        self.submissions: list[tuple[str, str | None, bool]] = []

    def submit(self, task: str, args: Mapping[str, Any], **options: Any) -> bool:
        made = super().submit(task, args, **options)
        self.submissions.append((task, options.get("dedupe"), made))
        return made


@pytest.fixture(params=list(CELERY_BROKERS))
def config(request: pytest.FixtureRequest, sqlite_url: str) -> Config:
    return config_for(request.param, sqlite_url, "celery")


@pytest.fixture
def records(config: Config) -> Iterator[redis.Redis]:
    """A client of the Redis where the workers keep their records (dropped at the end)."""
    client = redis.Redis.from_url(config.cache)
    yield client
    keys = list(client.scan_iter(match=config.key("*")))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def workers(config: Config, records: redis.Redis, tmp_path: Path) -> Iterator[Workers]:
    started = Workers(config, records, tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture
def kits(config: Config) -> Iterator[list[shardkit.Kit]]:
    """WRITERS kits of this process on the workers' store, cache and broker."""
    built = [build(config, RecordingExecutor) for _ in range(WRITERS)]
    yield [kit for _, kit in built]
    for app, kit in built:
        kit.close()
        app.close()


def _ran(records: redis.Redis, config: Config, event: str, task: str) -> list[dict[str, Any]]:
    return [
        run
        for run in entries(records, config, "runs")
        if run["event"] == event and run["task"] == f"shardkit.{task}"
    ]


@pytest.mark.slow
def test_a_real_worker_runs_the_scheduled_flushes(
    config: Config,
    records: redis.Redis,
    workers: Workers,
    kits: list[shardkit.Kit],
    name: str,
    tmp_path: Path,
) -> None:
    # The worker's pool records metrics as a pre-fork server's workers do.
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    workers.start(pool="prefork", env={"PROMETHEUS_MULTIPROC_DIR": str(metrics)})
    counters = [kit.buffered(name, interval=INTERVAL) for kit in kits]
    sums = [0] * WRITERS
    counts = [0] * WRITERS
    spans: list[list[tuple[float, float]]] = [[] for _ in range(WRITERS)]  # each increment's

    def write(slot: int) -> None:
        rng = random.Random()
        until = time.time() + 5 * INTERVAL  # from the thread's start: a late one writes as long
        while time.time() < until or counts[slot] <= 10:  # several intervals, 11 writes
            delta = rng.choice((-1, 1)) * rng.randint(1, 1000)
            before = time.time()
            counters[slot].incr(delta)
            spans[slot].append((before, time.time()))
            sums[slot] += delta
            counts[slot] += 1

    run_together(WRITERS, write)
    acked = sum(sums)
    # The worker alone moves everything into the store: this process never flushes.
    wait_for(
        lambda: counters[0].parts() == (acked, 0),
        f"the store to hold all {acked}",
        DEADLINE,
        lambda: f"(now {counters[0].parts()}){workers.status()}",
    )

    submissions = [entry for kit in kits for entry in kit.executor.submissions]  # type: ignore[attr-defined]
    assert {task for task, _, _ in submissions} == {"flush"}
    made = [dedupe for _, dedupe, was_made in submissions if was_made]
    # Each kit submitted one flush per interval it wrote in (many increments, one
    # submission); of the kits' submissions for one interval, one was made.
    assert len(made) == len(set(made)) >= 5
    assert {dedupe for _, dedupe, _ in submissions} == set(made)
    assert len(submissions) > len(made)
    for kit, times in zip(kits, spans, strict=True):
        mine = kit.executor.submissions  # type: ignore[attr-defined]
        assert len(mine) <= len(made)
        # One submission per interval the kit wrote in, by its first increment there.
        # Which interval an increment falls in is read inside the call: the test knows
        # it between its clock readings around the call, exactly unless the call spans
        # an interval's end (then either interval may be the one).
        numbers = [int(str(dedupe).rsplit(":", 1)[1]) for _, dedupe, _ in mine]
        known = {int(a // INTERVAL) for a, b in times if int(a // INTERVAL) == int(b // INTERVAL)}
        possible = {n for a, b in times for n in range(int(a // INTERVAL), int(b // INTERVAL) + 1)}
        assert len(numbers) == len(set(numbers))
        assert known <= set(numbers) <= possible

    # The worker ran each submitted flush once, with its JSON arguments (the worker
    # accepts JSON only), due at the end of its interval (its eta).
    wait_for(
        lambda: len(_ran(records, config, "end", "flush")) >= len(made),
        "every flush to end",
        DEADLINE,
        workers.status,
    )
    ended = _ran(records, config, "end", "flush")
    started = _ran(records, config, "start", "flush")
    assert len(ended) == len(started) == len(made), workers.status()
    assert {run["state"] for run in ended} == {"SUCCESS"}
    assert all(run["kwargs"]["name"] == name for run in started)
    intervals = set()
    for run in started:
        assert run["eta"] is not None, "a flush was submitted without its eta"
        eta = datetime.fromisoformat(run["eta"]).timestamp()
        end_of_interval = round(eta / INTERVAL) * INTERVAL
        assert 0 <= eta - end_of_interval < 0.1  # due from the call, not from the broker
        assert run["at"] >= eta - 0.01  # not run before it was due
        intervals.add(round(eta / INTERVAL) - 1)
    assert intervals == {int(dedupe.rsplit(":", 1)[1]) for dedupe in made}
    assert counters[1].parts() == (acked, 0)

    # What the pool recorded: every flush it ran, and the lag of each that moved.
    recorded = prometheus_client.CollectorRegistry()
    prometheus_client.multiprocess.MultiProcessCollector(recorded, path=str(metrics))

    def value(name: str, **labels: str) -> float:
        return recorded.get_sample_value(name, labels) or 0.0

    moved = value("shardkit_flushes_total", outcome="moved")
    assert moved + value("shardkit_flushes_total", outcome="idle") == len(made)
    assert moved >= 1
    assert value("shardkit_flush_lag_seconds_count", interval=f"{INTERVAL:g}") == moved
    assert value("shardkit_write_seconds_count", kind="buffered", outcome="applied") == 0


@pytest.mark.slow
def test_celery_beat_runs_flush_all_on_the_documented_schedule(
    config: Config, records: redis.Redis, workers: Workers, kits: list[shardkit.Kit], name: str
) -> None:
    """A real ``celery beat`` on the Celery page's schedule sends ``shardkit.flush_all``; a
    worker runs it, and it moves what a counter flushed hourly has pending."""
    counter = kits[0].buffered(name, interval=NEVER)  # its own flush is 30 days away at most
    for _ in range(7):
        counter.incr(3)
    assert counter.parts() == (0, 21)
    workers.start()
    workers.beat()
    wait_for(
        lambda: counter.parts() == (21, 0),
        "flush_all from beat to move the pending increments",
        DEADLINE,
        workers.status,
    )
    # The run is recorded as ended after the task returns, which is after it moved them.
    wait_for(
        lambda: bool(_ran(records, config, "end", "flush_all")),
        "the flush_all run to end",
        DEADLINE,
        workers.status,
    )
    ended = _ran(records, config, "end", "flush_all")
    assert {run["state"] for run in ended} == {"SUCCESS"}
    assert _ran(records, config, "start", "flush") == []  # not the counter's own flush


@pytest.mark.slow
def test_workers_killed_mid_flush_lose_and_double_nothing(
    config: Config, records: redis.Redis, workers: Workers, kits: list[shardkit.Kit], name: str
) -> None:
    child_kills, worker_kills = 2, 2
    counters = [kit.buffered(name, interval=INTERVAL / 2) for kit in kits]
    sums = [0] * WRITERS
    stop = threading.Event()
    errors: list[BaseException] = []

    def write(slot: int) -> None:
        rng = random.Random()
        try:
            while not stop.is_set():
                delta = rng.choice((-1, 1)) * rng.randint(1, 1000)
                counters[slot].incr(delta)
                sums[slot] += delta
                time.sleep(0.001)  # leave the two cores some room for the workers
        except BaseException as exc:
            errors.append(exc)

    def kills(mode: str) -> list[dict[str, Any]]:
        return [kill for kill in entries(records, config, "kills") if kill["mode"] == mode]

    def ran_again(killed: list[dict[str, Any]]) -> bool:
        """Whether every killed task was delivered again and ran to its end."""
        ended = {run["id"] for run in _ran(records, config, "end", "flush") if run["redelivered"]}
        return {kill["id"] for kill in killed} <= ended

    writers = [threading.Thread(target=write, args=(slot,)) for slot in range(WRITERS)]
    try:
        for thread in writers:
            thread.start()
        # Whole workers killed in the middle of a flush, a fresh one started each time:
        # the broker gives the unacknowledged task to another worker (RabbitMQ at once,
        # Redis after the visibility timeout, which elapses during the next phase).
        for _ in range(worker_kills):
            killed = workers.start(pool="prefork", fault=f"worker:{worker_kills}")
            wait_for(
                lambda: killed.poll() is not None,  # noqa: B023
                "a worker to be killed",
                DEADLINE,
                workers.status,
            )
            assert killed.returncode == -signal.SIGKILL, workers.status()

        # A worker whose pool children die in the middle of flushes: the master lives
        # on, requeues each task (acks_late, reject_on_worker_lost), forks a new child,
        # which runs it again, to its end (the master may take its 5 s maintenance tick
        # to see that a child died).
        survivor = workers.start(pool="prefork", fault=f"child:{child_kills}")
        wait_for(
            lambda: len(kills("child")) >= child_kills and ran_again(kills("child")),
            "pool children to be killed, and their tasks to be run again",
            2 * DEADLINE,
            workers.status,
        )
        assert survivor.poll() is None, workers.status()
        workers.stop(survivor)
    finally:
        stop.set()
        for thread in writers:
            if thread.is_alive():
                thread.join()
    assert not errors, errors
    acked = sum(sums)

    # A healthy worker: the tasks of the killed workers come back and run to their end.
    workers.start(pool="prefork")
    assert None not in {kill["id"] for kill in entries(records, config, "kills")}
    wait_for(
        lambda: ran_again(kills("worker")),
        "the killed workers' tasks to be delivered again and end",
        DEADLINE,
        workers.status,
    )

    assert kits[0].executor.submit("flush_all", {})
    wait_for(
        lambda: bool(_ran(records, config, "end", "flush_all")),
        "flush_all to end",
        DEADLINE,
        workers.status,
    )
    assert counters[0].parts() == (acked, 0), workers.status()

    child, whole = kills("child"), kills("worker")
    assert [kill["number"] for kill in child] == list(range(1, child_kills + 1))
    assert [kill["number"] for kill in whole] == list(range(1, worker_kills + 1))
    both = {"before", "after"}
    assert {kill["when"] for kill in child} == {kill["when"] for kill in whole} == both
    # Whole workers died, one each; then pool children of the survivor, not the survivor.
    assert [kill["master"] for kill in whole] == [w.pid for w in workers.started[:worker_kills]]
    assert {kill["master"] for kill in child} == {survivor.pid}
    assert len({kill["pid"] for kill in child} - {survivor.pid}) == child_kills

    workers.stop_all()  # nothing runs any more: the total stays exact
    assert kits[1].get(name).parts() == (acked, 0)


@pytest.mark.parametrize(
    "broker",
    ["redis://:s3cret@127.0.0.1:1/0", "amqp://guest:s3cret@127.0.0.1:1//"],
    ids=["redis", "rabbitmq"],
)
def test_unknown_tasks_and_an_unreachable_broker(
    broker: str, sqlite_url: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = Celery("unreachable", broker=broker, set_as_current=False)
    executor = CeleryExecutor(app)
    with pytest.raises(shardkit.ConfigurationError, match="no task named 'flush'"):
        executor.submit("flush", {"name": name})  # bound to no kit yet
    kit = shardkit.connect(sqlite_url, "memory://", prefix=PREFIX, executor=executor)
    try:
        with pytest.raises(shardkit.ConfigurationError, match="no task named 'nope'"):
            executor.submit("nope", {})
        for _ in range(2):  # a failed submission drops its claim: the next one tries again
            with pytest.raises(shardkit.BackendError) as error:
                executor.submit("flush_all", {}, dedupe=f"{name}:all")
            assert "s3cret" not in str(error.value)
            assert "could not submit 'flush_all'" in str(error.value)

        # An increment counts though its flush cannot be scheduled (logged, no password).
        counter = kit.buffered(name, interval=NEVER)
        with caplog.at_level(logging.WARNING, logger="shardkit"):
            counter.incr(5)
        assert counter.parts() == (0, 5)
        assert "could not schedule a flush" in caplog.text
        assert "s3cret" not in caplog.text
    finally:
        kit.close()
        app.close()
