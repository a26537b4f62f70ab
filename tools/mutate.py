"""Mutation testing with mutmut: each module's mutants against the fast tests that cover
it, and a table of what they killed::

    python tools/mutate.py                                  # the core modules (CORE)
    python tools/mutate.py src/shardkit/mapper/keys.py      # one module, its tests
    python tools/mutate.py src/shardkit/kit.py --tests tests/counters/test_sharded.py

A module of ``CORE`` runs against the tests listed for it; any other against the test
files that import it (``--tests`` names others: files, node ids or pytest options).
Each module runs in a scratch directory of its own (``src/``, ``tests/`` and
``examples/`` linked, ``pyproject.toml`` copied with mutmut's settings added), so runs
share no state and the repository is left as it was; ``--keep`` leaves the directory for
``mutmut show NAME`` and ``mutmut browse`` there. Tests run in one process each
(``-n 0``; mutmut runs ``--jobs`` mutants at once), under the ``mutation`` Hypothesis
profile (``tests/conftest.py``: the ``ci`` profile's examples, no shrinking).

A mutant is killed when a test fails or times out. A survivor listed in
``tests/mutation/equivalent.toml`` (its name, its mutated line, why no test can tell it
from the original) counts as equivalent; an entry whose line is no longer the mutant's
counts for nothing. Exit status 1 when a survivor is neither killed nor listed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = ROOT / "tests/mutation/equivalent.toml"
# The core's modules and the fast tests that cover them: no service, SQLite at most.
CORE: dict[str, tuple[str, ...]] = {
    "src/shardkit/validation.py": (
        "tests/validation/test_validation_bounds.py",
        "tests/validation/test_validation.py",
    ),
    "src/shardkit/_program.py": ("tests/counters/test_program.py",),
    "src/shardkit/_combine.py": (
        "tests/counters/test_combine.py::test_a_lone_caller_writes_its_own_batch_at_once",
        "tests/counters/test_combine.py::test_callers_arriving_during_a_write_share_the_next_one",
        "tests/counters/test_combine.py::"
        "test_a_failed_batch_raises_for_each_of_its_callers_and_the_next_batch_goes_on",
        "tests/counters/test_combine.py::test_many_threads_get_exactly_their_own_results",
        "tests/counters/test_combine.py::test_a_caller_interrupted_while_queued_takes_its_item_out",
        "tests/counters/test_combine.py::test_a_child_forked_during_a_write_combines_afresh",
        "tests/counters/test_batches.py",
    ),
    "src/shardkit/counters/sizing.py": (
        "tests/counters/test_auto_shards.py::test_sizing_waits_for_busy_contended_windows_and_settles",
        "tests/counters/test_sizing.py",
    ),
    "src/shardkit/mapper/keys.py": ("tests/mapper/test_keys.py",),
    "src/shardkit/mapper/planning.py": ("tests/mapper/test_planning.py",),
}
KILLED = {"killed", "timeout", "segfault"}  # a test failed, or the run never ended


@dataclass
class Outcome:
    """One module's run: each mutant's status, the survivors listed as equivalent."""

    module: str
    seconds: float
    status: dict[str, str]
    equivalent: set[str] = field(default_factory=set)
    stale: dict[str, str] = field(default_factory=dict)  # listed, but the line differs

    @property
    def killed(self) -> int:
        return sum(status in KILLED for status in self.status.values())

    @property
    def survivors(self) -> list[str]:
        """The mutants neither killed nor listed as equivalent."""
        return [
            name
            for name, status in self.status.items()
            if status not in KILLED and name not in self.equivalent
        ]


def tests_of(module: str) -> list[str]:
    """The tests a module runs against: ``CORE``'s, else the test files importing it."""
    if module in CORE:
        return list(CORE[module])
    dotted = Path(module).relative_to("src").with_suffix("").as_posix().replace("/", ".")
    parent, _, leaf = dotted.rpartition(".")
    imports = re.compile(rf"\b{re.escape(dotted)}\b|from {re.escape(parent)} import .*\b{leaf}\b")
    found = [
        path.relative_to(ROOT).as_posix()
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if imports.search(path.read_text())
    ]
    if not found:
        raise SystemExit(f"no test file imports {dotted}: name them with --tests")
    return found


def configure(scratch: Path, module: str, tests: list[str]) -> None:
    """Lay out ``scratch`` for mutmut: the tree linked, pyproject.toml with its settings."""
    for name in ("src", "tests", "examples"):
        (scratch / name).symlink_to(ROOT / name, target_is_directory=True)
    settings = {
        "source_paths": ["src"],
        "only_mutate": [module],
        "also_copy": ["examples"],
        # After pyproject.toml's addopts: one process, nothing cached between runs.
        "pytest_add_cli_args": ["-n", "0", "-p", "no:cacheprovider"],
        "pytest_add_cli_args_test_selection": tests,
    }
    lines = ["", "[tool.mutmut]", *(f"{key} = {json.dumps(val)}" for key, val in settings.items())]
    text = (ROOT / "pyproject.toml").read_text()
    (scratch / "pyproject.toml").write_text(text + "\n".join(lines) + "\n")


