"""The Prometheus exposition: the metrics processes record (``shardkit.metrics``) and
those read from the kit's store and cache at each scrape (``KitCollector``).

Served by ``shardkit metrics --port``, by the dashboard (``/metrics``) and by the Django
app. Under ``$PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode) the
recorded metrics are those of every process that shares the directory (a pre-fork
server's workers, Celery's pool), summed; otherwise this process's own.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.errors import ShardkitError
from shardkit.mapper.ledger import FINISHED, RUNNING
from shardkit.metrics import prometheus

from .report import counter_views

if TYPE_CHECKING:
    from shardkit.kit import Kit

# Jobs whose progress a scrape reports: the running ones, and the latest finished.
_FINISHED_JOBS = 20
# Seconds a scrape waits for its read of the store and cache: well within Prometheus'
# default scrape timeout (10 s), which a store failing over would otherwise outlast.
READ_TIMEOUT = 5.0


class _Reading:
    """One read of the store and cache, run in a daemon thread of its own: its metric
    families once ``done`` (None if it failed with a ``ShardkitError``; ``error``, any
    other exception), and when it began (``time.monotonic()``)."""

    def __init__(self, read: Callable[[], list[Any]], finished: Callable[[_Reading], None]) -> None:
        self.began = time.monotonic()
        self.done = threading.Event()
        self.families: list[Any] | None = None
        self.error: Exception | None = None
        self._read, self._finished = read, finished
        threading.Thread(target=self._run, name="shardkit-metrics-read", daemon=True).start()

    def _run(self) -> None:
        try:
            self.families = self._read()
        except ShardkitError:
            pass
        except Exception as exc:  # raised by the scrape that waits for it
            self.error = exc
        finally:
            self._finished(self)
            self.done.set()


class KitCollector:
    """Reads at each scrape what lives in the store and cache rather than in a process:
    the progress of mapping jobs (every running one, and the latest finished), the
    increments pending in all buffered counters, and the value of each counter in
    ``counters`` (only those: a label per counter name is the user's choice).

    A scrape waits ``timeout`` seconds for its read. A read that fails, or is not done
    by then (it goes on in the background; a scrape meanwhile waits for it rather than
    start another), makes the scrape serve the last reading that succeeded, with
    ``shardkit_monitor_read_age_seconds`` its age, and ``shardkit_monitor_read_ok`` 0.
    """

    def __init__(
        self, kit: Kit, counters: Sequence[str] = (), timeout: float = READ_TIMEOUT
    ) -> None:
        self.kit = kit
        self.counters = list(counters)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._reading: _Reading | None = None  # in flight
        self._last: _Reading | None = None  # the last that succeeded

    def describe(self) -> Iterable[Any]:
        return []  # nothing is read when the collector is registered

    def collect(self) -> Iterator[Any]:
        core = prometheus().core
        with self._lock:
            reading = self._reading = self._reading or _Reading(self._read, self._finished)
        reading.done.wait(self.timeout)
        if reading.error is not None:
            raise reading.error
        with self._lock:
            served = self._last
        ok = int(served is reading)
        if served is not None:
            yield from served.families or ()
            yield core.GaugeMetricFamily(
                "shardkit_monitor_read_age_seconds",
                "Seconds since the read of the store and cache served began.",
                time.monotonic() - served.began,
            )
        yield core.GaugeMetricFamily(
            "shardkit_monitor_read_ok", "1 if the last scrape read the store and cache.", ok
        )

    def _read(self) -> list[Any]:
        core = prometheus().core
        return self._counters(core) + self._jobs(core)

    def _finished(self, reading: _Reading) -> None:
        with self._lock:
            self._reading = None
            if reading.families is not None:
                self._last = reading

    def _counters(self, core: Any) -> list[Any]:
        kit = self.kit
        buffered = [info.name for info in kit.counters() if info.kind == "buffered"]
        pending = sum(parts.pending for parts in kit.parts(buffered).values())
        all_pending = core.GaugeMetricFamily(
            "shardkit_buffered_pending_all",
            "Increments waiting in the cache, over every buffered counter.",
            pending,
        )
        if not self.counters:
            return [all_pending]
        value = core.GaugeMetricFamily(
            "shardkit_value", "Value of a listed counter.", labels=["counter", "kind"]
        )
        waiting = core.GaugeMetricFamily(
            "shardkit_buffered_pending",
            "Increments of a listed buffered counter waiting in the cache.",
            labels=["counter"],
        )
        for view in counter_views(kit, names=self.counters, limit=len(self.counters)):
            value.add_metric([view.name, view.kind], view.value)
            if view.pending is not None:
                waiting.add_metric([view.name], view.pending)
        return [all_pending, value, waiting]

    def _jobs(self, core: Any) -> list[Any]:
        statuses = self.kit.jobs()
        finished = [status for status in statuses if status.state in FINISHED]
        shown = [s for s in statuses if s.state not in FINISHED] + finished[:_FINISHED_JOBS]
        job = ["job_id"]  # not "job": Prometheus gives every target's series that label
        rows = core.CounterMetricFamily("shardkit_job_rows", "Rows a job visited.", labels=job)
        estimate = core.GaugeMetricFamily(
            "shardkit_job_rows_estimated", "Rows in a job's source when it started.", labels=job
        )
        pages = core.CounterMetricFamily("shardkit_job_pages", "Pages a job visited.", labels=job)
        ranges = core.GaugeMetricFamily(
            "shardkit_job_ranges", "A job's ranges, by state.", labels=["job_id", "state"]
        )
        depth = core.GaugeMetricFamily(
            "shardkit_job_depth", "The deepest split of a job so far.", labels=job
        )
        failures = core.CounterMetricFamily(
            "shardkit_job_range_failures",
            "Failed attempts of a job's ranges (each retried until its retries are spent).",
            labels=job,
        )
        taken = core.CounterMetricFamily(
            "shardkit_job_ranges_taken_over",
            "Runs of a job's ranges begun while an earlier run had not ended with a word (its"
            " worker died or was cut off, or its task was delivered again while it ran).",
            labels=job,
        )
        state = core.GaugeMetricFamily(
            "shardkit_job_state",
            "1 for a job's current state, 0 for each other.",
            labels=["job_id", "state"],
        )
        for status in shown:
            rows.add_metric([status.id], status.rows)
            if status.estimate is not None:
                estimate.add_metric([status.id], status.estimate)
            pages.add_metric([status.id], status.pages)
            ranges.add_metric([status.id, "pending"], status.pending)
            ranges.add_metric([status.id, "done"], status.done)
            depth.add_metric([status.id], status.depth)
            failures.add_metric([status.id], status.failures)
            taken.add_metric([status.id], status.taken_over)
            for each in (RUNNING, *FINISHED):
                state.add_metric([status.id, each], int(each == status.state))
        return [rows, estimate, pages, ranges, depth, failures, taken, state]


class _Recorded:
    """Forwards the metrics this process records (prometheus_client's default registry)."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        return iter(self._registry.collect())


class _LiveProcesses:
    """prometheus_client's multiprocess collector over ``path``, which first drops the
    live gauges (``shardkit_job_ranges_running``) of processes that have ended, however
    they ended (a SIGKILLed worker, a Celery pool child): their share leaves the sum at
    the next scrape. The processes must share this one's pid namespace (one host, one
    container), as the directory's files are named by pid.

    A process's file keeps a series for every job it ran (prometheus_client cannot
    remove one): a job with no range running in any process is left out, as it has no
    series without the directory."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._collector = prometheus().multiprocess.MultiProcessCollector(None, path)

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        for file in Path(self._path).glob("gauge_live*_*.db"):
            pid = file.stem.rsplit("_", 1)[1]
            if pid.isdigit() and not _alive(int(pid)):
                prometheus().multiprocess.mark_process_dead(int(pid), self._path)
        families: list[Any] = self._collector.collect()
        for family in families:
            if family.name == "shardkit_job_ranges_running":
                family.samples = [sample for sample in family.samples if sample.value]
        return families


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an unreaped zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def registry(kit: Kit | None, counters: Sequence[str] = (), timeout: float = READ_TIMEOUT) -> Any:
    """A prometheus_client registry of everything shardkit exposes: the recorded metrics
    (every process's, under ``$PROMETHEUS_MULTIPROC_DIR``, without the live gauges of
    processes that have ended; else this one's) and, given a (sync) ``kit``, a
    ``KitCollector`` on it with ``counters`` listed, waiting ``timeout`` seconds for its
    read."""
    prom = prometheus()
    collected = prom.CollectorRegistry(auto_describe=False)
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        collected.register(_LiveProcesses(path))
    else:
        collected.register(_Recorded(prom.REGISTRY))
    if kit is not None:
        collected.register(KitCollector(kit, counters, timeout))
    return collected


def exposition(collected: Any, accept: str | None) -> tuple[bytes, str]:
    """``collected``'s metrics in the format ``accept`` asks for (Prometheus text or
    OpenMetrics): the body and its content type."""
    encoder, content_type = prometheus().exposition.choose_encoder(accept or "")
    return encoder(collected), content_type


class MetricsServer:
    """``registry(kit, counters)`` served over HTTP from a daemon thread (prometheus_client's
    server); ``close()`` stops it."""

    def __init__(self, kit: Kit, port: int, host: str, counters: Sequence[str]) -> None:
        self._server, self._thread = prometheus().start_http_server(
            port, host, registry(kit, counters)
        )

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve(
    kit: Kit, port: int, host: str = "127.0.0.1", counters: Sequence[str] = ()
) -> MetricsServer:
    """Serve ``registry(kit, counters)`` at ``http://host:port/metrics`` until closed."""
    return MetricsServer(kit, port, host, counters)
