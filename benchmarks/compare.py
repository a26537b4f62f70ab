"""Two revisions of shardkit side by side: the hot paths of each, in one run, as a ratio.

Each revision is installed from ``git archive`` into a virtual environment of its own,
made by uv and kept under ``--workdir`` by commit (a second run reuses it), with the same
extras and the same pinned dependencies (``.ci/constraints.txt``), so that only shardkit
differs. Each gets a PostgreSQL database of its own, created on ``--store``'s server and
dropped at the end, and its own keys in the Redis ``--cache`` (under its kits' namespaces,
which differ by database; deleted at the end). ``compare_driver.py`` runs in each
revision's environment and writes through its public API with the harness's writer
processes; the two take turns, round after round, each path's pair of rounds in the order
A, B then B, A (the paths rotated too), so that the machine's drift falls on both.

Per path: the median rate of each revision with its spread, and B ÷ A: the median of
each round's ratio (its pair ran back to back) with their spread; the same for the CPU
per operation. Every round is checked as the other benchmarks are (every acknowledged
write counted). Exit status 1 when a path is more than ``--threshold`` percent slower at
B, a check failed or a path failed; a path that a revision lacks is reported missing.

    python benchmarks/compare.py 3afbc35 main
    python benchmarks/compare.py HEAD~1 HEAD --paths sharded,buffered --rounds 7 \\
        --out benchmarks/results/2026-12-03-compare-sharded.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATHS = ("sharded", "buffered", "ids", "django", "map")
DEFAULT_STORE = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_CACHE = "redis://127.0.0.1:6379/12"  # the benchmarks' database (tests/README.md)
DEFAULT_EXTRAS = "postgres,redis,django"
UNITS = {"map": "rows/s"}
"""What a path's rate counts (the others: acknowledged writes or ids per second)."""


@dataclass(frozen=True)
class Revision:
    """One side of the comparison."""

    label: str
    """``A`` or ``B``."""
    given: str
    """As named on the command line."""
    commit: str
    day: str
    """Its commit's date."""
    subject: str

    @property
    def short(self) -> str:
        return self.commit[:7]


@dataclass
class Side:
    """One revision's rounds of one path."""

    rates: dict[int, float] = field(default_factory=dict)
    """Per round: acknowledged writes (ids, updates, rows) a second."""
    cpu: dict[int, float] = field(default_factory=dict)
    """Per round: CPU seconds per operation."""
    wrong: list[str] = field(default_factory=list)
    """Each inexact round's detail."""
    errors: list[str] = field(default_factory=list)


@dataclass
class Result:
    """One path: each revision's rounds, or why it was not compared."""

    sides: dict[str, Side] = field(default_factory=lambda: {"A": Side(), "B": Side()})
    missing: dict[str, str] = field(default_factory=dict)
    """Per label: why the path cannot run at that revision."""

    def ratios(self, what: str) -> list[float]:
        """Each round's B ÷ A of ``rates`` or ``cpu`` (the rounds both sides ran)."""
        a, b = getattr(self.sides["A"], what), getattr(self.sides["B"], what)
        return [b[n] / a[n] for n in sorted(a.keys() & b.keys()) if a[n] > 0]


def run_quietly(command: list[str], **options: Any) -> str:
    """Run ``command``; its output, or ``SystemExit`` showing what it printed."""
    done = subprocess.run(command, capture_output=True, text=True, check=False, **options)
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(command)} exited with {done.returncode}:\n{done.stdout[-2000:]}"
            f"{done.stderr[-4000:]}"
        )
    return str(done.stdout)


def resolve(repo: Path, given: str, label: str) -> Revision:
    """The commit ``given`` names in ``repo``."""
    git = ["git", "-C", str(repo)]
    commit = run_quietly([*git, "rev-parse", "--verify", f"{given}^{{commit}}"]).strip()
    day, subject = run_quietly([*git, "log", "-1", "--format=%cs%x00%s", commit]).split("\0", 1)
    return Revision(label, given, commit, day, subject.strip())