def mutmut(scratch: Path, *args: str, log: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run mutmut in ``scratch`` (this interpreter's, importing the mutated copy only);
    its output captured, or written to ``log``."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["HYPOTHESIS_PROFILE"] = "mutation"
    command = [str(Path(sys.executable).with_name("mutmut")), *args]
    if log is None:
        return subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True)
    with log.open("w") as out:
        return subprocess.run(command, cwd=scratch, env=env, stdout=out, stderr=out, text=True)


def mutated_lines(scratch: Path, name: str) -> list[str]:
    """The lines ``name`` puts in place of the original's, stripped."""
    diff = mutmut(scratch, "show", name).stdout.splitlines()
    return [line[1:].strip() for line in diff if line[:1] == "+" and line[:3] != "+++"]


def run(module: str, tests: list[str], jobs: int, keep: bool, listed: dict[str, str]) -> Outcome:
    """Mutate ``module``, run its mutants against ``tests``; what became of each."""
    scratch = Path(tempfile.mkdtemp(prefix="shardkit-mutation-"))
    try:
        configure(scratch, module, tests)
        log = scratch / "mutmut.log"
        print(f"{module}: against {' '.join(tests)}; progress in {log}", flush=True)
        start = time.monotonic()
        done = mutmut(scratch, "run", "--max-children", str(jobs), log=log)
        seconds = time.monotonic() - start
        results = mutmut(scratch, "results", "--all", "true")
        status = dict(
            line.strip().rsplit(": ", 1) for line in results.stdout.splitlines() if ": " in line
        )
        if done.returncode != 0 or not status:
            raise SystemExit(f"mutmut failed on {module}:\n{log.read_text()[-3000:]}")
        outcome = Outcome(module, seconds, status)
        for name in outcome.survivors:
            if name in listed:
                if listed[name] in mutated_lines(scratch, name):
                    outcome.equivalent.add(name)
                else:
                    outcome.stale[name] = listed[name]
        for name in outcome.survivors:
            print(f"\nsurvived ({status[name]}): {name}")
            print(mutmut(scratch, "show", name).stdout.rstrip())
        for name, line in outcome.stale.items():
            print(f"\n{EQUIVALENT.name} lists {name} as {line!r}: no longer its line")
        return outcome
    finally:
        if keep:
            print(f"kept: {scratch} (mutmut show NAME, mutmut browse)")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def table(outcomes: list[Outcome]) -> str:
    """The summary, as a Markdown table (the dated records in tests/mutation/ hold it)."""
    rows = [
        "| module | mutants | killed | survived | equivalent | killed % | time |",
        "| --- | --: | --: | --: | --: | --: | --: |",
    ]
    for o in [*outcomes, None] if len(outcomes) > 1 else outcomes:
        if o is None:  # the total
            name = "all"
            mutants = sum(len(x.status) for x in outcomes)
            killed = sum(x.killed for x in outcomes)
            survived = sum(len(x.survivors) for x in outcomes)
            equivalent = sum(len(x.equivalent) for x in outcomes)
            seconds = sum(x.seconds for x in outcomes)
        else:
            name, mutants, killed = f"`{o.module}`", len(o.status), o.killed
            survived, equivalent, seconds = len(o.survivors), len(o.equivalent), o.seconds
        share = 100 * killed / mutants if mutants else 0.0
        rows.append(
            f"| {name} | {mutants:,} | {killed:,} | {survived:,} | {equivalent:,} "
            f"| {share:.1f} | {int(seconds // 60)} min {round(seconds % 60)} s |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", default=list(CORE), help="src/shardkit/… files")
    parser.add_argument("--tests", nargs="+", help="the tests to run (pytest arguments)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants at once")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directories")
    args = parser.parse_args()
    listed = {
        entry["mutant"]: entry["line"]
        for entry in tomllib.loads(EQUIVALENT.read_text()).get("equivalent", [])
    }
    mutmut_version = subprocess.run(
        [str(Path(sys.executable).with_name("mutmut")), "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    load = os.getloadavg()[0]
    outcomes = []
    for module in args.modules:
        module = Path(module).resolve().relative_to(ROOT).as_posix()
        tests = args.tests or tests_of(module)
        outcomes.append(run(module, tests, args.jobs, args.keep, listed))
    print(f"\n{mutmut_version}, {args.jobs} jobs, {os.cpu_count()} cores, load {load:.1f} at start")
    print(table(outcomes))
    return 1 if any(o.survivors or o.stale for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
