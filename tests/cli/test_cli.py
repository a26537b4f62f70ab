"""The shardkit command line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import shardkit
from backends import CACHE_URLS, NEVER, PREFIX, require, store_url_for, wait_for
from shardkit.cli import main
from shardkit.mapper.tables import ledger_tables
from shardkit.store.base import Flushed


@pytest.fixture
def run(sqlite_url: str) -> object:
    store_url_for("sqlite", sqlite_url)
    shardkit.connect(sqlite_url, prefix=PREFIX).close()  # its tables exist
    runner = CliRunner()

    def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        result = runner.invoke(
            main,
            ["--store", sqlite_url, "--prefix", PREFIX, *args],
            env=env,
            catch_exceptions=False,
        )
        return result.exit_code, result.stdout, result.stderr

    return invoke


def test_incr_get_grow_list(run, name: str) -> None:  # type: ignore[no-untyped-def]
    assert run("incr", name, "--by", "5", "--shards", "4")[0] == 0
    assert run("incr", name, "--by", "-2")[0] == 0
    assert run("get", name, "--fresh") == (0, "3\n", "")
    assert run("get", name)[1] == "3\n"
    code, out, _ = run("grow", name, "16")
    assert (code, out) == (0, f"{name}: 16 shards\n")
    code, out, _ = run("list")
    assert code == 0
    row = next(line for line in out.splitlines() if name in line)
    assert "sharded" in row
    assert "16" in row
    assert row.rstrip("│ ").endswith("3")


def test_incr_with_a_key_applies_once(run, name: str) -> None:  # type: ignore[no-untyped-def]
    assert run("incr", name, "--by", "5", "--key", "k1")[0] == 0
    code, out, _ = run("incr", name, "--by", "5", "--key", "k1")
    assert code == 0
    assert "applied already" in out
    assert run("get", name, "--fresh")[1] == "5\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("get", "test:no-such-counter"), "no counter named"),
        (("incr", ""), "must not be empty"),
        (("incr", "x" * 201), "limit is 200"),
        (("incr", "test:cli", "--by", str(2**63)), "outside signed 64-bit"),
        (("incr", "test:cli", "--shards", "0"), "outside 1..1000"),
        (("grow", "test:no-such-counter", "4"), "no counter named"),
    ],
)
def test_bad_input_exits_non_zero_with_one_line(run, args: tuple[str, ...], message: str) -> None:  # type: ignore[no-untyped-def]
    code, out, err = run(*args)
    assert code == 1
    assert out == ""
    assert message in err
    assert err.count("\n") == 1


def test_unreachable_store_is_one_line_without_the_password() -> None:
    result = CliRunner().invoke(
        main, ["--store", "postgresql://app:s3cret@127.0.0.1:1/db", "get", "x"]
    )
    assert result.exit_code == 1
    assert "app:***@127.0.0.1:1" in result.stderr
    assert "s3cret" not in result.stderr + result.stdout
    assert result.stderr.count("\n") == 1


def test_store_and_cache_come_from_the_environment(sqlite_url: str, name: str) -> None:
    env = {"SHARDKIT_STORE": sqlite_url, "SHARDKIT_CACHE": "memory://"}
    result = CliRunner().invoke(main, ["--prefix", PREFIX, "incr", name, "--by", "9"], env=env)
    assert result.exit_code == 0, result.stderr
    with shardkit.connect(sqlite_url, prefix=PREFIX) as kit:
        assert kit.get(name).value(fresh=True) == 9


def test_the_prefix_comes_from_the_environment(sqlite_url: str, name: str) -> None:
    env = {"SHARDKIT_STORE": sqlite_url, "SHARDKIT_PREFIX": f"{PREFIX}cli_env_"}
    result = CliRunner().invoke(main, ["incr", name, "--by", "4"], env=env)
    assert result.exit_code == 0, result.stderr
    with shardkit.connect(sqlite_url, prefix=f"{PREFIX}cli_env_") as kit:
        assert kit.get(name).value(fresh=True) == 4


def test_purge_keys(run, name: str) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = run("purge-keys")
    assert code == 0
    assert out.startswith("purged ")


@pytest.mark.slow
def test_demo_races_counters_then_maps_and_checks_the_totals() -> None:
    result = CliRunner().invoke(main, ["demo", "--writers", "2", "--seconds", "0.5"])
    assert result.exit_code == 0, result.stderr
    for mode in ("naive", "sharded", "buffer"):
        assert f"│ {mode}" in result.stdout
    assert "✗" not in result.stdout
    assert result.stdout.count("✓") == 4
    assert "complete: 20,000 rows" in result.stdout


@pytest.mark.slow
def test_demo_json_is_one_object_of_the_race_and_the_job(tmp_path: Path) -> None:
    """With --json the demo prints one object and nothing else; its totals are what the
    counters hold (a broken count would make ``exact`` false and exit 1)."""
    store = f"sqlite:///{tmp_path / 'demo.db'}"
    command = ["--store", store, "demo", "--writers", "2", "--seconds", "0.5", "--json"]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    assert set(shown) == {"store", "cache", "seconds", "exact", "races", "map"}
    assert (shown["store"], shown["cache"], shown["seconds"]) == (store, "memory://", 0.5)
    assert [race["mode"] for race in shown["races"]] == ["naive", "sharded", "buffered"]
    for race in shown["races"]:
        assert set(race) == {"mode", "writers", "ops", "ops_per_second", "counted", "exact"}
        assert race["ops"] == race["counted"] > 0
        assert race["writers"] == 2
        assert race["exact"] is True
    assert shown["map"]["state"] == "complete"
    assert shown["map"]["rows"] == 20_000
    assert shown["map"]["exact"] is True
    assert shown["exact"] is True


@pytest.fixture
def redis_run(sqlite_url: str) -> object:
    """The command on the session's SQLite store with the tests' Redis as the cache."""
    require(CACHE_URLS["redis"])
    runner = CliRunner()

    def invoke(*args: str) -> tuple[int, str, str]:
        result = runner.invoke(
            main,
            ["--store", sqlite_url, "--cache", CACHE_URLS["redis"], "--prefix", PREFIX, *args],
            catch_exceptions=False,
        )
        return result.exit_code, result.stdout, result.stderr

    return invoke


def test_incr_with_a_key_applies_once_on_a_buffered_counter(  # type: ignore[no-untyped-def]
    redis_run, name: str
) -> None:
    said = f"{name} +5 (pending until flushed)\n"
    assert redis_run("incr", name, "--buffered", "--by", "5", "--key", "k1") == (0, said, "")
    code, out, _ = redis_run("incr", name, "--by", "5", "--key", "k1", "--json")
    assert (code, json.loads(out)["applied"]) == (0, False)
    code, out, _ = redis_run("incr", name, "--by", "5", "--key", "k1")
    assert (code, out) == (0, f"{name}: key 'k1' was applied already; nothing changed\n")
    code, out, _ = redis_run("get", name, "--json")
    assert (code, json.loads(out)["value"]) == (0, 5)


def test_get_and_flush_show_a_buffered_counters_parts(  # type: ignore[no-untyped-def]
    redis_run, sqlite_url: str, name: str
) -> None:
    with shardkit.connect(sqlite_url, CACHE_URLS["redis"], prefix=PREFIX) as kit:
        kit.buffered(name, interval=NEVER).incr(4)
        assert redis_run("get", name) == (0, "4 (stored 0, pending 4)\n", "")
        assert redis_run("flush", name) == (0, f"{name} +4\n", "")
        assert redis_run("get", name) == (0, "4 (stored 4, pending 0)\n", "")
        kit.buffered(name, interval=NEVER).incr(-1)
        code, out, _ = redis_run("flush", "--all")
        assert code == 0
        assert f"{name} -1\n" in out
        kit.buffered(name, interval=NEVER).incr(2)
        code, out, _ = redis_run("worker", "--once")
        assert (code, f"{name} +2\n" in out) == (0, True)
        assert kit.buffered(name).parts() == (5, 0)


def test_incr_buffered_is_flushed_when_the_command_exits(run, name: str) -> None:  # type: ignore[no-untyped-def]
    assert run("incr", name, "--buffered", "--by", "3") == (
        0,
        f"{name} +3 (pending until flushed)\n",
        "",
    )
    assert run("incr", name, "--by", "2")[0] == 0  # an existing buffered counter stays one
    assert run("get", name) == (0, "5 (stored 5, pending 0)\n", "")
    out = run("list")[1]
    assert "buffered" in next(line for line in out.splitlines() if name in line)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("incr", "{name}", "--shards", "4"), "--shards is for sharded and monotonic counters"),
        (("grow", "{name}", "4"), "is a buffered counter, not sharded"),
    ],
)
def test_sharded_only_options_are_refused_on_a_buffered_counter(  # type: ignore[no-untyped-def]
    run, name: str, args: tuple[str, ...], message: str
) -> None:
    run("incr", name, "--buffered")
    code, out, err = run(*(arg.format(name=name) for arg in args))
    assert (code, out) == (1, "")
    assert message in err
    assert run("get", name)[1] == "1 (stored 1, pending 0)\n"


def test_flush_needs_a_name_or_all(run, name: str) -> None:  # type: ignore[no-untyped-def]
    assert run("flush")[0] == 2
    assert run("flush", name, "--all")[0] == 2
    run("incr", name)
    code, _, err = run("flush", name)
    assert (code, "sharded counter" in err) == (1, True)


RESET_SIGINT_AND_EXEC = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_worker_flushes_in_the_foreground_until_interrupted(
    sqlite_url: str, name: str, tmp_path: Path, stop: signal.Signals
) -> None:
    require(CACHE_URLS["redis"])
    # The worker runs as a terminal's foreground program: SIGINT at its default, even
    # where this run ignores it (a shell's background job, whose children inherit the
    # ignored signal), and a session of its own.
    command = [
        sys.executable, "-c", RESET_SIGINT_AND_EXEC,
        sys.executable, "-X", "faulthandler", "-m", "shardkit", "--store", sqlite_url,
        "--cache", CACHE_URLS["redis"], "--prefix", PREFIX, "worker", "--interval", "0.2",
    ]  # fmt: skip
    errors = tmp_path / "worker.err"
    with shardkit.connect(sqlite_url, CACHE_URLS["redis"], prefix=PREFIX) as kit:
        hits = kit.buffered(name, interval=NEVER)
        hits.incr(6)
        with open(errors, "w") as stderr:
            worker = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True
            )
        lines: list[str] = []

        def read() -> None:
            assert worker.stdout is not None
            for line in worker.stdout:
                lines.append(line)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            # Its round reports what it moved once every counter in the store is flushed.
            wait_for(lambda: any(f"{name} +6" in line for line in lines), "the worker's report")
            assert hits.parts() == (6, 0)
            worker.send_signal(stop)
            # A wide bound: a flush waiting on SQLite's write lock (up to its busy
            # timeout) sees the interrupt only when the lock is granted.
            try:
                worker.wait(timeout=90)
            except subprocess.TimeoutExpired:
                worker.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack
                worker.wait(timeout=30)
                pytest.fail(
                    f"the worker did not stop; its output {lines[-5:]}, its stacks:\n"
                    + errors.read_text()
                )
            assert worker.returncode == 0, errors.read_text()
        finally:
            worker.kill()
            worker.wait()  # reaped here, not reported by a later test's garbage collection
            reader.join(timeout=10)
            worker.stdout.close()  # type: ignore[union-attr]
    assert lines[-1] == "stopped\n"


def test_a_monotonic_counter_from_the_command_line(run, name: str) -> None:  # type: ignore[no-untyped-def]
    assert run("incr", name, "--monotonic", "--by", "3") == (0, f"{name} = 3\n", "")
    assert run("incr", name) == (0, f"{name} = 4\n", "")
    code, _, err = run("incr", name, "--key", "k")
    assert (code, "--key is for sharded and buffered counters" in err) == (1, True)
    code, out, _ = run("get", name)
    assert code == 0
    assert out.startswith("4 (persisted ")  # the memory cache lives as long as the command
    out = run("list")[1]
    assert "monotonic" in next(line for line in out.splitlines() if name in line)


def test_ids_prints_new_ids_that_never_repeat(run, name: str) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = run("ids", name, "--count", "3", "--block", "10")
    assert code == 0
    first = [int(line) for line in out.split()]
    assert first == sorted(set(first))
    assert len(first) == 3
    second = [int(line) for line in run("ids", name)[1].split()]
    assert second[0] > max(first)  # a new process reserves a new block
    assert run("get", name) == (0, "1010 (ids reserved up to here)\n", "")  # 10, then 1000
    assert run("ids", name, "--count", "0")[0] == 2


# -- mapping jobs ----------------------------------------------------------------------

_BROKEN: set[str] = set()  # tables whose add_one fails (a "bug" the test then fixes)


def add_one(batch: shardkit.mapper.Batch) -> None:
    """A job function importable by path (``test_cli:add_one``), for ``jobs resume``."""
    (table,) = {row["tbl"] for row in batch.rows}
    if table in _BROKEN:
        raise RuntimeError("fn is broken")
    accounts = sa.table(table, sa.column("id"), sa.column("n"))
    ids = [row["id"] for row in batch.rows]
    batch.conn.execute(sa.update(accounts).where(accounts.c.id.in_(ids)).values(n=accounts.c.n + 1))


@pytest.fixture
def accounts(sqlite_url: str) -> Iterator[sa.Table]:
    engine = sa.create_engine(sqlite_url)
    table = sa.Table(
        f"{PREFIX}cli_{uuid.uuid4().hex[:8]}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("tbl", sa.String(64), nullable=False),
        sa.Column("n", sa.Integer, nullable=False),
    )
    table.create(engine)
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "tbl": table.name, "n": 0} for i in range(500)])
    yield table
    table.drop(engine)
    engine.dispose()


def _counts(kit: shardkit.Kit, table: sa.Table) -> dict[int, int]:
    with kit.store.engine.connect() as conn:  # type: ignore[attr-defined]
        rows = conn.execute(sa.select(table.c.n, sa.func.count()).group_by(table.c.n))
        return {int(n): int(count) for n, count in rows}


def test_jobs_list_status_and_watch(run, sqlite_url: str, accounts: sa.Table) -> None:  # type: ignore[no-untyped-def]
    job_id = f"cli-{uuid.uuid4().hex[:8]}"
    with shardkit.connect(sqlite_url, prefix=PREFIX) as kit:
        kit.map(accounts, add_one, transactional=True, page_size=40, job=job_id).wait(30)
    code, out, _ = run("jobs", "--limit", "1000")
    assert code == 0
    assert job_id[:8] in out  # at least its first 8 characters
    code, out, _ = run("jobs", "status", job_id)
    assert code == 0
    assert "complete" in out
    assert "rows     500 of about 500" in out
    code, out, _ = run("jobs", "watch", job_id)
    assert (code, out.splitlines()[-1]) == (0, f"{job_id}: complete, 500 rows")
    code, _, error = run("jobs", "status", "no-such-job")
    assert code == 1
    assert "no job 'no-such-job'" in error


def test_jobs_cancel_stops_a_running_job(run, sqlite_url: str, accounts: sa.Table) -> None:  # type: ignore[no-untyped-def]
    entered, release = threading.Event(), threading.Event()

    def blocked(batch: shardkit.mapper.Batch) -> None:
        entered.set()
        release.wait(30)

    with shardkit.connect(sqlite_url, prefix=PREFIX) as kit:
        job = kit.map(accounts, blocked, page_size=40)
        assert entered.wait(30)
        code, out, _ = run("jobs", "cancel", job.id)
        assert (code, out) == (0, f"{job.id}: cancelled\n")
        release.set()
        kit.executor.close()  # runs whatever was queued: nothing of a cancelled job
        status = job.status()
    assert status.state == "cancelled"
    assert status.rows <= 40
    assert status.pending >= 1
    assert run("jobs", "cancel", job.id)[1] == f"{job.id}: already cancelled\n"


def test_jobs_resume_runs_a_failed_job_to_completion(  # type: ignore[no-untyped-def]
    run, sqlite_url: str, accounts: sa.Table
) -> None:
    _BROKEN.add(accounts.name)
    with shardkit.connect(sqlite_url, prefix=PREFIX) as kit:
        job = kit.map(accounts, add_one, transactional=True, page_size=40, retries=0)
        with pytest.raises(shardkit.JobFailed, match="fn is broken"):
            job.wait(30)
        assert _counts(kit, accounts) == {0: 500}
    _BROKEN.discard(accounts.name)
    code, out, _ = run("jobs", "resume", job.id)
    assert code == 0
    assert out.splitlines()[-1] == f"{job.id}: complete, 500 rows"
    with shardkit.connect(sqlite_url, prefix=PREFIX) as kit:
        assert _counts(kit, accounts) == {1: 500}


def test_flush_all_exits_1_naming_what_it_could_not_flush(sqlite_url: str, name: str) -> None:
    redis_url = CACHE_URLS["redis"]
    require(redis_url)
    prefix = f"{PREFIX}ff{uuid.uuid4().hex[:6]}_"  # huge values: tables of its own
    with shardkit.connect(sqlite_url, redis_url, prefix=prefix) as kit:
        try:
            full = kit.buffered(name, interval=NEVER)
            other = kit.buffered(f"{name}:other", interval=NEVER)
            for generation in (1, 2):  # records that put the stored value at 2**63 - 2
                kit.store.add_generation(name, generation)
                kit.store.advance(name, generation, Flushed(), Flushed(2**62 - 1, 0))
            full.incr(2)
            other.incr(3)
            args = ["--store", sqlite_url, "--cache", redis_url, "--prefix", prefix]
            result = CliRunner().invoke(main, [*args, "flush", "--all"])
            assert result.exit_code == 1
            assert f"{name}:other +3" in result.stdout  # flushed all the same
            assert name in result.stderr
            assert "outside signed 64-bit" in result.stderr
            assert full.parts() == (2**63 - 2, 2)  # still pending, not lost
        finally:
            kit.store.metadata.drop_all(kit.store.engine)  # type: ignore[attr-defined]


def test_jobs_purge_deletes_finished_jobs_and_keeps_failed_ones(  # type: ignore[no-untyped-def]
    run, sqlite_url: str, accounts: sa.Table
) -> None:
    with shardkit.connect(sqlite_url, prefix=PREFIX) as kit:
        done = kit.map(accounts, add_one, transactional=True, page_size=100)
        done.wait(30)
        _BROKEN.add(accounts.name)
        failed = kit.map(accounts, add_one, transactional=True, page_size=100, retries=0)
        with pytest.raises(shardkit.JobFailed):
            failed.wait(30)
        _BROKEN.discard(accounts.name)
    assert run("jobs", "purge")[1] == "purged 0 finished jobs\n"  # a week: none that old
    code, out, _ = run("jobs", "purge", "--age", "0")
    assert code == 0
    assert int(out.split()[1]) >= 1
    assert run("jobs", "status", done.id)[0] == 1  # gone, its ranges too
    with shardkit.connect(sqlite_url, prefix=PREFIX) as kit:
        ranges = ledger_tables(PREFIX).ranges
        with kit.store.engine.connect() as conn:  # type: ignore[attr-defined]
            left = conn.execute(sa.select(sa.func.count()).where(ranges.c.job == done.id))
            assert left.scalar_one() == 0
    assert "failed" in run("jobs", "status", failed.id)[1]  # kept: it may be resumed
    code, _, error = run("jobs", "purge", "--age", "nan")
    assert code == 1
    assert "age must be" in error
