"""The command line as scripts and people use it: user text printed verbatim (never
markup, never a terminal escape), JSON out, exit codes, commands that read creating
nothing, and tables that fit an 80x24 terminal (run in tmux, the screen captured)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from rich.cells import cell_len

import shardkit
from backends import PREFIX, store_url_for, wait_for
from shardkit.cli import main, shown

Run = Callable[..., tuple[int, str, str]]

# Names that pass validation and would be markup, emoji codes, bidirectional or wide text
# to a terminal that interpreted them, and names refused with an error that shows them.
HOSTILE = [
    "[/b]",
    "[bold]x[/bold]",
    "a[/b]",
    ":smile: [link=http://x]y[/link]",
    "rtl\u200fmark \u202eevil",
    "ünïcødé 日本 😀",
    "n" * 200,
]
REFUSED = ["\x1b[31mred", "tab\there", "line\nbreak", "x" * 201]


def invoke(store_url: str, prefix: str, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["--store", store_url, "--prefix", prefix, *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def run(sqlite_url: str) -> Run:
    """The command on the session's SQLite store, its tables made beforehand."""
    store_url_for("sqlite", sqlite_url)
    shardkit.connect(sqlite_url, prefix=PREFIX).close()
    return lambda *args: invoke(sqlite_url, PREFIX, *args)


class Own:
    """The command on a SQLite store of the test's own, empty (made by the first write)."""

    def __init__(self, path: Path) -> None:
        self.url = f"sqlite:///{path}"

    def __call__(self, *args: str) -> tuple[int, str, str]:
        return invoke(self.url, "own_", *args)


@pytest.fixture
def own(tmp_path: Path) -> Own:
    return Own(tmp_path / "own.db")


def _no_escape(*texts: str) -> None:
    for text in texts:
        assert "\x1b" not in text
        assert "\u202e" not in text
        assert "Traceback" not in text


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_name_goes_through_every_command_verbatim(own: Own, name: str) -> None:
    for before in (False, True):  # alone, then among other counters
        if before:
            assert own("incr", f"other-{uuid.uuid4().hex}")[0] == 0
        target = f"{name[:190]}{before:d}"
        code, out, err = own("incr", target, "--by", "3")
        assert (code, out, err) == (0, f"{shown(target)} +3\n", "")
        assert own("get", target) == (0, "3\n", "")
        assert json.loads(own("get", target, "--json")[1])["name"] == target
        code, out, err = own("list")
        assert code == 0
        _no_escape(out, err)
        assert shown(target) in out  # whole, on one line: piped output is never wrapped
        listed = [json.loads(line) for line in own("list", "--json")[1].splitlines()]
        assert {"name": target, "kind": "sharded", "shards": 1, "value": 3} in listed  # auto
        code, out, err = own("grow", target, "30")
        assert (code, out) == (0, f"{shown(target)}: 30 shards\n")
        code, out, err = own("flush", target)
        assert code == 1
        assert err == f"error: {shown(repr(target))} is a sharded counter: no flush\n"
        code, out, err = own("ids", f"{target[:180]}-ids{before:d}", "--count", "2")
        assert (code, out.split()) == (0, ["1", "2"])
        code, out, err = own("incr", target, "--buffered")
        assert code == 1
        _no_escape(out, err)
        assert err.count("\n") == 1
        assert own("reset", target, "--yes") == (0, f"{shown(target)}: reset (sharded)\n", "")
        assert own("get", target) == (0, "0\n", "")
        assert own("delete", target, "--yes") == (0, f"{shown(target)}: deleted (sharded)\n", "")
        code, out, err = own("get", target)
        assert (code, out) == (1, "")
        assert err == f"error: no counter named {shown(repr(target))} in {own.url}\n"


@pytest.mark.parametrize("name", REFUSED)
def test_a_refused_name_is_one_escaped_line_and_writes_nothing(own: Own, name: str) -> None:
    for command in (
        ("incr", name),
        ("get", name),
        ("ids", name),
        ("grow", name, "3"),
        ("delete", name, "--yes"),
        ("reset", name),
    ):
        code, out, err = own(*command)
        assert (code, out) == (1, "")
        _no_escape(err)
        assert err.startswith("error: ")
        assert err.count("\n") == 1
    assert own("list", "--json") == (0, "", "")