def uv_binary() -> str:
    """uv: the ``uv`` package's (the test extra has it), or one on ``PATH``."""
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except ImportError:
        found = shutil.which("uv")
        if found is None:
            raise SystemExit("compare.py needs uv: pip install uv") from None
        return found


def environment(repo: Path, revision: Revision, args: argparse.Namespace) -> Path:
    """The Python of ``revision``'s environment under ``--workdir``: shardkit with
    ``--extras`` installed from the commit's tree, constrained by ``--constraints``; made
    once per commit, extras, constraints and Python."""
    constraints = Path(args.constraints).read_text() if args.constraints else ""
    key = json.dumps([revision.commit, args.extras, constraints, sys.version])
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    home = Path(args.workdir) / f"{revision.commit[:12]}-{digest}"
    python = home / "venv" / "bin" / "python"
    if (home / "ready").is_file():
        return python
    shutil.rmtree(home, ignore_errors=True)  # a build cut short
    source = home / "src"
    source.mkdir(parents=True)
    archive = subprocess.Popen(
        ["git", "-C", str(repo), "archive", "--format=tar", revision.commit], stdout=subprocess.PIPE
    )
    run_quietly(["tar", "-x", "-C", str(source)], stdin=archive.stdout)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {revision.commit} failed")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if constraints:
        env["UV_CONSTRAINT"] = env["UV_BUILD_CONSTRAINT"] = str(Path(args.constraints).resolve())
    uv = uv_binary()
    venv = str(home / "venv")
    run_quietly([uv, "venv", "--quiet", "--no-project", "--python", sys.executable, venv], env=env)
    wanted = f"shardkit[{args.extras}] @ {source.as_uri()}"
    run_quietly([uv, "pip", "install", "--quiet", "--python", str(python), wanted], env=env)
    (home / "ready").write_text(f"{revision.commit}\n{args.extras}\n")
    return python


@contextlib.contextmanager
def database(server: str, label: str, revision: Revision) -> Iterator[str]:
    """A new PostgreSQL database on ``server``'s server for ``revision``, dropped at the
    end; its SQLAlchemy URL (psycopg)."""
    name = f"skcmp_{label.lower()}_{revision.short}_{uuid.uuid4().hex[:6]}"
    url = sa.make_url(server).set(drivername="postgresql+psycopg")
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with engine.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        engine.dispose()


class DriverDied(Exception):
    """A driver ended without answering: its log's last lines say why."""


