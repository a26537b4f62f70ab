"""A transactional job over 200,000 rows, run by Celery workers on three hosts while one
host is cut off for 10 s and another dies outright: every row is changed exactly once,
and the dead host's ranges are taken over by the others."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from backends import PREFIX, wait_for
from celery_app import Config, build
from celery_workers import Workers
from deployment import Deployment
from hosts import Host

pytestmark = pytest.mark.slow

ROWS = int(os.environ.get("SHARDKIT_TEST_HOSTS_ROWS", "200000"))
PARTITION = 10.0  # seconds a host stays cut off
DEADLINE = 600.0  # seconds the job may take, faults included


@pytest.fixture
def table(deployment: Deployment) -> sa.Table:
    """The source table (``k``, ``balance`` 0) and its ``_pages`` record, on the
    deployment's own PostgreSQL (removed with it)."""
    engine = sa.create_engine(deployment.store_url)
    metadata = sa.MetaData()
    name = f"{PREFIX}hosts_{uuid.uuid4().hex[:8]}"
    source = sa.Table(
        name,
        metadata,
        sa.Column("k", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("balance", sa.Integer, nullable=False),
    )
    sa.Table(
        f"{name}_pages",
        metadata,
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("first", sa.BigInteger, nullable=False),
        sa.Column("size", sa.Integer, nullable=False),
    )
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {name} (k, balance) SELECT g, 0 FROM generate_series(1, :n) g"),
            {"n": ROWS},
        )
    engine.dispose()
    return source


def test_a_job_on_three_hosts_survives_a_partition_and_a_dead_host(
    deployment: Deployment, table: sa.Table, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = deployment.broker.url  # database 0: the broker's; 1: the kit's cache, records
    config = Config(
        store=deployment.store_url,
        cache=broker.removesuffix("/0") + "/1",
        prefix=PREFIX,
        broker=broker,
        queue=f"shardkit-hosts-{uuid.uuid4().hex[:12]}",
        record=f"shardkit-test:hosts:{uuid.uuid4().hex[:12]}",
    )
    monkeypatch.setenv("SHARDKIT_HOSTS_TABLE", table.name)  # the workers inherit it
    records = redis.Redis.from_url(config.cache)
    workers = Workers(config, records, tmp_path)
    app, kit = build(config)
    try:
        for host in deployment.workers:
            workers.start(host=host)
        engine = kit.store.engine
        pages = sa.table(f"{table.name}_pages", sa.column("host"), sa.column("size"))

        def done_by() -> dict[str, int]:
            """Rows committed, by the address of the host that committed them."""
            with engine.connect() as conn:
                query = sa.select(pages.c.host, sa.func.sum(pages.c.size)).group_by(pages.c.host)
                return {str(host): int(rows) for host, rows in conn.execute(query)}

        job = kit.map(table, "host_work:add_ten", transactional=True, page_size=500)
        cut, dead, _ = deployment.workers
        wait_for(lambda: len(done_by()) >= 3, "every host to commit pages", 120)
        cut.partition()
        cut_at = time.monotonic()
        dead.kill()

        def connected(host: Host) -> int:
            """The store's connections from ``host``."""
            query = "SELECT count(*) FROM pg_stat_activity WHERE host(client_addr) = :a"
            with engine.connect() as conn:
                return int(conn.execute(sa.text(query), {"a": host.address}).scalar_one())

        # The store drops the dead host's connections (and their transactions' locks)
        # by its TCP timeouts; from then on, what that host committed is final.
        wait_for(lambda: connected(dead) == 0, "the store to drop the dead host", 60)
        killed = done_by()
        assert job.status().state == "running"
        time.sleep(max(0.0, PARTITION - (time.monotonic() - cut_at)))
        cut.heal()
        status = job.wait(timeout=DEADLINE)
        with engine.connect() as conn:
            query = sa.select(table.c.balance, sa.func.count()).group_by(table.c.balance)
            balances = {int(balance): int(count) for balance, count in conn.execute(query)}
        assert balances == {10: ROWS}, "a row was changed twice, or missed"
        assert status.state == "complete"
        assert status.rows == ROWS
        assert status.pending == 0
        after = done_by()
        # What the dead host committed stands; the others did the rest.
        assert after[dead.address] == killed[dead.address]
        assert sum(after.values()) == ROWS
        assert set(after) == {host.address for host in deployment.workers}
        print(f"rows by worker: {after}; failures {status.failures}")
    finally:
        workers.stop_all()
        kit.close()
        app.close()
        records.close()
