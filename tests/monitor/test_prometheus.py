"""The documented monitoring, run with the real tools: a throwaway Prometheus (Debian's)
scrapes ``shardkit metrics`` in a process of its own while an application in another does
known work with known failures (``metered_work.py``); every PromQL query of the operating page is
evaluated through Prometheus' HTTP API and its value checked against what was done. The
Grafana dashboard holds exactly those queries, and the alert rules pass ``promtool`` and
each fires for the failure caused for it, and for nothing else. Prometheus loads the
documented rules with each ``for:`` of N minutes made N seconds, and nothing else
changed: the failures last seconds, not minutes."""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import shardkit
from backends import (
    CACHE_URLS,
    PREFIX,
    ROOT,
    STORE_URLS,
    SUPPORT,
    documented_table,
    free_port,
    numbered_table,
    require,
    wait_for,
)
from servers import PostgresServer, PrometheusServer, running, unavailable
from shardkit.metrics import _LAG_INTERVALS, _WRITE_SECONDS, KINDS
from shardkit.store import open_store
from shardkit.store.sql import SqlStore

MONITORING = ROOT / "examples" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RULES = MONITORING / "alerts.yml"
ROWS = 4000  # rows of the job's table
WORKER = SUPPORT / "metered_work.py"

Series = dict[frozenset[tuple[str, str]], float]


def documented_queries() -> dict[str, str]:
    """The operating page's table of Grafana panels: {panel: PromQL}."""
    rows = documented_table("docs/operating.md", "| panel | PromQL |")
    return {panel: expr.strip("`") for panel, expr in rows}


def test_the_grafana_dashboard_holds_the_documented_queries() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = {
        panel["title"]: [target["expr"] for target in panel["targets"]]
        for panel in dashboard["panels"]
    }
    documented = documented_queries()
    assert {title.lower(): exprs for title, exprs in panels.items()} == {
        panel.lower(): [expr] for panel, expr in documented.items()
    }
    datasources = {panel["datasource"]["uid"] for panel in dashboard["panels"]}
    assert datasources == {"${datasource}"}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_the_alert_rules_pass_promtool() -> None:
    if not shutil.which("promtool"):
        unavailable("promtool is not installed (Debian's package 'prometheus')")
    checked = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 7 rules found" in checked.stdout


class Timeline:
    """What ``metered_work.py`` logged: its events, and its counts over time."""

    def __init__(self, path: Path) -> None:
        self.events = [json.loads(line) for line in path.read_text().splitlines()]
        self.counts = [event for event in self.events if event["event"] == "counts"]
        self.rows = [event for event in self.events if event["event"] == "rows"]
        self.done = self.one("done")

    def one(self, event: str) -> dict[str, Any]:
        (found,) = [each for each in self.events if each["event"] == event]
        return found

    def at(self, events: list[dict[str, Any]], t: float, read: Callable[[Any], float]) -> float:
        """``read`` of the last of ``events`` logged at or before ``t`` (0 before any)."""
        times = [event["t"] for event in events]
        index = bisect.bisect_right(times, t)
        return read(events[index - 1]) if index else 0.0


def only(series: Series, **labels: str) -> float:
    """The one value among ``series`` whose labels include ``labels``."""
    (value,) = [v for key, v in series.items() if set(labels.items()) <= key]
    return value


def by(series: Series, label: str) -> dict[str, float]:
    return {dict(key)[label]: value for key, value in series.items()}


def fast_rules(path: Path) -> Path:
    """The documented alert rules written to ``path`` with each ``for:`` of N minutes
    made N seconds, nothing else changed."""
    text = RULES.read_text(encoding="utf-8")
    fast, rewritten = re.subn(r"(?m)^(\s+for: )(\d+)m$", r"\g<1>\g<2>s", text)
    assert rewritten == len(re.findall(r"(?m)^\s+for:", text)) > 0
    path.write_text(fast, encoding="utf-8")
    return path


@contextlib.contextmanager
def exporter(store: str, cache: str, prefix: str, env: dict[str, str]) -> Iterator[str]:
    """``shardkit metrics`` in a process of its own, serving until the block exits: its
    ``host:port``."""
    port = free_port()
    command = [sys.executable, "-m", "shardkit", "--store", store, "--cache", cache]
    command += ["--prefix", prefix, "metrics", "--port", str(port)]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as served:
        try:
            assert served.stdout is not None
            assert "serving metrics on" in served.stdout.readline()
            yield f"127.0.0.1:{port}"
        finally:
            served.terminate()


