"""Metrics and the dashboard's API: the Prometheus endpoint scraped over real HTTP while
counters and a job do known work (values move by exactly that work), the summing of a
pre-fork server's processes, a cache outage counted, and the dashboard's JSON, tokens
and bad input."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import uvicorn
from sqlalchemy.engine import make_url

import shardkit
from backends import (
    CACHE_URLS,
    CI,
    NEVER,
    PREFIX,
    ROOT,
    SUPPORT,
    Samples,
    documented_table,
    free_port,
    numbered_table,
    parse_samples,
    require,
    sample,
    scrape,
    store_url_for,
    wait_for,
)
from servers import PostgresServer, RedisServer, running, unavailable
from shardkit import metrics
from shardkit.monitor.asgi import dashboard
from shardkit.monitor.exporter import exposition, registry, serve
from shardkit.store.sql import SqlStore

TOKEN = "a-token-long-enough"
INT64_MAX = 2**63 - 1

# The embedded default, and what the deploying page recommends for production.
SETUPS = {"sqlite-memory": ("sqlite", "memory"), "postgres-redis": ("postgres", "redis")}


@pytest.fixture(params=list(SETUPS))
def kit(request: pytest.FixtureRequest, sqlite_url: str) -> Iterator[shardkit.Kit]:
    store_kind, cache_kind = SETUPS[request.param]
    store_url = store_url_for(store_kind, sqlite_url)
    with shardkit.connect(store_url, CACHE_URLS[cache_kind], prefix=PREFIX) as the_kit:
        yield the_kit


@pytest.fixture
def table(kit: shardkit.Kit) -> Iterator[sa.Table]:
    """A source table of 250 rows in the store's database."""
    assert isinstance(kit.store, SqlStore)
    with numbered_table(kit.store.engine, "items", 250) as made:
        yield made
        kit.executor.close()  # drained: no task still reads the table as it is dropped


