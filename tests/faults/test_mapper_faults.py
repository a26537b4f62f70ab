"""The mapper's guarantee under faults: 30,000 rows (``SHARDKIT_TEST_MAPPER_ROWS`` sets
another number), ``fn`` adds 10 to each in a transactional job while pages fail and the
processes running them are SIGKILLed.

On SQLite and PostgreSQL the job runs in subprocesses on the local executor: each one
dies once (while a page's update is uncommitted) until the kill slots are spent, and the
next one resumes the job by starting it again under the same id. On PostgreSQL with
Celery, the pool processes of real workers die the same way and the broker redelivers
their tasks. Whatever the keys (sequential, skewed, strings), every row must end exactly
+10, the job complete, and ``on_complete`` must have committed once.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

import shardkit
from backends import PREFIX, SUPPORT, store_url_for
from celery_app import Config, build
from celery_workers import Workers, config_for

ROWS = int(os.environ.get("SHARDKIT_TEST_MAPPER_ROWS", "30000"))  # 60 pages of 500
KILLS = 3
DEADLINE = 300.0  # seconds a whole job may take, kills and retries included


def _keys(kind: str) -> list[object]:
    rng = random.Random(7)
    if kind == "sequential":
        return list(range(1, ROWS + 1))
    if kind == "skewed":  # 90 % of the rows in 1 % of the key space
        dense = rng.sample(range(10**7), ROWS * 9 // 10)
        return dense + rng.sample(range(10**7, 10**9), ROWS - len(dense))
    words = ["alpha", "Zeta", "émile", "ßeta", "日本", "omega", "Ωmega", "a b"]
    return [f"{rng.choice(words)}-{rng.getrandbits(40):010x}-{i}" for i in range(ROWS)]


@pytest.fixture(params=["sequential", "skewed", "string"])
def source(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Rows:
    """The source table of one test and its ``_done`` table; dropped at the end."""

    def __init__(self, url: str, kind: str) -> None:
        self.engine = sa.create_engine(url)
        self.name = f"{PREFIX}mf_{uuid.uuid4().hex[:8]}"
        metadata = sa.MetaData()
        key = sa.BigInteger() if kind != "string" else sa.String(80)
        self.table = sa.Table(
            self.name,
            metadata,
            sa.Column("k", key, primary_key=True, autoincrement=False),
            sa.Column("balance", sa.Integer, nullable=False),
        )
        self.done = sa.Table(
            f"{self.name}_done",
            metadata,
            sa.Column("job", sa.String(64), nullable=False),
            sa.Column("rows", sa.BigInteger, nullable=False),
        )
        self.metadata = metadata
        metadata.create_all(self.engine)
        keys = _keys(kind)
        with self.engine.begin() as conn:
            for start in range(0, len(keys), 20_000):
                chunk = keys[start : start + 20_000]
                conn.execute(self.table.insert(), [{"k": k, "balance": 0} for k in chunk])

    def balances(self) -> dict[int, int]:
        """{balance: how many rows have it}."""
        t = self.table
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(t.c.balance, sa.func.count()).group_by(t.c.balance))
            return {int(balance): int(count) for balance, count in rows}

    def completions(self) -> list[tuple[str, int]]:
        with self.engine.connect() as conn:
            return [(job, int(rows)) for job, rows in conn.execute(sa.select(self.done))]

    def drop(self) -> None:
        self.metadata.drop_all(self.engine)
        self.engine.dispose()


def _environ(rows: Rows, faults: Path) -> dict[str, str]:
    return {
        "SHARDKIT_MAPPER_TABLE": rows.name,
        "SHARDKIT_MAPPER_FAULTS": str(faults),
        "SHARDKIT_MAPPER_KILLS": str(KILLS),
    }


def _kills(faults: Path) -> int:
    return len(list(faults.glob("kill-*")))


def _check(rows: Rows, status: shardkit.mapper.JobStatus, faults: Path) -> None:
    failures = (faults / "failures").read_text()
    assert _kills(faults) >= 1
    assert "in fn" in failures
    assert "at checkpoint" in failures
    assert rows.balances() == {10: ROWS}, "a row was visited twice, or missed"
    assert status.state == "complete"
    assert status.rows == ROWS
    assert status.pending == 0
    assert rows.completions() == [(status.id, ROWS)], "on_complete did not commit once"


@pytest.mark.slow
@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_killed_and_failing_processes_leave_every_row_plus_ten_once(
    database: str, source: str, sqlite_url: str, tmp_path: Path
) -> None:
    url = store_url_for(database, sqlite_url)
    rows = Rows(url, source)
    try:
        env = {**os.environ, **_environ(rows, tmp_path)}
        job = f"faults-{uuid.uuid4().hex[:12]}"
        died = 0
        for _ in range(KILLS + 3):
            process = subprocess.run(
                [sys.executable, str(SUPPORT / "mapper_workers.py"), url, PREFIX, job],
                env=env,
                capture_output=True,
                timeout=DEADLINE,
            )
            if process.returncode == 0:
                break
            assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-3000:]
            died += 1
        assert died == _kills(tmp_path)
        with shardkit.connect(url, prefix=PREFIX) as kit:
            status = kit.job(job).status()
        _check(rows, status, tmp_path)
    finally:
        rows.drop()


@pytest.fixture
def celery_config(sqlite_url: str) -> Config:
    return config_for("redis", sqlite_url, "mapper")


@pytest.fixture
def celery_workers(celery_config: Config, tmp_path: Path) -> Iterator[Workers]:
    records = redis.Redis.from_url(celery_config.cache)
    logs = tmp_path / "logs"
    logs.mkdir()
    started = Workers(celery_config, records, logs)
    try:
        yield started
    finally:
        started.stop_all()
        keys = list(records.scan_iter(match=celery_config.key("*")))
        if keys:
            records.delete(*keys)
        records.close()


@pytest.mark.slow
def test_celery_workers_killed_mid_page_leave_every_row_plus_ten_once(
    celery_config: Config,
    celery_workers: Workers,
    source: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = Rows(celery_config.store, source)
    faults = tmp_path / "faults"
    faults.mkdir()
    try:
        for name, value in _environ(rows, faults).items():
            monkeypatch.setenv(name, value)  # the workers inherit them
        celery_workers.start()
        celery_workers.start()
        app, kit = build(celery_config)
        try:
            table = sa.Table(rows.name, sa.MetaData(), autoload_with=kit.store.engine)
            job = kit.map(
                table,
                "mapper_workers:add_ten",
                transactional=True,
                page_size=500,
                on_complete="mapper_workers:record_completion",
            )
            try:
                status = job.wait(timeout=DEADLINE)
            except shardkit.ShardkitError as exc:
                pytest.fail(f"{exc}\n{celery_workers.status()}")
        finally:
            kit.close()
            app.close()
        _check(rows, status, faults)
        # A killed worker's task is delivered again: each kill leaves a range run once
        # more than its recorded failures account for.
        assert status.taken_over >= _kills(faults)
    finally:
        rows.drop()