class Driver:
    """``compare_driver.py`` running in a revision's environment, asked one command at a
    time."""

    def __init__(self, python: Path, store: str, args: argparse.Namespace, log: IO[str]) -> None:
        command = [
            str(python),
            str(HERE / "compare_driver.py"),
            *("--store", store, "--cache", args.cache),
            *("--writers", str(args.writers), "--interval", str(args.interval)),
            *("--rows", str(args.rows)),
        ]
        # This environment's Python path and shardkit's settings are not the revision's.
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("SHARDKIT_")
        }
        self.log = log
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
        )

    def ask(self, **command: Any) -> dict[str, Any]:
        self.send(**command)
        return self.receive()

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict[str, Any]:
        """The answer to the command sent last."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.log.flush()
            tail = Path(self.log.name).read_text().splitlines()[-15:]
            raise DriverDied(
                f"the driver {self.log.name} ended (exit {self.process.wait()}):\n"
                + "\n".join(tail)
            )
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        """Let it delete its keys and stop its writers; kill it if it does not end."""
        with contextlib.suppress(DriverDied, OSError):
            self.ask(op="close")
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def schedule(paths: list[str], rounds: int) -> Iterator[tuple[int, str, str]]:
    """``(round, path, order)``: the paths rotated a place each round, and each path's
    revisions in the order A, B in even rounds and B, A in odd ones."""
    for number in range(rounds):
        turn = number % len(paths)
        for path in paths[turn:] + paths[:turn]:
            yield number, path, "AB" if number % 2 == 0 else "BA"


def spread(given: Iterable[float], form: str) -> str:
    """The median of ``given`` with their least and greatest, in ``form``."""
    values = list(given)
    if not values:
        return "-"
    median = format(statistics.median(values), form)
    if len(values) == 1:
        return median
    return f"{median} ({format(min(values), form)}-{format(max(values), form)})"


@dataclass(frozen=True)
class Verdict:
    lines: list[str]
    failed: bool


def judge(results: dict[str, Result], args: argparse.Namespace, b: Revision) -> Verdict:
    """The lines that say what failed, was missing or is slower at B, and whether the run
    failed (anything but a missing path)."""
    lines, failed = [], False
    for path, result in results.items():
        for label, why in result.missing.items():
            absent = why.startswith("missing")
            lines.append(f"{'MISSING' if absent else 'FAILED'} {path} at {label}: {why}")
            failed = failed or not absent
        for label, side in result.sides.items():
            for error in side.errors:
                lines.append(f"FAILED {path} at {label}: {error}")
                failed = True
            for detail in side.wrong:
                lines.append(f"WRONG {path} at {label}: {detail}")
                failed = True
        ratios = result.ratios("rates" if args.by == "rate" else "cpu")
        if result.missing or not ratios:
            continue
        ratio = statistics.median(ratios)
        slower = 1 - ratio if args.by == "rate" else ratio - 1
        if slower * 100 > args.threshold:
            what = "slower" if args.by == "rate" else "more CPU per operation"
            lines.append(
                f"SLOWER {path}: {slower:.0%} {what} at B ({b.short}), B ÷ A "
                f"{spread(ratios, '.2f')}, past the threshold of {args.threshold:g}%"
            )
            failed = True
    return Verdict(lines, failed)


def rows(results: dict[str, Result]) -> Iterator[list[str]]:
    """The summary table's rows: per path, each side's rate and CPU per operation, B ÷ A
    of both, and whether every round was exact."""
    for path, result in results.items():
        a, b = result.sides["A"], result.sides["B"]
        if result.missing:
            why = ", ".join(f"{t.split(':')[0]} at {label}" for label, t in result.missing.items())
            yield [path, "-", "-", "-", "-", "-", "-", why]
            continue
        checked = "✓" if not (a.wrong or b.wrong or a.errors or b.errors) else "✗"
        yield [
            path,
            spread(a.rates.values(), ",.0f"),
            spread(b.rates.values(), ",.0f"),
            spread(result.ratios("rates"), ".2f"),
            spread([c * 1e6 for c in a.cpu.values()], ",.0f"),
            spread([c * 1e6 for c in b.cpu.values()], ",.0f"),
            spread(result.ratios("cpu"), ".2f"),
            checked,
        ]


HEADERS = ["path", "A /s", "B /s", "B ÷ A", "A µs CPU/op", "B µs CPU/op", "B ÷ A CPU", "checked"]


def shown_path(name: str) -> str:
    """``name`` relative to the repository when it lies in it."""
    path = Path(name).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def uptime() -> str:
    """``uptime``'s line, or the load averages where it is missing."""
    found = shutil.which("uptime")
    if found:
        return subprocess.run([found], capture_output=True, text=True, check=False).stdout.strip()
    return "load average: " + ", ".join(f"{n:.2f}" for n in os.getloadavg())