def test_shards_are_a_number_or_auto(run: Run, name: str) -> None:
    assert run("incr", name, "--shards", "auto")[0] == 0
    assert json.loads(run("get", name, "--json")[1])["shards"] == 1
    assert run("incr", name, "--shards", "4")[0] == 0  # grown to 4, as before
    assert json.loads(run("get", name, "--json")[1])["shards"] == 4
    code, _, err = run("incr", name, "--shards", "many")
    assert code == 2
    assert "'many' is neither a whole number nor auto" in err
    code, _, err = run("incr", f"{name}:m", "--monotonic", "--shards", "auto")
    assert code != 0
    assert "--shards auto is for sharded counters" in err
    assert run("get", f"{name}:m")[0] != 0  # refused before anything was written


def test_json_objects_have_the_documented_keys(run: Run, name: str) -> None:
    assert json.loads(run("incr", name, "--by", "4", "--json")[1]) == {
        "name": name,
        "kind": "sharded",
        "delta": 4,
        "applied": True,
    }
    assert json.loads(run("get", name, "--json")[1]) == {
        "name": name,
        "kind": "sharded",
        "value": 4,
        "shards": 1,  # automatic: one shard until its writers wait for each other
    }
    buffered = f"{name}:b"
    run("incr", buffered, "--buffered", "--by", "2")
    assert json.loads(run("get", buffered, "--json")[1]) == {
        "name": buffered,
        "kind": "buffered",
        "value": 2,
        "stored": 2,
        "pending": 0,
    }
    assert json.loads(run("flush", buffered, "--json")[1]) == {"moved": {buffered: 0}}
    monotonic = f"{name}:m"
    assert json.loads(run("incr", monotonic, "--monotonic", "--json")[1])["value"] == 1
    assert json.loads(run("get", monotonic, "--json")[1]).keys() == {
        "name",
        "kind",
        "value",
        "persisted",
    }
    taken = json.loads(run("ids", f"{name}:i", "--count", "3", "--json")[1])
    assert taken == {"name": f"{name}:i", "ids": [1, 2, 3]}
    assert json.loads(run("get", f"{name}:i", "--json")[1]) == {
        "name": f"{name}:i",
        "kind": "ids",
        "reserved": 1000,
    }
    assert json.loads(run("grow", name, "25", "--json")[1]) == {
        "name": name,
        "before": 1,
        "shards": 25,
    }
    assert json.loads(run("reset", name, "--yes", "--json")[1]) == {
        "name": name,
        "kind": "sharded",
        "shards": 25,
        "reset": True,
    }
    assert json.loads(run("delete", name, "--yes", "--json")[1]) == {
        "name": name,
        "kind": "sharded",
        "shards": 25,
        "deleted": True,
    }


def test_delete_and_reset_ask_first(run: Run, name: str, sqlite_url: str) -> None:
    run("incr", name, "--by", "7")

    def answer(command: str, reply: str, counter: str = name) -> tuple[int, str, str]:
        arguments = ["--store", sqlite_url, "--prefix", PREFIX, command, counter]
        result = CliRunner().invoke(main, arguments, input=reply)
        return result.exit_code, result.stdout, result.stderr

    for command in ("delete", "reset"):
        code, out, err = answer(command, "n\n")
        assert (code, out) == (1, "")
        assert err == f"{command.capitalize()} sharded counter {name}? [y/N]: n\nAborted!\n"
        assert run("get", name) == (0, "7\n", "")  # kept
    assert answer("reset", "y\n")[:2] == (0, f"{name}: reset (sharded)\n")
    assert run("get", name, "--fresh") == (0, "0\n", "")
    assert answer("delete", "")[0] == 1  # no answer (end of input): refused
    assert answer("delete", "y\n")[:2] == (0, f"{name}: deleted (sharded)\n")
    assert run("get", name)[0] == 1
    ids = f"{name}:ids"
    run("ids", ids, "--count", "3")
    refused = "is an id allocator: a reset would hand its ids out again"
    code, out, err = run("reset", ids, "--yes")
    assert (code, out) == (1, "")
    assert refused in err
    code, out, err = answer("reset", "y\n", ids)  # refused before asking: no question
    assert (code, out) == (1, "")
    assert err.startswith(f"error: {ids!r} {refused} ")
    assert err.count("\n") == 1
    assert run("delete", ids, "--yes")[0] == 0
    assert run("ids", ids, "--count", "1") == (0, "1001\n", "")  # above every id before