def change(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


def test_metrics_over_http_move_exactly_with_the_work(kit: shardkit.Kit, table: sa.Table) -> None:
    names = {kind: f"test:{kind}:{uuid.uuid4().hex}" for kind in ("sharded", "buffered")}
    server = serve(kit, free_port(), counters=list(names.values()))
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        before = scrape(url)
        views = kit.sharded(names["sharded"])
        for _ in range(10):
            views.incr()
        assert views.incr(key="k")
        assert not views.incr(key="k")
        big = kit.sharded(f"test:big:{uuid.uuid4().hex}")
        big.incr(INT64_MAX)
        with pytest.raises(shardkit.CounterOverflow):
            big.incr()
        hits = kit.buffered(names["buffered"], interval=NEVER)
        for _ in range(7):
            hits.incr()
        middle = scrape(url)
        hits.flush()
        kit.ids(f"test:ids:{uuid.uuid4().hex}", block=10).take(25)
        kit.monotonic(f"test:seq:{uuid.uuid4().hex}").incr(4)
        job = kit.map(table, lambda batch: None, key="id", page_size=20, fanout=4)
        job.wait(30)
        after = scrape(url)
    finally:
        server.close()

    def wrote(kind: str, outcome: str) -> float:
        return change(before, after, "shardkit_write_seconds_count", kind=kind, outcome=outcome)

    assert wrote("sharded", "applied") == 12
    assert wrote("sharded", "repeated") == 1
    assert wrote("sharded", "failed") == 1
    assert wrote("buffered", "applied") == 7
    assert wrote("ids", "applied") == 25
    assert wrote("monotonic", "applied") == 1
    # Each write's duration; written one by one (one caller), each in a batch of one.
    assert (
        change(before, after, "shardkit_write_seconds_sum", kind="sharded", outcome="applied") > 0
    )
    assert change(before, after, "shardkit_combined_writes_sum", kind="sharded") == 14
    assert change(before, after, "shardkit_combined_writes_count", kind="sharded") == 14
    # Three blocks of ten for 25 ids, and with a shared cache the next, published ahead.
    blocks = 4 if kit.cache.shared else 3
    assert change(before, after, "shardkit_id_blocks_total") == blocks
    assert change(before, after, "shardkit_ids_reserved_total") == blocks * 10
    assert change(before, after, "shardkit_flushes_total", outcome="moved") == 1
    # Read at scrape time from the store and cache: the listed counters' values, the
    # pending increments (before and after the flush), the job's progress.
    assert sample(after, "shardkit_value", counter=names["sharded"], kind="sharded") == 11
    assert sample(middle, "shardkit_buffered_pending", counter=names["buffered"]) == 7
    assert sample(after, "shardkit_buffered_pending", counter=names["buffered"]) == 0
    assert sample(after, "shardkit_value", counter=names["buffered"], kind="buffered") == 7
    assert change(before, middle, "shardkit_buffered_pending_all") >= 7
    status = job.status()
    assert sample(after, "shardkit_job_rows_total", job_id=job.id) == status.rows == 250
    assert sample(after, "shardkit_job_pages_total", job_id=job.id) == status.pages
    assert sample(after, "shardkit_job_ranges", job_id=job.id, state="pending") == 0
    assert sample(after, "shardkit_job_ranges", job_id=job.id, state="done") == status.done > 1
    assert sample(after, "shardkit_job_state", job_id=job.id, state="complete") == 1
    # No ranges running: no series (a process running a job a minute keeps none per job).
    assert ("shardkit_job_ranges_running", frozenset({("job_id", job.id)})) not in after
    assert sample(after, "shardkit_monitor_read_ok") == 1


def test_a_scheduled_flush_reports_its_lag(kit: shardkit.Kit, name: str) -> None:
    server = serve(kit, free_port())
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        before = scrape(url)
        hits = kit.buffered(name, interval=0.2)
        declared = scrape(url)
        began = time.time() // 0.2 * 0.2  # the start of the interval the increment falls in
        hits.incr(3)
        wait_for(lambda: hits.parts().stored == 3, "the scheduled flush", 10)
        # Its lag is observed when the flush task returns, after the store has the sum.
        wait_for(
            lambda: (
                change(before, scrape(url), "shardkit_flush_lag_seconds_count", interval="0.2") > 0
            ),
            "the flush's lag to be observed",
            10,
        )
        flushed_by = time.time()
        after = scrape(url)
    finally:
        server.close()
    # The counter's interval has its series from the counter's making, at 0.
    assert ("shardkit_flush_lag_seconds_count", frozenset({("interval", "0.2")})) in declared
    assert change(before, after, "shardkit_flush_lag_seconds_count", interval="0.2") == 1
    # From the start of the interval to the flush: at least the interval (a flush runs
    # once its interval has ended), at most what passed until the flush was seen.
    lag = change(before, after, "shardkit_flush_lag_seconds_sum", interval="0.2")
    assert 0.2 <= lag <= flushed_by - began
    # The buckets are the interval's multiples, dense just above it: 0.2, 0.202, 0.204,
    # 0.21, 0.22, then 10 % apart up to three intervals.
    bounds = sorted(
        float(dict(labels)["le"])
        for (sample_name, labels) in after
        if sample_name == "shardkit_flush_lag_seconds_bucket" and dict(labels)["interval"] == "0.2"
    )
    assert bounds[1:6] == pytest.approx([0.2, 0.202, 0.204, 0.21, 0.22])
    dense = [bound for bound in bounds if 0.2 <= bound <= 3 * 0.2 * 1.1]
    assert all(high / low < 1.1001 for low, high in itertools.pairwise(dense))
    assert dense[-1] >= 3 * 0.2
    assert bounds[-1] == float("inf")


def test_a_cache_outage_is_ridden_out_and_counted(sqlite_url: str, name: str) -> None:
    """A Redis server of the test's own stops: sharded writes and reads go on from the
    store, each kind of call that fell back is counted, and a scrape, which reads what is
    pending in buffered counters from the cache, says that its read failed."""
    with running(RedisServer) as redis_server:
        kit = shardkit.connect(sqlite_url, redis_server.url, prefix=PREFIX, adjust_delay=0)
        collected = serve(kit, free_port())
        url = f"http://127.0.0.1:{collected.port}/metrics"
        try:
            counter = kit.sharded(name)
            counter.incr(5)
            kit.buffered(f"{name}:buffered").incr(2)
            before = scrape(url)
            redis_server.stop()
            counter.incr(5)
            assert counter.value() == 10
            after = scrape(url)
        finally:
            collected.close()
            kit.close()
    assert sample(before, "shardkit_monitor_read_ok") == 1
    for action in ("adjusting cached values", "reading a cached value", "caching a value"):
        assert change(before, after, "shardkit_failures_ridden_out_total", action=action) >= 1
    assert (
        change(before, after, "shardkit_write_seconds_count", kind="sharded", outcome="applied")
        == 1
    )
    assert sample(after, "shardkit_monitor_read_ok") == 0


def test_a_scrape_serves_the_last_reading_while_the_store_is_silent(name: str) -> None:
    """A store that stops answering (its processes stopped: its connections open, its
    host acknowledging, nothing replying, as mid-failover) holds the scrape's read, not
    the scrape: after its timeout the scrape serves the last reading, its age, and
    ``read_ok`` 0; the next scrape waits for the read in flight instead of beginning
    another; once the store answers, scrapes read afresh."""
    with running(PostgresServer) as server, shardkit.connect(server.url, prefix=PREFIX) as kit:
        kit.sharded(name).incr(4)
        collected = registry(kit, [name], timeout=0.5)

        def read() -> Samples:
            return parse_samples(exposition(collected, None)[0].decode())

        def read_afresh() -> Samples:
            """A scrape that served its own read (a loaded machine's may be late)."""
            got: list[Samples] = []

            def own() -> bool:
                got.append(read())
                return sample(got[-1], "shardkit_monitor_read_ok") == 1

            wait_for(own, "a scrape's own read", 60)
            return got[-1]

        def reads() -> list[threading.Thread]:
            return [t for t in threading.enumerate() if t.name == "shardkit-metrics-read"]

        before = read_afresh()
        for thread in reads():  # its read has ended: its thread ends
            thread.join(60)
        # The store answers again before the scraper is awaited, whatever happened.
        with concurrent.futures.ThreadPoolExecutor(1) as scraper, server.silent():
            late = [scraper.submit(read) for _ in range(2)]
            # Each within its timeout (the deadline only detects a scrape held by the
            # store, which stays silent until the block exits).
            silent = [scrape.result(timeout=60) for scrape in late]
            assert len(reads()) == 1  # the read begun by the first, still waiting
        kit.sharded(name).incr(1)
        read_afresh()  # the read begun in the silence, perhaps
        after = read_afresh()
    assert sample(before, "shardkit_monitor_read_ok") == 1
    assert sample(before, "shardkit_value", counter=name, kind="sharded") == 4
    for got in silent:
        assert sample(got, "shardkit_monitor_read_ok") == 0
        assert sample(got, "shardkit_value", counter=name, kind="sharded") == 4
        # At least the wait for the read that did not come, past the one served.
        age = sample(got, "shardkit_monitor_read_age_seconds")
        assert age >= 0.5 + sample(before, "shardkit_monitor_read_age_seconds")
    assert sample(silent[1], "shardkit_monitor_read_age_seconds") >= 1.0  # two waits
    assert sample(after, "shardkit_value", counter=name, kind="sharded") == 5


@pytest.fixture
def multiprocess_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """``tmp_path`` as ``$PROMETHEUS_MULTIPROC_DIR`` here, for the test's exporter, and
    the environment of the processes it starts, which record there (outside Django)."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    env = {**os.environ}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


@pytest.mark.slow
def test_a_prefork_servers_processes_are_summed(sqlite_url: str, name: str, tmp_path: Path) -> None:
    """Under $PROMETHEUS_MULTIPROC_DIR, forked workers' writes are summed by the
    ``shardkit metrics`` endpoint, which itself wrote nothing."""
    store, cache = store_url_for("postgres", sqlite_url), CACHE_URLS["redis"]
    require(cache)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    workers = [sys.executable, str(SUPPORT / "metrics_workers.py"), store, cache, PREFIX, name]
    subprocess.run([*workers, "3", "40"], env=env, check=True, timeout=120)
    port = free_port()
    command = [sys.executable, "-m", "shardkit", "--store", store, "--cache", cache]
    command += ["--prefix", PREFIX, "metrics", "--port", str(port), "--counter", name]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as served:
        try:
            assert served.stdout is not None
            assert "serving metrics on" in served.stdout.readline()
            got = scrape(f"http://127.0.0.1:{port}/metrics")
        finally:
            served.terminate()
            served.wait(10)
    assert sample(got, "shardkit_write_seconds_count", kind="sharded", outcome="applied") == 120
    assert sample(got, "shardkit_value", counter=name, kind="sharded") == 120


def test_the_live_gauges_of_killed_processes_leave_the_sum(
    sqlite_url: str, tmp_path: Path, multiprocess_env: dict[str, str]
) -> None:
    """Two processes each visit a range of a job of their own; one is SIGKILLed (no
    ``mark_process_dead``, not reaped): once it has ended its range is no longer running,
    the survivor's still is."""
    env = multiprocess_env
    engine = sa.create_engine(sqlite_url)
    with contextlib.ExitStack() as stack:
        table = stack.enter_context(numbered_table(engine, "live", 50))
        jobs: list[str] = []
        processes: list[subprocess.Popen[str]] = []
        for _ in range(2):
            command = [sys.executable, str(SUPPORT / "running_job.py"), sqlite_url, PREFIX]
            process = stack.enter_context(
                subprocess.Popen([*command, table.name], env=env, stdout=subprocess.PIPE, text=True)
            )
            stack.callback(process.kill)
            processes.append(process)
            assert process.stdout is not None
            jobs.append(process.stdout.readline().strip())
        collected = registry(None)

        def running(job: str) -> float | None:
            value = collected.get_sample_value("shardkit_job_ranges_running", {"job_id": job})
            return None if value is None else float(value)

        assert [running(job) for job in jobs] == [1, 1]
        processes[0].kill()  # and not reaped: a zombie has ended too
        wait_for(lambda: running(jobs[0]) is None, "the killed process' range to leave", 30)
        assert running(jobs[1]) == 1
    engine.dispose()


def test_jobs_a_process_ran_leave_the_exposition_not_the_processs_file(
    sqlite_url: str, tmp_path: Path, multiprocess_env: dict[str, str]
) -> None:
    """Under $PROMETHEUS_MULTIPROC_DIR a process that ran five jobs to completion and
    runs a sixth: only the sixth has a ``shardkit_job_ranges_running`` series, as without
    the directory; the stated limit is that the process's file keeps a series for each
    of the six (prometheus_client cannot remove one) until the process has ended."""
    from prometheus_client.mmap_dict import MmapedDict

    env = multiprocess_env
    engine = sa.create_engine(sqlite_url)
    with contextlib.ExitStack() as stack:
        table = stack.enter_context(numbered_table(engine, "ran", 30))
        command = [sys.executable, str(SUPPORT / "running_job.py"), sqlite_url, PREFIX]
        process = stack.enter_context(
            subprocess.Popen(
                [*command, table.name, "5"], env=env, stdout=subprocess.PIPE, text=True
            )
        )
        stack.callback(process.kill)
        assert process.stdout is not None
        finished = process.stdout.readline().split()
        held = process.stdout.readline().strip()
        collected = registry(None)
        served = parse_samples(exposition(collected, None)[0].decode())
        file = tmp_path / f"gauge_livesum_{process.pid}.db"
        entries = [
            (json.loads(key), value)
            for key, value, _, _ in MmapedDict.read_all_values_from_file(str(file))
        ]  # each key: [metric, sample, labels, help]
        kept = {
            key[2]["job_id"]: value
            for key, value in entries
            if key[0] == "shardkit_job_ranges_running"
        }
        process.kill()
        process.wait(30)
        exposition(collected, None)  # drops the files of the processes that have ended
        assert not file.exists()
    engine.dispose()
    running = {
        dict(labels)["job_id"]: value
        for (metric, labels), value in served.items()
        if metric == "shardkit_job_ranges_running"
    }
    assert len(finished) == 5
    assert running == {held: 1}
    assert kept == {**dict.fromkeys(finished, 0.0), held: 1.0}


def test_a_process_of_another_pid_namespace_is_judged_by_its_pid_here(
    sqlite_url: str, tmp_path: Path, multiprocess_env: dict[str, str]
) -> None:
    """The stated limit (the operating page: the processes must share the endpoint's pid
    namespace): a process in a pid namespace of its own is pid 1 there, and its files
    are named so; killed, its range still counts as running here, where pid 1 runs."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        reason = "a pid namespace needs root and unshare (util-linux)"
        if CI:
            pytest.fail(f"required in CI: {reason}")
        pytest.skip(reason)
    env = multiprocess_env
    engine = sa.create_engine(sqlite_url)
    with contextlib.ExitStack() as stack:
        table = stack.enter_context(numbered_table(engine, "namespaced", 50))
        command = [sys.executable, str(SUPPORT / "running_job.py"), sqlite_url, PREFIX]
        isolated = [unshare, "--pid", "--fork", "--kill-child", *command, table.name]
        process = stack.enter_context(
            subprocess.Popen(isolated, env=env, stdout=subprocess.PIPE, text=True)
        )
        stack.callback(process.kill)
        assert process.stdout is not None
        job = process.stdout.readline().strip()
        (inside,) = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        assert [path.name for path in tmp_path.glob("gauge_live*_1.db")]  # named for pid 1
        collected = registry(None)

        def running() -> float | None:
            value = collected.get_sample_value("shardkit_job_ranges_running", {"job_id": job})
            return None if value is None else float(value)

        assert running() == 1
        process.kill()  # and --kill-child kills the job's process
        process.wait(30)
        wait_for(lambda: not Path(f"/proc/{inside}").exists(), "the job's process to end", 30)
        assert running() == 1  # still counted: pid 1 runs here
    engine.dispose()


# -- the dashboard's API ---------------------------------------------------------------


@contextlib.contextmanager
def served(app: Any) -> Iterator[httpx.Client]:
    """``app`` served by uvicorn from a thread on a free port, and a client of it."""
    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), "uvicorn to start", 30)
        assert server.started
        with httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}") as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def client(kit: shardkit.Kit) -> Iterator[httpx.Client]:
    with served(dashboard(kit, token=TOKEN)) as the_client:
        yield the_client


def test_the_dashboard_lists_counters_with_their_parts(
    kit: shardkit.Kit, client: httpx.Client
) -> None:
    prefix = f"test:dash:{uuid.uuid4().hex}:"
    kit.sharded(prefix + "views", shards=4).incr(6)
    hits = kit.buffered(prefix + "hits", interval=NEVER)
    hits.incr(9)
    hits.flush()
    hits.incr(2)
    kit.ids(prefix + "ids", block=50, sub_block=1).next()  # no block reserved ahead
    kit.monotonic(prefix + "seq").incr(3)
    found = client.get("/api/counters", params={"prefix": prefix}).json()["counters"]
    assert found == [
        {"name": prefix + "hits", "kind": "buffered", "shards": 1, "value": 11, "cached": None,
         "pending": 2},
        {"name": prefix + "ids", "kind": "ids", "shards": 1, "value": 50, "cached": None,
         "pending": None},
        {"name": prefix + "seq", "kind": "monotonic", "shards": 20, "value": 3, "cached": None,
         "pending": None},
        {"name": prefix + "views", "kind": "sharded", "shards": 4, "value": 6, "cached": 6,
         "pending": None},
    ]  # fmt: skip
    limited = client.get("/api/counters", params={"prefix": prefix, "limit": "1"}).json()
    assert [c["name"] for c in limited["counters"]] == [prefix + "hits"]
    for bad in ("0", "many", "1000000"):
        answer = client.get("/api/counters", params={"limit": bad})
        assert answer.status_code == 400
        assert "limit" in answer.json()["error"]


def test_the_dashboard_draws_a_jobs_tree_of_ranges(
    kit: shardkit.Kit, client: httpx.Client, table: sa.Table
) -> None:
    job = kit.map(table, lambda batch: None, key="id", page_size=20, fanout=4)
    job.wait(30)
    listed = client.get("/api/jobs").json()["jobs"]
    assert next(j for j in listed if j["id"] == job.id)["rows"] == 250
    found = client.get(f"/api/jobs/{job.id}").json()
    assert found["job"]["state"] == "complete"
    assert found["job"]["rows"] == 250
    assert found["job"]["rows_per_second"] > 0
    ranges = found["ranges"]
    by_id = {r["id"]: r for r in ranges}
    [root] = [r for r in ranges if r["parent"] is None]
    assert (root["lo"], root["hi"], root["depth"]) == (None, None, 0)
    assert len(ranges) > 1
    assert not found["truncated"]
    # A tree: every other range's parent is there, one level up; every row is in one.
    for r in ranges:
        if r is not root:
            assert by_id[r["parent"]]["depth"] == r["depth"] - 1
    assert sum(r["rows"] for r in ranges) == 250
    assert {r["state"] for r in ranges} == {"done"}
    # Siblings come in their keys' order.
    for parent in ranges:
        children = [r for r in ranges if r["parent"] == parent["id"]]
        lows = [int(r["lo"]) if r["lo"] is not None else -1 for r in children]
        assert lows == sorted(lows)


def test_cancel_and_resume_need_the_token(
    kit: shardkit.Kit, client: httpx.Client, table: sa.Table
) -> None:
    job = kit.map(table, lambda batch: None, key="id", page_size=20)
    job.wait(30)
    url = f"/api/jobs/{job.id}/cancel"
    assert client.post(url).status_code == 401
    assert client.post(url, headers={"Authorization": "Bearer wrong-token-here"}).status_code == 401
    assert client.get(url).status_code == 405  # an action is never a GET
    answer = client.post(url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200
    assert answer.json()["result"] is False
    assert (
        client.post(
            "/api/jobs/no-such-job/resume", headers={"Authorization": f"Bearer {TOKEN}"}
        ).status_code
        == 404
    )
    with served(dashboard(kit)) as read_only:
        assert read_only.get("/api/info").json()["writable"] is False
        refused = read_only.post(url, headers={"Authorization": f"Bearer {TOKEN}"})
        assert refused.status_code == 403
        assert "read-only" in refused.json()["error"]
    with pytest.raises(shardkit.ValidationError, match="16 characters"):
        dashboard(kit, token="short")


def test_the_page_and_bad_job_ids(client: httpx.Client) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert "<title>shardkit</title>" in page.text
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    for bad in ("no-such-job", "x" * 65, "bad id"):
        answer = client.get(f"/api/jobs/{bad}")
        assert answer.status_code == 404, bad
        assert "error" in answer.json()


def test_no_password_reaches_the_dashboard(sqlite_url: str) -> None:
    url = make_url(store_url_for("postgres", sqlite_url)).set(password="s3cret-pw")
    with (
        shardkit.connect(url.render_as_string(hide_password=False), prefix=PREFIX) as kit,
        served(dashboard(kit)) as client,
    ):
        info = client.get("/api/info").json()
        assert "***" in info["store"]
        for path in ("/", "/api/info", "/api/counters", "/api/jobs", "/metrics"):
            assert "s3cret-pw" not in client.get(path).text, path


@pytest.mark.parametrize(("setting", "recorded"), [(None, True), ("off", False), ("on", True)])
def test_metrics_are_recorded_once_prometheus_client_is_installed(
    sqlite_url: str, setting: str | None, recorded: bool
) -> None:
    """A process that opens a kit records metrics when prometheus_client is importable,
    unless ``$SHARDKIT_METRICS=off`` (a process of its own: the tests' set it on)."""
    env = {k: v for k, v in os.environ.items() if k != "SHARDKIT_METRICS"}
    if setting is not None:
        env["SHARDKIT_METRICS"] = setting
    script = (
        "import sys, shardkit, shardkit.metrics\n"
        "with shardkit.connect(sys.argv[1], prefix=sys.argv[2]) as kit:\n"
        "    kit.sharded('metrics:default').incr()\n"
        "print(shardkit.metrics.meter.enabled)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, sqlite_url, PREFIX],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(recorded)


@pytest.mark.parametrize(
    "buckets", [metrics._WRITE_SECONDS, metrics._BATCH_SIZES], ids=["seconds", "sizes"]
)
def test_a_write_path_observation_counts_as_prometheus_clients_own(
    buckets: tuple[float, ...],
) -> None:
    """The meter's observer of a histogram (the bucket found by bisection, the sum and
    the bucket moved under one lock) leaves the figures prometheus_client's own
    ``observe`` leaves: values on, between, below and above the bounds."""
    prom = metrics.prometheus()
    ours, theirs = (
        prom.Histogram("h", "h", buckets=buckets, registry=prom.CollectorRegistry())
        for _ in range(2)
    )
    observe = metrics._observer(ours)
    assert observe.__name__ == "observe_here"  # the in-process path, not observe itself
    values = [0.0, *buckets, *(bound * 1.5 for bound in buckets), buckets[0] / 2, 1e9]
    for value in values:
        observe(value)
        theirs.observe(value)

    def figures(histogram: Any) -> list[tuple[str, dict[str, str], float]]:
        samples = [sample for family in histogram.collect() for sample in family.samples]
        return [(s.name, s.labels, s.value) for s in samples if s.name != "h_created"]

    assert figures(ours) == figures(theirs)


def test_what_is_served_passes_promtool_and_every_series_starts_at_zero(
    kit: shardkit.Kit, table: sa.Table, name: str
) -> None:
    """Before anything is written, every write outcome of every kind, every flush
    outcome and every action ridden out has its series, at 0 (a rate of failures must
    read 0, not "no data", on a healthy system); a job has a series per state, 1 for
    its own; and Debian's promtool finds nothing to say of the names and labels."""
    promtool = shutil.which("promtool")
    if promtool is None:
        unavailable("promtool is not installed (.ci/run installs Debian's prometheus)")
    kit.sharded(name).incr()
    server = serve(kit, free_port(), counters=[name])
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        job = kit.map(table, lambda batch: None, key="id", page_size=50)
        job.wait(30)
        served = urllib.request.urlopen(url, timeout=10).read()
        samples = scrape(url)
    finally:
        server.close()
    for kind in ("sharded", "buffered", "monotonic", "ids"):
        for outcome in ("applied", "repeated", "failed"):
            labels = frozenset({"kind": kind, "outcome": outcome}.items())
            assert ("shardkit_write_seconds_count", labels) in samples, (kind, outcome)
    for outcome in ("moved", "idle", "failed"):
        assert ("shardkit_flushes_total", frozenset({"outcome": outcome}.items())) in samples
    ridden = {dict(labels)["action"] for metric, labels in samples
              if metric == "shardkit_failures_ridden_out_total"}  # fmt: skip
    assert {"flush", "map_range", "reading a cached value", "scheduling a flush"} <= ridden
    states = {dict(labels)["state"]: value for (metric, labels), value in samples.items()
              if metric == "shardkit_job_state" and dict(labels)["job_id"] == job.id}  # fmt: skip
    assert states == {"running": 0, "complete": 1, "failed": 0, "cancelled": 0}
    assert sample(samples, "shardkit_value", counter=name, kind="sharded") == 1
    assert not any("job" in dict(labels) for _, labels in samples)
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=served, capture_output=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The metrics reference names each of shardkit's with its type (prometheus_client's
    # own and its ``_created`` gauges aside), and only metrics the package has.
    lines = served.decode().splitlines()
    types = dict(line.split()[2:4] for line in lines if line.startswith("# TYPE shardkit_"))
    types = {metric: kind for metric, kind in types.items() if not metric.endswith("_created")}
    documented = documented_metrics()
    assert {metric: documented.get(metric) for metric in types} == types
    source = "".join(path.read_text() for path in (ROOT / "src").rglob("*.py"))
    assert [metric for metric in documented if metric.removesuffix("_total") not in source] == []


def documented_metrics() -> dict[str, str]:
    """The metrics reference's table: {metric: type}."""
    return {
        metric.strip().strip("`"): kind
        for metrics, kind, *_ in documented_table("docs/reference/metrics.md", "| metric | type |")
        for metric in metrics.split(",")
    }
