"""What the counters and jobs do, as Prometheus metrics (``shardkit[metrics]``).

Counters and jobs report to ``meter``: a ``Meter`` that drops everything until metrics
are turned on, when a kit is opened with ``prometheus_client`` importable (unless
``$SHARDKIT_METRICS=off``) or by ``enable()``; then it records into
``prometheus_client`` metrics (about 2 µs of CPU per write). Under a
pre-fork server or Celery's prefork pool, also set ``$PROMETHEUS_MULTIPROC_DIR`` before
the processes start (prometheus_client's multiprocess mode): every process's metrics are
then summed where they are served (``shardkit.monitor.exporter``). Recording never does
I/O and never fails the call it records.

Every label has a bounded set of values: counter kinds, outcomes, the actions the kit
rides out failures of, and mapping job ids; never a counter's name (the per-counter
gauges that ``shardkit.monitor`` reads at scrape time are for names the user lists).
Every series a dashboard divides or alerts on exists from the start, at 0: each kind's
outcomes, the flushes' outcomes, each action declared with ``action()``.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from shardkit._program import Program
from shardkit.errors import MissingDriver

T = TypeVar("T")
A = TypeVar("A")

# Outcomes of a write, of the counters of these kinds.
APPLIED, REPEATED, FAILED = "applied", "repeated", "failed"
KINDS = ("sharded", "buffered", "monotonic", "ids")
# Outcomes of a flush.
FLUSHES = ("moved", "idle", "failed")
# The actions whose failures the kits ride out (``FailureLog``), declared by the modules
# that do them, and the background tasks.
_actions: set[str] = set()
# Whether a kit opened now turns metrics on (see ``unread``).
_read = contextvars.ContextVar("shardkit_metrics_read", default=True)


def action(name: str) -> str:
    """Declare ``name`` an action whose failures may be ridden out (its series then
    exists at 0 from when metrics are on); return it."""
    with _lock:
        _actions.add(name)
        meter.declared(name)
    return name


_WRITE_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# A flush's lag in multiples of its counter's interval: a flush on time lags a little more
# than one interval, so the buckets are dense there (at most 10 % apart up to three
# intervals, where quantiles interpolated within a bucket are right to within 10 %).
_LAG_INTERVALS = (
    *(0.5, 1.0, 1.01, 1.02, 1.05),
    *(round(1.1**power, 4) for power in range(1, 13)),
    *(4.0, 5.0, 7.5, 10.0, 20.0, 50.0, 100.0),
)


class Meter:
    """Receives what the counters and jobs do. This one drops it all (metrics off); every
    method is cheap enough for a write's path, and none does I/O or raises."""

    enabled = False

    def wrote(self, kind: str, outcome: str, seconds: float) -> None:
        """A write of a counter of ``kind`` ended with ``outcome`` after ``seconds``."""

    def combined(self, kind: str, size: int) -> None:
        """One backend call carried ``size`` writes of a counter of ``kind``."""

    def grew(self, kind: str) -> None:
        """An automatic counter of ``kind`` grew its shards (``counters.sizing``)."""

    def rode_out(self, action: str) -> None:
        """A call failed without failing its caller (``FailureLog``): a cache error the
        kit fell back from, or a background task that failed."""

    def declared(self, action: str) -> None:
        """``action`` may be ridden out: its series starts at 0."""

    def flushed(self, outcome: str) -> None:
        """A buffered counter's flush ended: ``moved`` something, ``idle``, ``failed``."""

    def flushes_every(self, interval: float) -> None:
        """A buffered counter is flushed every ``interval`` seconds: its lag series start
        at 0."""

    def flush_lag(self, interval: float, seconds: float) -> None:
        """A scheduled flush of a counter flushed every ``interval`` seconds moved
        increments made at most ``seconds`` ago."""

    def lost_race(self) -> None:
        """A flush's compare-and-set found another flush had advanced the record first."""

    def reserved(self, block: int) -> None:
        """An id allocator reserved a block of ``block`` ids in the store."""

    def lost_block(self) -> None:
        """An id allocator left a block whose key the cache lost (its unused ids are
        holes)."""

    def running(self, job: str, change: int) -> None:
        """``change`` (+1 or -1) ranges of mapping job ``job`` started or stopped running
        in this process (a job with none running has no series here: a process that
        runs a job a minute for weeks keeps no series per job it ran, except under
        prometheus_client's multiprocess mode, whose file keeps each at 0 until the
        process ends; the exporter leaves those out)."""


meter = Meter()
"""Where counters and jobs report: replaced by ``enable()``."""

_lock = threading.Lock()
_ON = ("on", "1", "true", "yes")
_OFF = ("off", "0", "false", "no")
_recording: dict[int, Meter] = {}  # by registry id: its metrics are registered once


def enable(registry: Any = None) -> Meter:
    """Record metrics into ``registry`` (prometheus_client's default one if None) from now
    on, in every kit of the process; idempotent. ``MissingDriver`` if prometheus_client
    is not installed."""
    global meter
    with _lock:
        if not meter.enabled:
            meter = _recording.get(id(registry)) or _PrometheusMeter(registry, _actions)
            _recording[id(registry)] = meter
        return meter


