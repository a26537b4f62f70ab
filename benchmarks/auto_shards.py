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
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from rich.table import Table

import shardkit
from hot_counter import report_console
from shardkit.demo import Crew, Op, Phase

PREFIX = "bench_auto_"
SETTLED_AFTER = 3.0  # seconds: the automatic counter's rate is taken from then on


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
        writes counted) to the last sample that found more."""
        start = next(i for i, n in enumerate(self.totals) if n > 0)
        end = max(i for i in range(1, len(self.totals)) if self.totals[i] > self.totals[i - 1])
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
            done.wait(0.5)

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
    times.append(times[-1] + 0.5 if times else 0.0)
    shards.append(kit.store.counter(target.name).shards)  # type: ignore[union-attr]
    totals.append(total)
    return Sampled(phase, times, shards, totals)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--cache", default="redis://127.0.0.1:6379/12")
    parser.add_argument("--writers", type=int, default=16, help="writer processes (16)")
    parser.add_argument("--fewer", type=int, default=4, help="the smaller crew (4)")
    parser.add_argument("--seconds", type=float, default=6.0, help="per phase (6)")
    parser.add_argument("--grid", default="1,2,4,8,16,32,64", help="fixed shard counts")
    parser.add_argument("--slow", type=float, default=60.0, help="the slow phase (60 s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = report_console()
    run = uuid.uuid4().hex[:8]

    def target(label: str, shards: int | str, pause: float = 0.0) -> Target:
        return Target(args.store, args.cache, f"auto:{run}:{label}", shards, pause)

    grid = [int(n) for n in args.grid.split(",")]
    table = Table(title=f"One hot counter, {args.writers} writer processes (writes/s)")
    for column in ("counter", "shards", "writes/s", "vs best fixed", "exact"):
        table.add_column(column, justify="left" if column == "counter" else "right")
    with shardkit.connect(args.store, args.cache, prefix=PREFIX) as kit:
        with Crew(args.writers) as crew:
            fixed = {n: crew.run(writer, target(f"fixed{n}", n), args.seconds) for n in grid}
            auto = sampled(crew, kit, target("auto", "auto"), args.seconds)
            burst = sampled(crew, kit, target("burst", "auto"), 5.0)
        quiet = burst.shards[-1]
        time.sleep(10.0)  # the quiet after the burst: nothing grows it
        after_quiet = kit.store.counter(target("burst", "auto").name)
        with Crew(args.fewer) as crew:
            fewer = sampled(crew, kit, target("fewer", "auto"), args.seconds)
        with Crew(1) as crew:
            slow = sampled(crew, kit, target("slow", "auto", pause=0.5), args.slow)
        for label in ("auto", "burst", "fewer", "slow", *(f"fixed{n}" for n in grid)):
            kit.delete(f"auto:{run}:{label}")
    best = max(fixed, key=lambda n: fixed[n].rate)
    for n, phase in fixed.items():
        table.add_row(f"fixed {n}", str(n), f"{phase.rate:,.0f}", "", "✓")
    settled = auto.rate_after(SETTLED_AFTER)
    table.add_row(
        f"auto, from {SETTLED_AFTER:g} s",
        str(auto.shards[-1]),
        f"{settled:,.0f}",
        f"{settled / fixed[best].rate:.2f}x",
        "✓",
    )
    console.print(table)
    console.print(
        "auto, over time (s: shards, writes/s): "
        + ", ".join(
            f"{t:.1f}: {s}, {(b - a) / (u - t):,.0f}"
            for t, u, s, a, b in zip(
                auto.times, auto.times[1:], auto.shards, auto.totals, auto.totals[1:], strict=False
            )
            if u > t
        )
    )
    ratio = settled / fixed[best].rate
    checks = [
        (f"auto from {SETTLED_AFTER:g} s ÷ the best fixed ({best}) ≥ 0.9x", ratio >= 0.9),
        (
            f"{args.fewer} writers settle below {args.writers}: "
            f"{fewer.shards[-1]} < {auto.shards[-1]}",
            fewer.shards[-1] < auto.shards[-1],
        ),
        (
            f"2 writes/s for {args.slow:g} s stay at 1 shard: {slow.shards[-1]}",
            slow.shards[-1] == 1,
        ),
        (
            f"a 5 s burst grows it once ({burst.growths}), and the quiet after it not "
            f"({quiet} → {after_quiet.shards if after_quiet else '?'})",
            burst.growths == 1 and after_quiet is not None and after_quiet.shards == quiet,
        ),
    ]
    for text, held in checks:
        console.print(f"{text} {'[green]✓[/]' if held else '[red]✗[/]'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
