"""What the benchmarks share: their writer processes (``Crew``: start N spawned writers
once, release them together for each timed phase, collect their acknowledged counts), a
crew per writer count running every mode in turn (``run_grid``), medians and ratios of
rates, the check of ids handed out by many writers (``Tally``, ``Reports``), and the
deletion of a run's Redis keys. Standard library and Rich only: ``compare.py`` runs it in
the environments of old revisions too."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue
import statistics
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from rich.console import Console

Start = Literal["spawn", "fork"]
"""How a crew's processes start (``Crew``)."""

Op = Callable[[], object]
"""One write; returning means the store acknowledged it."""

T = TypeVar("T")
Setup = Callable[[T], AbstractContextManager[Op]]
"""A module-level context-manager function (so spawn can pickle it): given its argument,
it connects, warms up without changing any total, and yields the write to repeat."""

_READY_TIMEOUT = 120.0  # spawning and connecting many writers on a busy machine


@dataclass(frozen=True)
class Phase:
    """What a crew's writers did in one timed phase."""

    counts: tuple[int, ...]
    """Acknowledged writes of each writer."""
    elapsed: tuple[float, ...]
    """Seconds each writer spent writing."""
    cpu: tuple[float, ...] = ()
    """CPU seconds each writer's process spent meanwhile, its background threads
    included."""

    @property
    def ops(self) -> int:
        return sum(self.counts)

    @property
    def rate(self) -> float:
        """Acknowledged writes per second: the sum of the writers' rates."""
        return sum(n / s for n, s in zip(self.counts, self.elapsed, strict=True))

    @property
    def cpu_per_op(self) -> float:
        """The writers' CPU seconds per acknowledged write."""
        return sum(self.cpu) / self.ops if self.ops else 0.0


def _member(index: int, tasks: Any, reports: Any, start: Any) -> None:
    """A crew process: run each task it is given until told to stop (``None``)."""
    while (task := tasks.get()) is not None:
        setup, arg, seconds, threads, shared = task
        counts = [0] * threads
        try:
            with contextlib.ExitStack() as stack:
                # One setup shared by the threads (a kit, as an application has one per
                # process), or one each (a raw driver connection).
                ops = (
                    [stack.enter_context(setup(arg))] * threads
                    if shared
                    else [stack.enter_context(setup(arg)) for _ in range(threads)]
                )
                reports.put(("ready", index, 0, 0.0))
                start.wait()
                began, cpu = time.monotonic(), time.process_time()
                _write_until(ops, counts, began + seconds)
                spent = (time.monotonic() - began, time.process_time() - cpu)
            reports.put(("done", index, sum(counts), spent))
        except BaseException as exc:
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            reports.put(("error", index, sum(counts), detail))
            if not isinstance(exc, Exception):
                raise


def _write_until(ops: list[Op], counts: list[int], deadline: float) -> None:
    """Repeat ``ops[i]`` in thread ``i`` (the first in this one) until ``deadline``,
    counting into ``counts[i]``; re-raise the first error of any."""
    errors: list[BaseException] = []

    def repeat(i: int) -> None:
        op = ops[i]
        try:
            while time.monotonic() < deadline:
                op()
                counts[i] += 1
        except BaseException as exc:
            errors.append(exc)

    others = [threading.Thread(target=repeat, args=(i,)) for i in range(1, len(ops))]
    for thread in others:
        thread.start()
    repeat(0)
    for thread in others:
        thread.join()
    if errors:
        raise errors[0]