def test_piped_output_is_never_wrapped_or_cut(own: Own) -> None:
    long = "w" * 200
    own("incr", long, "--by", "123456789012345")
    code, out, _ = own("list")
    assert code == 0
    assert long in out  # one line, whole
    assert "123456789012345" in out
    assert "…" not in out


def test_commands_that_read_create_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    for command in (
        ("list",),
        ("get", "x"),
        ("jobs",),
        ("jobs", "status", "j"),
        ("flush", "--all"),
        ("delete", "x", "--yes"),
        ("reset", "x", "--yes"),
    ):
        code, out, err = invoke(f"sqlite:///{missing}", "shardkit_", *command)
        assert (code, out) == (1, "")
        assert f"no SQLite database at {str(missing)!r}" in err
        assert not missing.exists()
    relative = invoke("sqlite:///relative-x.db", "shardkit_", "list")[2]
    assert "sqlite:///relative-x.db is relative" in relative
    assert "sqlite:////" in relative
    # A store that exists, asked for another prefix: no table is made.
    existing = tmp_path / "existing.db"
    shardkit.connect(f"sqlite:///{existing}", prefix="here_").close()
    engine = sa.create_engine(f"sqlite:///{existing}")
    tables = set(sa.inspect(engine).get_table_names())
    code, out, err = invoke(f"sqlite:///{existing}", "there_", "list")
    assert (code, out) == (1, "")
    assert f"no shardkit tables with the prefix 'there_' in sqlite:///{existing}" in err
    assert set(sa.inspect(engine).get_table_names()) == tables
    engine.dispose()


@pytest.mark.parametrize(
    "args",
    [
        ("incr",),
        ("incr", "x", "--by", "one"),
        ("incr", "x", "--nope"),
        ("get",),
        ("grow", "x", "many"),
        ("ids", "x", "--count", "0"),
        ("flush",),
        ("delete",),
        ("reset", "x", "--yes", "--no"),
        ("jobs", "--limit", "0"),
        ("jobs", "status"),
        ("metrics", "--port", "70000"),
        ("dashboard", "--refresh", "0"),
        ("demo", "--writers", "0"),
        ("nosuch",),
    ],
)
def test_usage_errors_exit_2_naming_what_is_wrong(run: Run, args: tuple[str, ...]) -> None:
    code, out, err = run(*args)
    assert (code, out) == (2, "")
    assert "Error:" in err
    assert "Traceback" not in err


def test_kind_flags_say_what_they_mean(run: Run, name: str) -> None:
    code, _, err = run("incr", name, "--buffered", "--monotonic")
    assert code == 2
    assert "--buffered and --monotonic exclude each other" in err
    assert run("list", "--json")[1].count(name) == 0  # nothing made
    run("incr", name, "--by", "5")
    for flag, kind in (("--buffered", "buffered"), ("--monotonic", "monotonic")):
        code, out, err = run("incr", name, flag)
        assert (code, out) == (1, "")
        assert err == f"error: {name!r} is a sharded counter, not {kind}\n"
    assert run("get", name) == (0, "5\n", "")  # counted once, as sharded
    run("grow", name, "50")
    assert run("grow", name, "10") == (
        0,
        f"{name}: kept 50 shards (a shard count never shrinks)\n",
        "",
    )
    code, _, err = run("flush", f"{name}:missing")
    assert code == 1
    assert "no counter named" in err


