"""What the benchmarks share to run their grids and compare their cells: a crew per
writer count running every mode in turn (``run_grid``), medians and ratios of rates.
The writer processes themselves are the demo's (``shardkit.demo.Crew``)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Protocol

from rich.console import Console

from shardkit.demo import Crew, Phase


def run_grid(
    writer_counts: list[int],
    repeat: int,
    modes: list[str],
    run: Callable[[Crew, int, str], None],
    console: Console,
    threads: int = 1,
) -> None:
    """Call ``run(crew, writers, mode)`` ``repeat`` times for every writer count and mode,
    modes interleaved within each repetition, each repetition starting one mode further
    on (every mode takes each place in turn), one crew (of ``threads`` threads per
    writer) per writer count."""
    each = "" if threads == 1 else f" x {threads} threads"
    for writers in writer_counts:
        with Crew(writers, threads) as crew:
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
