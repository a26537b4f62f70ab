"""The command line's own cost: what a script pays to call ``shardkit``.

* ``--help``     - ``shardkit --help``: the interpreter, the imports, Click
* ``get``        - ``shardkit get NAME`` of an existing counter on a SQLite file
* ``ids``        - ``shardkit ids NAME --count N``, printed one per line to a pipe
* ``ids (API)``  - the same N ids taken and printed by a Python process of its own
                   (``kit.ids(name).take(N)``): what the command is compared with

Each is a new process, timed from start to exit; medians of ``--repeat`` runs with
their spread (min-max). The ids of every run are checked: N, increasing, none twice.

    python benchmarks/cli.py --count 100000 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import shardkit

API = """
import sys, shardkit
with shardkit.connect(sys.argv[1]) as kit:
    print("\\n".join(map(str, kit.ids(sys.argv[2]).take(int(sys.argv[3])))))
"""


def timed(command: list[str]) -> tuple[float, str]:
    """Seconds ``command`` took, start to exit, and what it printed."""
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return time.perf_counter() - started, done.stdout


def checked_ids(printed: str, count: int) -> None:
    ids = [int(line) for line in printed.split()]
    if len(ids) != count or ids != sorted(set(ids)):
        raise SystemExit(f"wrong ids: {len(ids)} printed, {count} asked")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000, help="ids per run")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each")
    args = parser.parse_args()
    shardkit_command = [sys.executable, "-m", "shardkit"]
    with tempfile.TemporaryDirectory() as where:
        url = f"sqlite:///{Path(where) / 'cli.db'}"
        with shardkit.connect(url) as kit:
            kit.sharded("views").incr(5)
        base = [*shardkit_command, "--store", url]
        api = [sys.executable, "-c", API, url]
        modes = {
            "--help": lambda run: [*shardkit_command, "--help"],
            "get": lambda run: [*base, "get", "views"],
            "ids": lambda run: [*base, "ids", f"cli-{run}", "--count", str(args.count)],
            "ids (API)": lambda run: [*api, f"api-{run}", str(args.count)],
        }
        seconds: dict[str, list[float]] = {mode: [] for mode in modes}
        for run in range(args.repeat):
            order = list(modes)[run % len(modes) :] + list(modes)[: run % len(modes)]
            for mode in order:  # rotated: no mode always runs first
                took, printed = timed(modes[mode](run))
                if mode.startswith("ids"):
                    checked_ids(printed, args.count)
                seconds[mode].append(took)
    table = Table("command", "median s", "min-max s", "/ API")
    by_api = statistics.median(seconds["ids (API)"])
    for mode, runs in seconds.items():
        median = statistics.median(runs)
        versus = f"{median / by_api:.2f}x" if mode.startswith("ids") else ""
        table.add_row(mode, f"{median:.3f}", f"{min(runs):.3f}-{max(runs):.3f}", versus)
    Console().print(table)
    print(f"{time.strftime('%Y-%m-%d')}, {args.repeat} runs, {args.count:,} ids a run")


if __name__ == "__main__":
    main()
