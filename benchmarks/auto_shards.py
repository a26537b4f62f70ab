"""Automatic shards against every fixed shard count, under the same load, in one run.

* grid       - ``--writers`` processes (16) on a counter of N fixed shards, for each N of
               ``--grid`` (1, 2, 4, … 64): the best of them is the target
* auto       - the same writers on a new automatic counter (``shards="auto"``): its
               shard count and the writes/s over time, and its rate from 3 s on
* fewer      - ``--fewer`` writers (4) on another new automatic counter: where it settles
* slow       - one writer, 2 writes/s for ``--slow`` seconds (60): it stays at 1 shard
* burst      - the writers for 5 s, then 10 s of quiet: it grows once

Every phase checks the counter's exact value against the writes acknowledged.

    python benchmarks/auto_shards.py --store postgresql://postgres@127.0.0.1:5432/test \\
        --cache redis://127.0.0.1:6379/12
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from rich.table import Table

import shardkit
from harness import Crew, Op, Phase
from hot_counter import report_console

PREFIX = "bench_auto_"
SETTLED_AFTER = 3.0  # seconds: every counter's rate is taken from then on
SAMPLE = 0.25  # seconds between two samples of a counter's shards and total


class Target(NamedTuple):
    """Where a writer writes, and how the counter is opened (``"auto"`` or a count)."""

    store_url: str
    cache_url: str
    name: str
    shards: int | str
    pause: float = 0.0  # seconds between two writes


@contextlib.contextmanager
def writer(target: Target) -> Iterator[Op]:
    """One process's ``counter.incr()``, on its own kit (as an application process)."""
    with shardkit.connect(target.store_url, target.cache_url, prefix=PREFIX) as kit:
        counter = kit.sharded(target.name, shards=target.shards)  # type: ignore[arg-type]
        pause = target.pause

        def write() -> None:
            counter.incr()
            if pause:
                time.sleep(pause)

        yield write


@dataclass
class Sampled:
    """What a phase did, sampled from the store every ``every`` seconds."""

    phase: Phase
    times: list[float]
    shards: list[int]
    totals: list[int]

    def rate_after(self, seconds: float) -> float:
        """Writes/s from ``seconds`` after the load started (the first sample with
        writes counted) to the last interval at full load (at least half the median
        interval's writes: not the one the writers stopped in)."""
        start = next(i for i, n in enumerate(self.totals) if n > 0)
        steps = [b - a for a, b in zip(self.totals, self.totals[1:], strict=False)]
        full = statistics.median(steps[start:]) / 2
        end = max(i + 1 for i, step in enumerate(steps) if step >= full)
        first = next(i for i, t in enumerate(self.times) if t >= self.times[start] + seconds)
        span = self.times[end] - self.times[first]
        return (self.totals[end] - self.totals[first]) / span if span > 0 else 0.0

    @property
    def growths(self) -> int:
        return sum(b > a for a, b in zip(self.shards, self.shards[1:], strict=False))


