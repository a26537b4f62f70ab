"""``benchmarks/compare.py``: this revision against a copy of it made slower, wrong and
short of a path on purpose, each side installed and run as the command does it."""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from backends import REDIS, ROOT, STORE_URLS, require

# Appended to the copy's shardkit/__init__.py, through the public API alone: the sharded
# counter's increment sleeps 20 ms (a few times what one costs), the buffered counter's
# acknowledges every other increment without making it (fast because wrong), and the
# kit has no id allocator (a path this revision lacks).
SABOTAGE = """

import time as _time

from shardkit.kit import Kit as _Kit


class _Sabotaged:
    def __init__(self, counter, incr):
        self._counter, self.incr = counter, incr

    def __getattr__(self, name):
        return getattr(self._counter, name)


def _slowed(counter):
    def incr(*args, **kwargs):
        _time.sleep(0.02)
        return counter.incr(*args, **kwargs)

    return _Sabotaged(counter, incr)


def _lossy(counter):
    calls = [0]

    def incr(*args, **kwargs):
        calls[0] += 1
        return True if calls[0] % 2 else counter.incr(*args, **kwargs)

    return _Sabotaged(counter, incr)


_sharded, _buffered = _Kit.sharded, _Kit.buffered
_Kit.sharded = lambda self, *args, **kwargs: _slowed(_sharded(self, *args, **kwargs))
_Kit.buffered = lambda self, *args, **kwargs: _lossy(_buffered(self, *args, **kwargs))
del _Kit.ids
"""


def sabotaged_copy(where: Path) -> Path:
    """A clone of this repository whose HEAD is this one's HEAD and the sabotage."""
    subprocess.run(["git", "clone", "--quiet", "--shared", str(ROOT), str(where)], check=True)
    with (where / "src" / "shardkit" / "__init__.py").open("a") as init:
        init.write(SABOTAGE)
    identity = ["-c", "user.name=test", "-c", "user.email=test@localhost"]
    commit = [*identity, "commit", "--quiet", "--all", "--message", "sabotaged"]
    subprocess.run(["git", "-C", str(where), *commit], check=True)
    return where


def row_of(markdown: str, path: str) -> list[str]:
    """The cells of ``path``'s row in the result's summary table."""
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {path} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.slow
def test_a_slower_path_and_a_wrong_count_fail_the_comparison(tmp_path: Path) -> None:
    """HEAD (A) against HEAD with the sabotage (B), two rounds of half a second with one
    writer: the sharded path is named slower (B ÷ A far below 1), the buffered one
    wrong at B alone, the ids path missing at B; the exit status is 1."""
    postgres = STORE_URLS["postgres"]
    assert postgres is not None
    require(postgres)
    require(REDIS)
    repo = sabotaged_copy(tmp_path / "repo")
    out = tmp_path / "result.md"
    command = [
        *(sys.executable, str(ROOT / "benchmarks" / "compare.py"), "HEAD~1", "HEAD"),
        *("--repo", str(repo), "--paths", "sharded,buffered,ids", "--threshold", "50"),
        *("--writers", "1", "--seconds", "0.5", "--rounds", "2"),
        *("--store", postgres, "--cache", REDIS),
        *("--workdir", str(tmp_path / "work"), "--out", str(out)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    shown = done.stdout[-5000:] + done.stderr[-5000:]
    assert done.returncode == 1, shown
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("SLOWER")] == [
        "SLOWER sharded"
    ], shown
    named = [line for line in lines if line.startswith(("WRONG", "FAILED", "MISSING"))]
    assert len(named) == 3, shown
    assert named[0].startswith("WRONG buffered at B: round 1: moved "), shown
    assert named[1].startswith("WRONG buffered at B: round 2: moved "), shown
    assert named[2].startswith("MISSING ids at B: missing: "), shown
    result = out.read_text()
    _, _, _, ratio, *_, checked = row_of(result, "sharded")
    assert float(re.split(r"\s", ratio)[0]) < 0.5, result
    assert checked == "✓"
    assert row_of(result, "buffered")[-1] == "✗"
    assert row_of(result, "ids")[-1] == "missing at B"


@functools.cache
def compare_module() -> ModuleType:
    """``benchmarks/compare.py`` imported as a module (it imports no shardkit)."""
    spec = importlib.util.spec_from_file_location("compare", ROOT / "benchmarks" / "compare.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare"] = module  # where its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_each_path_runs_its_pair_of_rounds_in_turn_a_b_then_b_a() -> None:
    compare = compare_module()
    assert list(compare.schedule(["x", "y", "z"], 3)) == [
        (0, "x", "AB"),
        (0, "y", "AB"),
        (0, "z", "AB"),
        (1, "y", "BA"),
        (1, "z", "BA"),
        (1, "x", "BA"),
        (2, "z", "AB"),
        (2, "x", "AB"),
        (2, "y", "AB"),
    ]


@pytest.mark.parametrize(
    ("by", "b_rates", "b_cpu", "slower"),
    [
        # B ÷ A by round: 0.80, 0.95, 0.88: the median, 0.88, is 12% slower.
        ("rate", [80.0, 95.0, 88.0], [1.0, 1.0, 1.0], "SLOWER p: 12% slower at B (bbbbbbb)"),
        ("rate", [80.0, 95.0, 91.0], [1.0, 1.0, 1.0], None),  # 9% slower: within 10%
        ("rate", [120.0, 125.0, 130.0], [2.0, 2.0, 2.0], None),  # faster, though costlier
        ("cpu", [120.0, 125.0, 130.0], [1.2, 1.1, 1.3], "SLOWER p: 20% more CPU per operation"),
        ("cpu", [80.0, 80.0, 80.0], [1.05, 1.1, 1.0], None),
    ],
)
def test_a_path_is_slower_by_the_median_of_its_rounds_ratios(
    by: str, b_rates: list[float], b_cpu: list[float], slower: str | None
) -> None:
    """B ÷ A is the median of each round's B over A; past the threshold (10%), the path
    is named and the run fails."""
    compare = compare_module()
    result = compare.Result()
    for number in range(3):
        result.sides["A"].rates[number], result.sides["A"].cpu[number] = 100.0, 1.0
        result.sides["B"].rates[number] = b_rates[number]
        result.sides["B"].cpu[number] = b_cpu[number]
    args = compare.parse_args(["a", "b", "--by", by])
    b = compare.Revision("B", "b", "b" * 40, "2026-12-03", "")
    verdict = compare.judge({"p": result}, args, b)
    if slower is None:
        assert verdict == compare.Verdict([], failed=False)
    else:
        (line,) = verdict.lines
        assert line.startswith(slower), line
        assert verdict.failed