@pytest.mark.slow
def test_a_real_prometheus_evaluates_every_documented_query(tmp_path: Path, name: str) -> None:
    store_url, cache_url = STORE_URLS["postgres"], CACHE_URLS["redis"]
    assert store_url is not None
    require(store_url)
    require(cache_url)
    prefix = f"{PREFIX}prom{uuid.uuid4().hex[:6]}_"  # its own ledger and counters
    shardkit.connect(store_url, cache_url, prefix=prefix).close()  # the exporter reads
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    # The late kit's monitor serves only what it reads from its store and cache.
    reader_env = {**env, "SHARDKIT_METRICS": "off"}
    reader_env.pop("PROMETHEUS_MULTIPROC_DIR")
    log = tmp_path / "work.jsonl"
    store = open_store(store_url, prefix=prefix)
    assert isinstance(store, SqlStore)
    try:
        with (
            numbered_table(store.engine, "prom", ROWS) as table,
            running(PostgresServer) as late_store,  # the late kit's, stopped after the work
        ):
            shardkit.connect(late_store.url, cache_url, prefix=prefix).close()
            with (
                exporter(store_url, cache_url, prefix, env) as main,
                exporter(late_store.url, cache_url, prefix, reader_env) as late,
                running(
                    PrometheusServer, [main, late], fast_rules(tmp_path / "rules.yml")
                ) as prometheus,
            ):
                wait_for(
                    lambda: (
                        prometheus.query("up", time.time())
                        == {_target(main): 1.0, _target(late): 1.0}
                    ),
                    "Prometheus' first scrapes",
                    60,
                    lambda: prometheus.api("targets"),
                )
                worker = [sys.executable, str(WORKER), store_url, cache_url, prefix, name]
                worker += [table.name, str(log), late_store.url]
                subprocess.run(worker, env=env, check=True, timeout=300)
                late_store.stop()  # its monitor can no longer read it
                work = Timeline(log)
                wait_for(
                    lambda: _last_scrape(prometheus) > work.done["t"] + 1.5,
                    "a scrape after the work",
                    60,
                )
                _check_every_query(prometheus, work, main, late)
                _check_the_alerts(prometheus, work, main, late)
    finally:
        store.metadata.drop_all(store.engine)  # type: ignore[attr-defined]
        store.close()


def _target(instance: str) -> frozenset[tuple[str, str]]:
    return frozenset({("instance", instance), ("job", "shardkit")})


def _last_scrape(prometheus: PrometheusServer) -> float:
    found = prometheus.query("timestamp(shardkit_monitor_read_ok)", time.time())
    return max(found.values(), default=0.0)