def sampled(crew: Crew, kit: shardkit.Kit, target: Target, seconds: float) -> Sampled:
    """Run ``crew`` on ``target`` for ``seconds`` while sampling the counter's shard count
    and stored total; check the total against the acknowledged writes."""
    times: list[float] = []
    shards: list[int] = []
    totals: list[int] = []
    done = threading.Event()

    def sample() -> None:
        began = None
        while not done.is_set():
            info = kit.store.counter(target.name)
            if info is not None:
                total = kit.store.total(target.name)
                began = began if began is not None else time.monotonic()
                times.append(time.monotonic() - began)
                shards.append(info.shards)
                totals.append(total)
            done.wait(SAMPLE)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        phase = crew.run(writer, target, seconds)
    finally:
        done.set()
        sampler.join()
    total = kit.store.total(target.name)
    if total != phase.ops:
        raise SystemExit(f"{target.name}: {total} counted, {phase.ops} acknowledged")
    return Sampled(phase, times, shards, totals)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--cache", default="redis://127.0.0.1:6379/12")
    parser.add_argument("--writers", type=int, default=16, help="writer processes (16)")
    parser.add_argument("--fewer", type=int, default=4, help="the smaller crew (4)")
    parser.add_argument("--seconds", type=float, default=6.0, help="per phase (6)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the grid (3)")
    parser.add_argument("--grid", default="1,2,4,8,16,32,64", help="fixed shard counts")
    parser.add_argument("--slow", type=float, default=60.0, help="the slow phase (60 s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console()
    run = uuid.uuid4().hex[:8]
    made: list[str] = []

    def target(label: str, shards: int | str, pause: float = 0.0) -> Target:
        made.append(name := f"auto:{run}:{label}")
        return Target(args.store, args.cache, name, shards, pause)

    modes: list[int | str] = [*(int(n) for n in args.grid.split(",")), "auto"]
    rates: dict[int | str, list[float]] = {mode: [] for mode in modes}
    autos: list[Sampled] = []
    with shardkit.connect(args.store, args.cache, prefix=PREFIX) as kit:
        with Crew(args.writers) as crew:
            for number in range(args.repeat):
                turn = number % len(modes)  # each round starts one mode further on
                for mode in modes[turn:] + modes[:turn]:
                    got = sampled(crew, kit, target(f"{mode}-{number}", mode), args.seconds)
                    rates[mode].append(got.rate_after(SETTLED_AFTER))
                    if mode == "auto":
                        autos.append(got)
            burst_target = target("burst", "auto")
            burst = sampled(crew, kit, burst_target, 5.0)
        time.sleep(10.0)  # the quiet after the burst: nothing grows it
        after_quiet = kit.store.counter(burst_target.name)
        with Crew(args.fewer) as crew:
            fewer = sampled(crew, kit, target("fewer", "auto"), args.seconds)
        with Crew(1) as crew:
            slow = sampled(crew, kit, target("slow", "auto", pause=0.5), args.slow)
        for name in made:
            kit.delete(name)
    medians = {mode: statistics.median(got) for mode, got in rates.items()}
    best = max((mode for mode in modes if mode != "auto"), key=lambda mode: medians[mode])
    table = Table(
        title=f"One hot counter, {args.writers} writer processes: writes/s from "
        f"{SETTLED_AFTER:g} s after the load started, medians of {args.repeat} rounds"
    )
    for column in ("counter", "shards", "writes/s", "vs best fixed", "rounds"):
        table.add_column(column, justify="left" if column in ("counter", "rounds") else "right")
    for mode in modes:
        shards = str(mode) if mode != "auto" else " ".join(str(a.shards[-1]) for a in autos)
        table.add_row(
            f"{mode}" if mode == "auto" else f"fixed {mode}",
            shards,
            f"{medians[mode]:,.0f}",
            f"{medians[mode] / medians[best]:.2f}x",
            " ".join(f"{rate:,.0f}" for rate in rates[mode]),
        )
    console.print(table)
    last = autos[-1]
    series = zip(
        last.times, last.times[1:], last.shards, last.totals, last.totals[1:], strict=False
    )
    console.print(
        "auto, the last round over time (s: shards, writes/s): "
        + ", ".join(f"{t:.1f}: {s}, {(b - a) / (u - t):,.0f}" for t, u, s, a, b in series if u > t)
    )
    ratio = medians["auto"] / medians[best]
    checks = [
        (f"auto ÷ the best fixed count ({best}) {ratio:.2f}x ≥ 0.9x", ratio >= 0.9),
        (
            f"{args.fewer} writers settle below {args.writers}: "
            f"{fewer.shards[-1]} < {autos[-1].shards[-1]}",
            fewer.shards[-1] < autos[-1].shards[-1],
        ),
        (
            f"2 writes/s for {args.slow:g} s stay at 1 shard: {slow.shards[-1]}",
            slow.shards[-1] == 1,
        ),
        (
            f"a 5 s burst grows it once ({burst.growths}), and the quiet after it not "
            f"({burst.shards[-1]} → {after_quiet.shards if after_quiet else '?'})",
            burst.growths == 1
            and after_quiet is not None
            and after_quiet.shards == burst.shards[-1],
        ),
    ]
    for text, held in checks:
        console.print(f"{text} {'[green]✓[/]' if held else '[red]✗[/]'}")
    console.print("every total exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