@contextlib.contextmanager
def unread() -> Iterator[None]:
    """Kits opened in the block (in this thread or task) do not turn metrics on: for a
    one-off command whose metrics nothing would read, which then never imports
    prometheus_client."""
    token = _read.set(False)
    try:
        yield
    finally:
        _read.reset(token)


def disable() -> None:
    """Stop recording (the metrics registered stay, with their values; ``enable()`` goes
    on with them)."""
    global meter
    with _lock:
        meter = Meter()


def start() -> None:
    """Enable metrics, called when a kit is opened: if prometheus_client is installed,
    unless ``$SHARDKIT_METRICS`` is ``off`` or the kit is opened in ``unread``;
    ``MissingDriver`` if it is ``on`` and prometheus_client is not installed."""
    setting = os.environ.get("SHARDKIT_METRICS", "").lower()
    if meter.enabled or setting in _OFF or not _read.get():
        return
    try:
        enable()
    except MissingDriver:
        if setting in _ON:
            raise


def prometheus() -> Any:
    """The ``prometheus_client`` module (with its ``core`` and ``multiprocess``);
    ``MissingDriver`` if it is not installed."""
    try:
        import prometheus_client
        import prometheus_client.core
        import prometheus_client.multiprocess
    except ImportError as exc:
        raise MissingDriver(
            "metrics need prometheus_client: pip install 'shardkit[metrics]'"
        ) from exc
    return prometheus_client


def timed(kind: str, write: Program[T]) -> Program[T]:
    """The program ``write`` of a counter of ``kind``, reporting its outcome and duration
    when metrics are on (a result of False is a repeated key; an exception, not a
    cancellation, a failure); ``write`` itself when they are off, at no cost."""
    return _timed(kind, write) if meter.enabled else write


def _timed(kind: str, write: Program[T]) -> Program[T]:
    started = time.perf_counter()
    try:
        result = yield from write
    except Exception:
        meter.wrote(kind, FAILED, time.perf_counter() - started)
        raise
    meter.wrote(kind, REPEATED if result is False else APPLIED, time.perf_counter() - started)
    return result


def timed_call(kind: str, write: Callable[[A], T], arg: A) -> T:
    """``write(arg)``, a write of a counter of ``kind`` made with no program around it (a
    sync form's shortcut), reported as ``timed`` reports one."""
    if not meter.enabled:
        return write(arg)
    started = time.perf_counter()
    try:
        result = write(arg)
    except Exception:
        meter.wrote(kind, FAILED, time.perf_counter() - started)
        raise
    meter.wrote(kind, REPEATED if result is False else APPLIED, time.perf_counter() - started)
    return result


class _PrometheusMeter(Meter):
    """Records into prometheus_client metrics (in its multiprocess mode when
    ``$PROMETHEUS_MULTIPROC_DIR`` is set when it is imported)."""

    enabled = True

    def __init__(self, registry: Any, actions: set[str]) -> None:
        prom = prometheus()
        where = {"registry": registry} if registry is not None else {}
        self._seconds = prom.Histogram(
            "shardkit_write_seconds",
            "Time a counter write took its caller (combining wait included), by kind and "
            "outcome; its count is the writes.",
            ["kind", "outcome"],
            buckets=_WRITE_SECONDS,
            **where,
        )
        self._batches = prom.Histogram(
            "shardkit_combined_writes",
            "Writes carried by one backend call (combined from concurrent callers).",
            ["kind"],
            buckets=_BATCH_SIZES,
            **where,
        )
        self._growths = prom.Counter(
            "shardkit_shard_growths",
            "Automatic counters' growths of their shard count, by kind.",
            ["kind"],
            **where,
        )
        self._growths.labels("sharded")
        self._rode_out = prom.Counter(
            "shardkit_failures_ridden_out",
            "Calls that failed without failing their caller (cache errors fallen back "
            "from, failed background tasks), by action.",
            ["action"],
            **where,
        )
        for each in actions:
            self._rode_out.labels(each)
        self._flushes = prom.Counter(
            "shardkit_flushes", "Buffered counters' flushes, by outcome.", ["outcome"], **where
        )
        self._lags = _Lags(prom)
        (prom.REGISTRY if registry is None else registry).register(self._lags)
        self._races = prom.Counter(
            "shardkit_flush_races_lost",
            "Flush compare-and-sets that found another flush's record (retried).",
            **where,
        )
        self._blocks = prom.Counter("shardkit_id_blocks", "Id blocks reserved.", **where)
        self._reserved = prom.Counter("shardkit_ids_reserved", "Ids in reserved blocks.", **where)
        self._lost_blocks = prom.Counter(
            "shardkit_id_blocks_lost",
            "Id blocks left because the cache lost their key (their unused ids are holes).",
            **where,
        )
        self._running = prom.Gauge(
            "shardkit_job_ranges_running",
            "Ranges of a mapping job being visited now.",
            ["job_id"],
            multiprocess_mode="livesum",
            **where,
        )
        self._live: dict[str, int] = {}  # ranges running now, by job: their series exist
        # prometheus_client's multiprocess mode cannot remove a series (its files keep it).
        self._multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._running_lock = threading.Lock()
        # Children bound once: a label lookup per write would cost more than the write's
        # own bookkeeping.
        self._write_children: dict[tuple[str, str], Callable[[float], None]] = {}
        self._batch_children: dict[str, Callable[[float], None]] = {}
        for kind in KINDS:  # every series at 0 from the start
            for outcome in (APPLIED, REPEATED, FAILED):
                child = self._seconds.labels(kind, outcome)
                self._write_children[kind, outcome] = _observer(child)
        for outcome in FLUSHES:
            self._flushes.labels(outcome)

    def wrote(self, kind: str, outcome: str, seconds: float) -> None:
        observe = self._write_children.get((kind, outcome))
        if observe is None:
            observe = self._write_children[kind, outcome] = _observer(
                self._seconds.labels(kind, outcome)
            )
        observe(seconds)

    def combined(self, kind: str, size: int) -> None:
        observe = self._batch_children.get(kind)
        if observe is None:
            observe = self._batch_children[kind] = _observer(self._batches.labels(kind))
        observe(size)

    def grew(self, kind: str) -> None:
        self._growths.labels(kind).inc()

    def rode_out(self, action: str) -> None:
        self._rode_out.labels(action).inc()

    def declared(self, action: str) -> None:
        self._rode_out.labels(action)

    def flushed(self, outcome: str) -> None:
        self._flushes.labels(outcome).inc()

    def flushes_every(self, interval: float) -> None:
        self._lags.child(interval)

    def flush_lag(self, interval: float, seconds: float) -> None:
        self._lags.child(interval).observe(seconds)

    def lost_race(self) -> None:
        self._races.inc()

    def reserved(self, block: int) -> None:
        self._blocks.inc()
        self._reserved.inc(block)

    def lost_block(self) -> None:
        self._lost_blocks.inc()

    def running(self, job: str, change: int) -> None:
        with self._running_lock:
            now = self._live.get(job, 0) + change
            if now or self._multiprocess:  # its files keep every series they had anyway
                self._live[job] = now
                self._running.labels(job).inc(change)
            if not now:
                self._live.pop(job, None)
                if not self._multiprocess:
                    self._running.remove(job)