def test_job_ids_are_shown_short_and_taken_by_their_start(run: Run, sqlite_url: str) -> None:
    table = f"{PREFIX}cli_j_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY)")
        conn.exec_driver_sql(f"INSERT INTO {table} (id) VALUES (1), (2), (3)")
    stem = f"nightly-{uuid.uuid4().hex[:6]}"
    ids = [f"{stem}-credit-a", f"{stem}-credit-b"]
    try:
        with shardkit.connect(sqlite_url, prefix=PREFIX) as kit:
            source = sa.Table(table, sa.MetaData(), autoload_with=engine)
            for job_id in ids:
                kit.map(source, lambda batch: None, job=job_id).wait(30)
        code, out, _ = run("jobs", "--limit", "1000")
        assert code == 0
        for job_id in ids:  # the shortest start that is no other's
            assert f"{job_id[:-1]}" in out
        code, out, _ = run("jobs", "status", ids[0][:-1] + "a")
        assert (code, out.splitlines()[0]) == (0, f"job      {ids[0]}")
        code, _, err = run("jobs", "status", stem)
        assert code == 1
        assert "starts 2 job ids" in err
        lines = [
            json.loads(line) for line in run("jobs", "--json", "--limit", "1000")[1].splitlines()
        ]
        mine = [line for line in lines if line["id"] in ids]
        assert len(mine) == 2
        assert mine[0].keys() == {
            "id", "state", "rows", "estimate", "pending", "done", "depth", "pages",
            "failures", "taken_over", "created_at", "finished_at", "error",
        }  # fmt: skip
        assert {line["state"] for line in mine} == {"complete"}
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table}")
        engine.dispose()


@pytest.mark.parametrize("command", ["metrics", "dashboard"])
def test_a_server_that_cannot_listen_fails_before_saying_it_serves(run: Run, command: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, out, err = run(command, "--port", str(port))
    assert (code, out) == (1, "")
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}: ")
    assert err.count("\n") == 1


# -- as a person sees it: an 80x24 terminal ---------------------------------------------

WIDTH = 80
LEFT, RIGHT = "┏┃┡│├└┌", "┓┃┩│┤┘┐"  # the borders of Rich's tables


class Terminal:
    """A tmux server of its own with one 80x24 window running a shell; ``run`` types a
    command and returns what it printed as the screen shows it, each line the terminal
    wrapped joined again (``capture-pane -J``): an overlong line shows as one."""

    def __init__(self, env: dict[str, str]) -> None:
        self.socket = f"shardkit-{uuid.uuid4().hex[:8]}"
        size = ["-x", str(WIDTH), "-y", "24"]
        self._tmux("new-session", "-d", *size, "bash", "--norc", env=env)

    def run(self, command: str, answer: tuple[str, str] | None = None) -> str:
        """Run ``command`` (typing ``answer[1]`` once ``answer[0]`` shows below it) and
        return what it printed once it has ended."""
        marker = f"done-{uuid.uuid4().hex[:6]}"
        typed = f"{command}; echo {marker}"
        self._tmux("send-keys", typed, "Enter")

        def printed() -> str:
            return self.screen().partition(typed)[2].partition(f"\n{marker}")[0]

        if answer is not None:
            asked, reply = answer
            wait_for(lambda: asked in printed(), f"{asked!r} to show", 60, self.screen)
            self._tmux("send-keys", reply, "Enter")
        wait_for(lambda: f"\n{marker}" in self.screen(), f"{command!r} to end", 60, self.screen)
        return printed()

    def screen(self) -> str:
        """The window and its history, lines the terminal wrapped joined."""
        return self._tmux("capture-pane", "-p", "-J", "-S", "-")

    def _tmux(self, *args: str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], check=False)


def read(screen: str) -> list[list[str]]:
    """Check ``screen`` as a person reads it, and return its tables (each its lines, top
    border to bottom): a line over 80 columns is one word that no line could hold (a
    line of several would have been broken at a space), nothing is cut (no "…"), and
    each table's lines are as wide as its top border, no wider than 80, and end with a
    border there."""
    assert "…" not in screen, screen
    tables: list[list[str]] = []
    table: list[str] | None = None
    for line in screen.splitlines():
        assert cell_len(line) <= WIDTH or len(line.split()) == 1, f"overlong: {line!r}"
        if line.startswith(("┏", "┌")):
            table = []
        if table is not None:
            table.append(line)
            if line.startswith("└"):
                tables.append(table)
                table = None
    assert table is None, screen
    for lines in tables:
        width = cell_len(lines[0])
        assert width <= WIDTH, lines[0]
        for line in lines:
            assert (cell_len(line), line[0] in LEFT, line[-1] in RIGHT) == (width, True, True), (
                f"{line!r} is no row of a table {width} columns wide"
            )
    return tables


