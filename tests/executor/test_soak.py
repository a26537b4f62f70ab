"""A long uptime, compressed to seconds: the soak benchmark's steady load as a test."""

from __future__ import annotations

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