def _observer(child: Any) -> Callable[[float], None]:
    """``child.observe`` of a prometheus_client histogram's child, made in fewer steps
    where its parts are the known ones (a write's path observes twice): the first bucket
    the value fits found by bisection rather than a loop over the buckets, and, for
    in-process values, the sum and the bucket moved under one lock of the child's own
    rather than each under its value's. The same figures as ``child.observe``, single-
    process or multiprocess (whose values write to their file: each ``inc``ed); else
    ``child.observe`` itself. Only this child's observer may write its values."""
    bounds, buckets, total = (getattr(child, part, None) for part in _PARTS)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        return cast("Callable[[float], None]", child.observe)
    bounds, fits = list(bounds), bisect.bisect_left
    here = prometheus().values.MutexValue  # a float under a lock, ``_value``
    if not all(type(value) is here for value in (total, *buckets)):

        def observe(value: float) -> None:
            total.inc(value)
            buckets[fits(bounds, value)].inc(1)

        return observe
    lock = threading.Lock()

    def observe_here(value: float) -> None:
        bucket = buckets[fits(bounds, value)]
        with lock:  # a reader takes each value whole (under its own lock)
            total._value += value
            bucket._value += 1

    return observe_here


_PARTS = ("_upper_bounds", "_buckets", "_sum")  # a prometheus_client Histogram child's


class _Lags:
    """``shardkit_flush_lag_seconds``, labelled by the counters' ``interval``: one
    histogram per interval, each with buckets placed around it (``_LAG_INTERVALS``), and
    collected as one family. The histograms are not registered themselves (a registry
    takes a name once); in multiprocess mode their samples are summed from the processes'
    files like any other."""

    _NAME = "shardkit_flush_lag_seconds"
    _HELP = (
        "Age of the oldest increment a scheduled flush moved to the store, by the counter's "
        "flush interval (seconds)."
    )

    def __init__(self, prom: Any) -> None:
        self._prom = prom
        self._made: dict[float, tuple[Any, Any]] = {}  # interval -> (histogram, its child)
        self._lock = threading.Lock()

    def child(self, interval: float) -> Any:
        """The histogram of counters flushed every ``interval`` seconds, made once."""
        made = self._made.get(interval)
        if made is None:
            with self._lock:
                made = self._made.get(interval)
                if made is None:
                    buckets = [interval * times for times in _LAG_INTERVALS]
                    histogram = self._prom.Histogram(
                        self._NAME, self._HELP, ["interval"], buckets=buckets, registry=None
                    )
                    made = self._made[interval] = (histogram, histogram.labels(f"{interval:g}"))
        return made[1]

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        family = self._prom.core.Metric(self._NAME, self._HELP, "histogram")
        for histogram, _ in list(self._made.values()):
            for metric in histogram.collect():
                family.samples += metric.samples
        return [family]