class Crew:
    """``writers`` processes that run timed phases together, each with ``threads``
    writing threads, started by ``start`` (``spawn``: each imports what it runs, as an
    application's workers that import it after they start; ``fork``: children of this
    process, sharing the memory pages of what it imported, as workers forked from a
    parent that imported the application).

    Each phase: every writer sets up (connects, warms up), then all are released by one
    Event at once, so neither process start-up nor connecting is measured. A failing
    writer makes ``run`` raise ``RuntimeError``. Use as a context manager.
    """

    def __init__(self, writers: int, threads: int = 1, start: Start = "spawn") -> None:
        if writers < 1 or threads < 1:
            raise ValueError("a crew needs at least one writer, of at least one thread")
        self.threads = threads
        ctx = (
            multiprocessing.get_context("fork")
            if start == "fork"
            else multiprocessing.get_context("spawn")
        )
        self._start = ctx.Event()
        self._reports: Any = ctx.Queue()
        self._tasks: list[Any] = [ctx.Queue() for _ in range(writers)]
        self._processes = [
            ctx.Process(
                target=_member,
                args=(i, tasks, self._reports, self._start),
                name=f"shardkit-writer-{i}",
                daemon=True,
            )
            for i, tasks in enumerate(self._tasks)
        ]
        self._broken = False
        for process in self._processes:
            process.start()

    @property
    def writers(self) -> int:
        return len(self._processes)

    def __enter__(self) -> Crew:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self,
        setup: Setup[T],
        arg: T,
        seconds: float,
        *,
        shared: bool = True,
        ready: float = _READY_TIMEOUT,
    ) -> Phase:
        """Every writer's threads repeat ``setup(arg)``'s write for ``seconds``, all
        starting at once: one setup per writer, its write shared by its threads
        (``shared``), or one setup per thread. A writer not set up within ``ready``
        seconds (its process started and connected) fails the phase."""
        if self._broken:
            raise RuntimeError("the crew is broken by an earlier failure")
        self._start.clear()  # every writer has reported: none is waiting on it
        for tasks in self._tasks:
            tasks.put((setup, arg, seconds, self.threads, shared))
        self._collect("ready", ready)
        self._start.set()
        done = self._collect("done", seconds + _READY_TIMEOUT)
        return Phase(
            counts=tuple(int(done[i][0]) for i in range(self.writers)),
            elapsed=tuple(float(done[i][1][0]) for i in range(self.writers)),
            cpu=tuple(float(done[i][1][1]) for i in range(self.writers)),
        )

    def _collect(self, kind: str, timeout: float) -> dict[int, tuple[int, Any]]:
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[int, Any]] = {}
        while len(got) < self.writers:
            try:
                what, index, ops, detail = self._reports.get(timeout=0.5)
            except queue.Empty:
                dead = [p.name for p in self._processes if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self._broken = True
                    why = f"{', '.join(dead)} died" if dead else f"no {kind!r} in {timeout:.0f} s"
                    raise RuntimeError(f"writer processes failed: {why}") from None
                continue
            if what == "error":
                self._broken = True
                raise RuntimeError(f"writer {index} failed after {ops} writes: {detail}")
            got[index] = (ops, detail)
        return got

    def close(self) -> None:
        """Stop the writers (at once if a phase failed)."""
        if not self._broken:
            for tasks in self._tasks:
                tasks.put(None)
        for process in self._processes:
            if not self._broken:
                process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        for q in [self._reports, *self._tasks]:
            q.close()
            q.join_thread()


def run_grid(
    writer_counts: list[int],
    repeat: int,
    modes: list[str],
    run: Callable[[Crew, int, str], None],
    console: Console,
    threads: int = 1,
    start: Start = "spawn",
) -> None:
    """Call ``run(crew, writers, mode)`` ``repeat`` times for every writer count and mode,
    modes interleaved within each repetition, each repetition starting one mode further
    on (every mode takes each place in turn), one crew (of ``threads`` threads per
    writer, started by ``start``) per writer count."""
    each = "" if threads == 1 else f" x {threads} threads"
    for writers in writer_counts:
        with Crew(writers, threads, start) as crew:
            for number in range(repeat):
                turn = number % len(modes)
                for mode in modes[turn:] + modes[:turn]:
                    with console.status(f"{writers} writers{each}, {mode}, run {number + 1}…"):
                        run(crew, writers, mode)


class Rated(Protocol):
    """A benchmark cell: repeated phases of one mode, summed up as one rate."""

    @property
    def rate(self) -> float: ...


def ratio(cells: Mapping[tuple[int, str], Rated], writers: int, mode: str, base: str) -> str:
    """``mode``'s rate over ``base``'s at ``writers`` writers, as ``1.23x`` (``-`` if
    ``base`` was not measured)."""
    if (writers, base) not in cells:
        return "-"
    return f"{cells[writers, mode].rate / cells[writers, base].rate:.2f}x"


def median_phase(phases: list[Phase]) -> float:
    """The median rate of repeated phases."""
    return statistics.median(phase.rate for phase in phases)


class Tally:
    """The ids one writer was handed, as runs of consecutive ids: one run per block
    with a cache of its own, about one per id when processes share a block."""

    def __init__(self, take: Callable[[], int]) -> None:
        self.runs: list[tuple[int, int]] = []
        self.backwards = 0
        start, last = 1, 0
        runs = self.runs

        def op() -> int:
            nonlocal start, last
            i = take()
            if i != last + 1:
                if i <= last:
                    self.backwards += 1
                if last:
                    runs.append((start, last))
                start = i
            last = i
            return i

        def close() -> None:
            if last:
                runs.append((start, last))

        self.op = op
        self.close = close

    def report(self, folder: Path, blocks: int | None = None) -> None:
        """Leave the runs in a file of their own in ``folder``, for ``Reports.collect``
        (call ``close`` first), with the number of blocks the writer reserved meanwhile
        if it counted them."""
        report = folder / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        got = {"runs": self.runs, "backwards": self.backwards, "blocks": blocks}
        report.write_text(json.dumps(got))


@dataclass
class Reports:
    """What an allocator mode's writers reported, over all of its phases."""

    handed: list[tuple[int, int]] = field(default_factory=list)
    """Every id handed out so far, as disjoint, sorted, non-adjacent ranges."""
    doubled: int = 0
    """Ids handed out more than once."""
    backwards: int = 0
    """Times a writer was handed an id not above its previous one."""
    blocks: int | None = None
    """Blocks the writers of the last phase collected reserved; None if one of them did
    not count them."""

    def collect(self, folder: Path) -> tuple[int, int]:
        """Take in and remove the writers' reports of a phase: the number of ids they
        were handed and the largest of them."""
        runs: list[tuple[int, int]] = []
        blocks: list[int | None] = []
        for report in folder.glob("*.json"):
            got = json.loads(report.read_text())
            runs.extend((int(a), int(b)) for a, b in got["runs"])
            self.backwards += int(got["backwards"])
            blocks.append(got.get("blocks"))
            report.unlink()
        self.blocks = None if None in blocks else sum(b for b in blocks if b is not None)
        merged: list[tuple[int, int]] = []
        for a, b in sorted([*self.handed, *runs]):
            if merged and a <= merged[-1][1] + 1:
                low, high = merged[-1]
                if a <= high:
                    self.doubled += min(b, high) - a + 1
                merged[-1] = (low, max(b, high))
            else:
                merged.append((a, b))
        self.handed = merged
        taken = sum(b - a + 1 for a, b in runs)
        return taken, max((b for _, b in runs), default=0)


def forget_redis_keys(client: Any, namespace: str, *keys: str) -> None:
    """Delete this run's Redis keys: the kit's namespace (buffered counters' sums and
    generation pointer, flush claims, the sharded counter's ticket) and ``keys``."""
    doomed = [*keys, *client.scan_iter(match=f"{namespace}*", count=1000)]
    for start in range(0, len(doomed), 500):
        client.delete(*doomed[start : start + 500])