def _check_every_query(prometheus: PrometheusServer, work: Timeline, main: str, late: str) -> None:
    """Each documented query against the work; ``main`` and ``late`` are the instances of
    the exporters of the application's store and of the late kit's."""
    from metered_work import HOLD, INTERVAL, LAG_INTERVAL  # the worker's constants

    queries = documented_queries()
    checked: set[str] = set()
    failing = work.one("failing")["t"]
    healthy = failing - 0.5  # the end of the healthy phase
    ended = work.counts[-1]["t"] + 1.5  # after the failing phase, a scrape later
    final = work.done["t"] + 1.5  # everything finished and flushed
    job = work.done["job"]

    def query(panel: str, at: float) -> Series:
        checked.add(panel)
        return prometheus.query(queries[panel], at)

    # Writes a second over the last minute, against the work's own counts in that minute.
    got = by(query("writes/s by kind", healthy), "kind")
    assert set(got) == {"sharded", "buffered", "monotonic", "ids"}
    for kind, rate in got.items():

        def counted(event: Any, kind: str = kind) -> float:
            return float(event["counts"][kind])

        done = work.at(work.counts, healthy, counted) - work.at(work.counts, healthy - 60, counted)
        assert rate == pytest.approx(done / 60, rel=0.2), kind

    # The failed share: 0 while healthy (every outcome's series exists from the start),
    # then the overflowing increments' share of every write.
    assert query("failed writes, share", healthy) == {frozenset(): 0.0}
    failed = work.done["failed"]
    assert failed > 0
    share = failed / (failed + sum(work.done["counts"].values()))
    assert only(query("failed writes, share", ended)) == pytest.approx(share, rel=0.2)

    # p99 latency per kind: in the bucket of the work's own p99, or the one below (the
    # work measured the call around the library's own timing).
    bounds = [*_WRITE_SECONDS, math.inf]
    p99s = by(query("p99 write latency", healthy), "kind")
    assert set(p99s) == set(KINDS)
    for kind, p99 in p99s.items():
        own = sorted(work.done["seconds"][kind])
        own_p99 = own[math.ceil(0.99 * len(own)) - 1]
        bucket = bisect.bisect_left(bounds, own_p99)
        low = bounds[bucket - 2] if bucket >= 2 else 0.0
        assert low < p99 <= bounds[bucket], (kind, p99, own_p99)

    # One writer thread: every statement carried one write.
    per_statement = by(query("writes per statement", healthy), "kind")
    assert {"sharded", "buffered"} <= set(per_statement)
    assert set(per_statement.values()) == {1.0}

    # Fallbacks: each declared action at 0 while healthy, the stopped cache's after.
    while_healthy = by(query("cache fallbacks", healthy), "action")
    assert len(while_healthy) >= 4
    assert set(while_healthy.values()) == {0.0}
    after = by(query("cache fallbacks", ended), "action")
    assert after["reading a cached value"] > 0

    # Pending increments: some, and at most a few intervals' worth, while writing (40 a
    # second); none once flushed.
    moments = [healthy - 2.5 * second for second in range(10)]
    pending = [only(query("pending increments", at), instance=main) for at in moments]
    assert max(pending) > 0, pending
    assert all(0 <= each <= 5 * INTERVAL * 40 for each in pending), pending
    assert only(query("pending increments", final), instance=main) == 0
    # The late kit's: every increment it made, none flushed (read at the last scrape).
    held = only(query("pending increments", healthy), instance=late)
    lagging = [work.at(work.counts, at, lambda e: e["lagging"]) for at in (healthy - 2.5, failing)]
    assert 0 < lagging[0] <= held <= lagging[1], (held, lagging)

    # The p95 flush lag, against the lags of the flushes the work saw land in the store:
    # a flush seen at t moved the interval before t's, so it lagged INTERVAL + t mod INTERVAL.
    lags = sorted(INTERVAL + t % INTERVAL for t in work.done["flushes"] if t < healthy)
    assert len(lags) >= 50
    real_p95 = lags[math.ceil(0.95 * len(lags)) - 1]
    lag = query("p95 flush lag, by interval", healthy)
    assert only(lag, interval=f"{INTERVAL:g}") == pytest.approx(real_p95, rel=0.1), lags
    # The late kit's one flush.
    late_p95 = only(query("p95 flush lag, by interval", final), interval=f"{LAG_INTERVAL:g}")
    low, high = _late_lag_bucket(work)
    assert low < late_p95 <= high, (late_p95, low, high)

    assert query("lost flush races", healthy) == {frozenset(): 0.0}

    # Id holes: the ids of the blocks the store reserved that were not handed out, the
    # unused rest of the block whose key the restarted cache lost among them.
    assert work.one("lost block")["ids"] == [1, 101]
    holes = query("id holes (and the unused rest of the blocks in use)", final)
    assert holes == {frozenset(): float(work.done["ids_reserved"] - work.done["ids_taken"])}

    assert (job["state"], job["rows"]) == ("complete", ROWS)
    progress = query("job progress", final)
    assert only(progress, job_id=job["id"]) == pytest.approx(job["rows"] / job["estimate"])

    # The job's rows a second: those the work visited in the minute, over the minute.
    job_end = work.rows[-1]["t"] + 1.5
    rows_rate = only(query("job rows/s", job_end), job_id=job["id"])
    rows = work.at(work.rows, job_end, lambda e: e["rows"]) - work.at(
        work.rows, job_end - 60, lambda e: e["rows"]
    )
    assert rows_rate == pytest.approx(rows / 60, rel=0.2)

    # Two ranges held in flight together on the work's two workers; none once done (the
    # series leaves with the process that ran them).
    held = work.one("held")
    in_flight = query("ranges in flight", held["t"] + HOLD * 0.75)
    assert only(in_flight, job_id=job["id"]) == 2
    assert by(query("ranges in flight", final), "job_id").get(job["id"], 0) == 0

    # Retries: the two pages failed once each, counted from 0 at the job's first scrape.
    retries = "job retries (a job's failed attempts so far)"
    assert only(query(retries, final), job_id=job["id"]) == job["failures"] == 2
    started = work.one("job")["t"]
    first = prometheus.api(
        "query_range",
        query=f'shardkit_job_range_failures_total{{job_id="{job["id"]}"}}',
        start=f"{started:.3f}",
        end=f"{final:.3f}",
        step="1",
    )["result"][0]["values"]
    assert (float(first[0][1]), float(first[-1][1])) == (0, 2)
    broken = work.one("broken job")["id"]
    assert only(query(retries, final), job_id=broken) == 1

    assert checked == set(queries), "a documented query was not checked"