def markdown(
    revisions: tuple[Revision, Revision],
    results: dict[str, Result],
    verdict: Verdict,
    notes: dict[str, str],
    rounds: list[tuple[int, str, str]],
    args: argparse.Namespace,
) -> str:
    """The dated result: the revisions, the machine, the table, the verdict, each round."""
    a, b = revisions
    day = notes["started"][:10]
    out = [
        f"# The hot paths at {a.short} and {b.short}, side by side ({day})",
        "",
        f"`python benchmarks/compare.py {notes['command']}`, "
        f"started {notes['started']} UTC, {notes['took']}.",
        "",
        *(f"- {r.label}: `{r.commit}` ({r.day}, {r.given}): {r.subject}" for r in revisions),
        f"- Each revision in a virtual environment of its own: Python {notes['python']}, "
        f"`shardkit[{args.extras}]` from the commit's tree, dependencies pinned by "
        f"`{notes['constraints']}`; a PostgreSQL database of its own on "
        f"`{notes['store']}`, its own keys in `{args.cache}`.",
        f"- {args.writers} writer processes (the counters, ids, the Django update), "
        f"{args.seconds:g} s a round; `kit.map` over {args.rows:,} rows; {args.rounds} rounds, "
        "each path's pair A, B then B, A, the paths rotated.",
        f"- The machine ({os.cpu_count()} cores), `uptime` before: `{notes['before']}`; "
        f"after: `{notes['after']}`.",
        "",
        f"Medians of {args.rounds} rounds (least-greatest), measured {day} at {a.short} (A) "
        f"and {b.short} (B); B ÷ A is the median of each round's ratio. Rates are "
        "acknowledged writes (ids, updates) a second, rows a second for `map`; CPU is the "
        "writer processes' (the driver's for `map`) per operation:",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "| --- | " + " | ".join("--:" for _ in HEADERS[1:-1]) + " | :-: |",
        *("| " + " | ".join(row) + " |" for row in rows(results)),
        "",
        *(f"- {line}" for line in verdict.lines or ["No path more than the threshold slower."]),
        "",
        f"Each round, {day} ({a.short} A, {b.short} B), in the order run:",
        "",
        "| round | path | order | A /s | B /s | B ÷ A | A µs CPU/op | B µs CPU/op |",
        "| --: | --- | --- | --: | --: | --: | --: | --: |",
    ]
    for number, path, order in rounds:
        side_a, side_b = results[path].sides["A"], results[path].sides["B"]
        if number in side_a.rates and number in side_b.rates:
            ra, rb = side_a.rates[number], side_b.rates[number]
            out.append(
                f"| {number + 1} | {path} | {order} | {ra:,.0f} | {rb:,.0f} | {rb / ra:.2f} "
                f"| {side_a.cpu[number] * 1e6:,.0f} | {side_b.cpu[number] * 1e6:,.0f} |"
            )
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev_a", metavar="REV_A", help="the revision before (a commit, a branch)")
    parser.add_argument("rev_b", metavar="REV_B", help="the revision after")
    parser.add_argument("--repo", default=str(ROOT), help="the git repository (this one)")
    parser.add_argument("--store", default=DEFAULT_STORE, help=f"PostgreSQL ({DEFAULT_STORE})")
    parser.add_argument("--cache", default=DEFAULT_CACHE, help=f"Redis ({DEFAULT_CACHE})")
    parser.add_argument("--writers", type=int, default=16, help="writer processes (16)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds a round (3)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each path (5)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"of {','.join(PATHS)}")
    parser.add_argument("--rows", type=int, default=100_000, help="kit.map's rows (100000)")
    parser.add_argument("--interval", type=float, default=1.0, help="buffered flush interval (1)")
    parser.add_argument("--threshold", type=float, default=10.0, help="percent slower (10)")
    parser.add_argument(
        "--by",
        choices=("rate", "cpu"),
        default="rate",
        help="slower by rate (the default) or by CPU per operation (steadier on a busy machine)",
    )
    parser.add_argument("--extras", default=DEFAULT_EXTRAS, help=f"installed ({DEFAULT_EXTRAS})")
    parser.add_argument(
        "--constraints",
        default=str(ROOT / ".ci" / "constraints.txt"),
        help="pins for both environments ('' for none; default .ci/constraints.txt)",
    )
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    parser.add_argument(
        "--workdir",
        default=str(cache_home / "shardkit-compare"),
        help="where the environments are kept (~/.cache/shardkit-compare)",
    )
    parser.add_argument("--out", help="write the dated result (markdown) to this file")
    args = parser.parse_args(argv)
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = sorted(set(args.paths) - set(PATHS))
    if unknown or not args.paths:
        parser.error(f"--paths takes some of {','.join(PATHS)}, not {','.join(unknown)}")
    if args.writers < 1 or args.rounds < 1 or not args.seconds > 0 or args.rows < 1:
        parser.error("--writers, --rounds and --rows must be >= 1, --seconds > 0")
    return args


def measure(
    revisions: tuple[Revision, Revision],
    pythons: dict[str, Path],
    args: argparse.Namespace,
    console: Console,
) -> tuple[dict[str, Result], list[tuple[int, str, str]]]:
    """Start both drivers on databases of their own, prepare them together, and run the
    rounds: each path's results, and the rounds as run."""
    results = {path: Result() for path in args.paths}
    rounds: list[tuple[int, str, str]] = []
    with contextlib.ExitStack() as stack:
        drivers: dict[str, Driver] = {}
        for revision in revisions:
            store = stack.enter_context(database(args.store, revision.label, revision))
            log = stack.enter_context(
                open(Path(args.workdir) / f"driver-{revision.label}-{revision.short}.log", "w")
            )
            driver = Driver(pythons[revision.label], store, args, log)
            stack.callback(driver.close)
            drivers[revision.label] = driver
            driver.send(op="prepare", paths=args.paths)  # both prepare at once
        for revision in revisions:
            with console.status(f"preparing {revision.label} ({revision.short})…"):
                answer = drivers[revision.label].receive()
            if "error" in answer:
                raise DriverDied(f"{revision.label} could not start: {answer['error']}")
            console.print(
                f"{revision.label}: {revision.short} ({revision.day}) shardkit "
                f"{answer['version']}, {answer['file']}"
            )
            for path, why in answer["paths"].items():
                if why is not None:
                    results[path].missing[revision.label] = why
        for number, path, order in schedule(args.paths, args.rounds):
            result = results[path]
            if result.missing:
                continue
            rounds.append((number, path, order))
            for label in order:
                side = result.sides[label]
                with console.status(f"round {number + 1}, {path}, {label}…"):
                    answer = drivers[label].ask(op="run", path=path, seconds=args.seconds)
                if "error" in answer:
                    side.errors.append(f"round {number + 1}: {answer['error']}")
                    continue
                side.rates[number] = answer["rate"]
                side.cpu[number] = answer["cpu_per_op"]
                if not answer["exact"]:
                    side.wrong.append(f"round {number + 1}: {answer['detail']}")
    return results, rounds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 130)
    repo = Path(args.repo)
    revisions = (resolve(repo, args.rev_a, "A"), resolve(repo, args.rev_b, "B"))
    started = datetime.datetime.now(datetime.timezone.utc)
    notes = {
        "started": started.strftime("%Y-%m-%d %H:%M"),
        "python": sys.version.split()[0],
        "store": sa.make_url(args.store).render_as_string(),
        "command": " ".join(sys.argv[1:] if argv is None else argv),
        "constraints": shown_path(args.constraints) if args.constraints else "nothing",
    }
    with console.status("the revisions' environments…"), ThreadPoolExecutor(2) as pool:
        made = {r.commit: pool.submit(environment, repo, r, args) for r in revisions}
        pythons = {r.label: made[r.commit].result() for r in revisions}
    notes["before"] = uptime()
    try:
        results, rounds = measure(revisions, pythons, args, console)
    except DriverDied as exc:
        console.print(f"FAILED {exc}", style="red", markup=False, highlight=False)
        return 1
    notes["after"] = uptime()
    took = datetime.datetime.now(datetime.timezone.utc) - started
    notes["took"] = f"{took.total_seconds() / 60:.1f} min"
    a, b = revisions
    verdict = judge(results, args, b)
    table = Table(
        title=f"B ÷ A: {a.short} ({a.day}) → {b.short} ({b.day}), "
        f"medians of {args.rounds} rounds (least-greatest)"
    )
    for header in HEADERS:
        table.add_column(header, justify="left" if header == "path" else "right")
    for row in rows(results):
        table.add_row(*row)
    console.print(table)
    console.print(f"uptime before: {notes['before']}\nuptime after:  {notes['after']}")
    for line in verdict.lines:
        style = "yellow" if line.startswith("MISSING") else "red"
        console.print(line, style=style, markup=False, highlight=False, soft_wrap=True)
    if not verdict.failed:
        console.print(f"no path more than {args.threshold:g}% slower at B", style="green")
    if args.out:
        Path(args.out).write_text(markdown(revisions, results, verdict, notes, rounds, args))
        console.print(f"written to {args.out}")
    return 1 if verdict.failed else 0


if __name__ == "__main__":
    sys.exit(main())