def prose(screen: str) -> str:
    """``screen``'s words, one space between each: a phrase found in it was broken, if at
    all, at spaces."""
    return " ".join(screen.split())


def test_an_80_column_terminal_shows_names_whole_prose_broken_at_spaces_tables_that_fit(
    tmp_path: Path,
) -> None:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed (.ci/run installs it)")
    folder = tmp_path / "a-folder-whose-name-makes-the-url-of-its-database-longer-than-a-line"
    folder.mkdir()
    url = f"sqlite:///{folder / 'screen.db'}"
    short_url = f"sqlite:///{tmp_path / 'short.db'}"
    short = ["views:home", "日本語の名前", "ünïcødé 名前"]
    # Longer than a line; longer than a cell (wide characters); with spaces.
    names = ["a-very-long-counter-name:" + "x" * 60, "日本語の名前" * 5, *short]
    job_id = f"nightly-credit-{'9' * 40}"
    with shardkit.connect(short_url) as kit:
        for name in short:
            kit.sharded(name).incr(7)
    with shardkit.connect(url) as kit:
        for index, name in enumerate(names):
            kit.sharded(name).incr(10**12 + index)
        rows = sa.Table(
            "accounts",
            sa.MetaData(),
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        )
        rows.create(kit.store.engine)  # type: ignore[attr-defined]
        with kit.store.engine.begin() as conn:  # type: ignore[attr-defined]
            conn.execute(rows.insert(), [{"id": n} for n in range(1, 3001)])
        kit.map(rows, lambda batch: None, job=job_id).wait(60)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")},
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "TERM": "xterm-256color",
        "LANG": "C.UTF-8",
        "SHARDKIT_STORE": url,
    }
    terminal = Terminal(env)
    try:
        listed = terminal.run("shardkit list")
        listed_short = terminal.run(f"shardkit --store {short_url} list")
        jobs = terminal.run("shardkit jobs")
        status = terminal.run("shardkit jobs status nightly")
        demo = terminal.run("shardkit demo --writers 1 --seconds 0.2")
        kept = terminal.run("shardkit reset views:home", ("[y/N]", "n"))
        reset = terminal.run("shardkit reset views:home", ("[y/N]", "y"))
        after = terminal.run("shardkit get views:home")
        with shardkit.connect(url) as kit:  # its short id is the whole of each id
            kit.map(rows, lambda batch: None, job=f"{job_id}9").wait(60)
        jobs_long = terminal.run("shardkit jobs")
    finally:
        terminal.close()
    assert "Reset sharded counter views:home? [y/N]: n\nAborted!" in kept
    assert "Reset sharded counter views:home? [y/N]: y\nviews:home: reset (sharded)" in reset
    assert after.strip().endswith("0")
    # Names too long for a table's cell: a block a counter, its name on a line of its own.
    for index, name in enumerate(names):
        assert f"\n{name}\n" in listed, listed
        assert str(10**12 + index) in listed
    assert read(listed) == []
    for header in ("kind", "shards", "value"):
        assert header in listed, listed
    assert f"counters in {url}" in prose(listed)
    (table,) = read(listed_short)
    assert all(header in table[1] for header in ("name", "kind", "shards", "value"))
    for name in short:
        assert sum(name in line for line in table) == 1, listed_short
    (table,) = read(jobs)
    for header in ("id", "state", "rows", "of about", "ranges left", "started"):
        assert header in table[1], jobs
    assert "nightly-" in jobs
    assert "complete" in jobs
    assert "3,000" in jobs
    for each in (job_id, f"{job_id}9"):
        assert f"\n{each}\n" in jobs_long, jobs_long
    assert read(jobs_long) == []
    assert read(status) == []
    assert f"job      {job_id}" in status
    assert "rows     3,000 of about 3,000" in status
    (table,) = read(demo)
    for header in ("mode", "writers", "ops", "ops/s", "vs naive", "counted", "exact"):
        assert header in table[1], demo
    assert "✗" not in demo
    for phrase in (
        f"store {url}, cache memory://",
        "so sharding shows its gain on PostgreSQL/MySQL",
        "(with memory:// each process has its own cache).",
        "kit.map: add 10 to each of 20,000 rows, page by page",
        "every row exactly +10",
    ):
        assert phrase in prose(demo), demo
