"""A long uptime, compressed to seconds: the soak benchmark's steady load as a test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from backends import ROOT


@pytest.mark.slow
def test_a_short_soak_keeps_every_count_and_its_queues_bounded() -> None:
    """``benchmarks/soak.py --sustain`` for seconds: 50 buffered counters flushed every
    0.05 s under steady increments, keyed sharded writes, ids and mapping jobs; every
    count exact, and never more tasks waiting than a flush per counter and a job's
    ranges (status 0)."""
    script = ROOT / "benchmarks" / "soak.py"
    args = ["--sustain", "6", "--sample", "1", "--from", "2", "--job-every", "2"]
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "every count exact: True" in done.stdout


@pytest.mark.slow
def test_soak_rounds_keep_their_fork_hooks_steady() -> None:
    """``benchmarks/soak.py`` in rounds: the "fork hooks" column counts the objects
    registered for a reset in a forked child — a kit's backends and each counter it
    holds open (its combiners: one a sharded counter, two a buffered one) — so with the
    rounds' 100 counters it is over 150, and the same at every round (a kit opened and
    closed each round leaves none behind)."""
    script = ROOT / "benchmarks" / "soak.py"
    done = subprocess.run(
        [sys.executable, str(script), "--rounds", "6", "--every", "2"],
        env={**os.environ, "COLUMNS": "160"},  # the table's header on one line
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    header = next(line for line in done.stdout.splitlines() if "fork hooks" in line)
    column = [cell.strip() for cell in header.split("┃")].index("fork hooks")
    rows = [line.split("│") for line in done.stdout.splitlines() if line.startswith("│")]
    hooks = {int(row[column].replace(",", "")) for row in rows}
    assert len(rows) == 3  # rounds 2, 4 and 6
    assert len(hooks) == 1, hooks
    assert hooks.pop() > 150