def _late_lag_bucket(work: Timeline) -> tuple[float, float]:
    """Where the p95 lag of the late kit's one flush lies: in the bucket of the lag the
    work saw, or the one below (it saw the flush land after its commit)."""
    from metered_work import LAG_INTERVAL

    caught_up = work.one("caught up")["lag"]
    assert caught_up > 60  # the documented alert's threshold
    bounds = [LAG_INTERVAL * times for times in _LAG_INTERVALS]
    bucket = bisect.bisect_left(bounds, caught_up)
    return bounds[bucket - 2], bounds[bucket]


def _check_the_alerts(prometheus: PrometheusServer, work: Timeline, main: str, late: str) -> None:
    """No alert while healthy; then each fires for its failure, and only for it (with
    the value the failure gives its expression). ``main`` and ``late`` are the instances
    of the exporters of the application's store and of the late kit's (stopped)."""
    from metered_work import LAG_INTERVAL

    groups = prometheus.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == 7
    assert {rule["health"] for rule in rules} == {"ok"}, rules
    failing = work.one("failing")["t"]
    assert prometheus.query("ALERTS", failing - 0.5) == {}

    def firing() -> dict[str, list[dict[str, Any]]]:
        found: dict[str, list[dict[str, Any]]] = {}
        for alert in prometheus.api("alerts")["alerts"]:
            if alert["state"] == "firing":
                found.setdefault(alert["labels"]["alertname"], []).append(alert)
        return found

    names = {rule["name"] for rule in rules}
    wait_for(lambda: set(firing()) == names, "every alert to fire", 90, firing)
    alerts = firing()

    def one(name: str) -> tuple[dict[str, str], float]:
        (alert,) = alerts[name]
        labels = {k: v for k, v in alert["labels"].items() if k not in ("alertname", "severity")}
        return labels, float(alert["value"])

    failed = work.done["failed"]
    share = failed / (failed + sum(work.done["counts"].values()))
    assert one("ShardkitWritesFailing") == ({}, pytest.approx(share, rel=0.2))
    ridden_out = {
        alert["labels"]["action"]: float(alert["value"])
        for alert in alerts["ShardkitCacheFallbacks"]
    }
    assert {"reading a cached value", "flush"} <= set(ridden_out)
    # Every failed flush was a scheduled one: a background task that failed too.
    labels, value = one("ShardkitFlushesFailing")
    assert (labels, value) == ({}, pytest.approx(ridden_out["flush"], rel=0.05))
    labels, value = one("ShardkitFlushLagging")  # the late kit's interval, not the other's
    low, high = _late_lag_bucket(work)
    assert (labels, low < value <= high) == ({"interval": f"{LAG_INTERVAL:g}"}, True), value
    scraped = {"instance": main, "job": "shardkit"}
    assert one("ShardkitIdBlocksLost") == (scraped, pytest.approx(1, rel=0.05))
    broken = work.one("broken job")["id"]
    assert one("ShardkitJobFailed") == ({**scraped, "job_id": broken, "state": "failed"}, 1)
    assert one("ShardkitMonitorCannotRead") == ({**scraped, "instance": late}, 0)
