"""A transactional job over 200,000 rows, run by Celery workers on three hosts while one
host is cut off for 10 s and another dies outright: every row is changed exactly once,
and the dead host's ranges are taken over by the others."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from backends import wait_for
from celery_app import build
from celery_workers import Workers
from deployment import Dashboard, Deployment
from hosts import Host

pytestmark = pytest.mark.slow

ROWS = int(os.environ.get("SHARDKIT_TEST_HOSTS_ROWS", "200000"))
PARTITION = 10.0  # seconds a host stays cut off
DEADLINE = 600.0  # seconds the job may take, faults included


@pytest.fixture
def table(deployment: Deployment) -> sa.Table:
    return deployment.job_table(ROWS)


def test_a_job_on_three_hosts_survives_a_partition_and_a_dead_host(
    deployment: Deployment, table: sa.Table, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two worker hosts hold a page each, mid-transaction: one is cut off, the other dies.
    The store drops both hosts' connections (and their locks) by its TCP timeouts, and
    the broker hands their ranges to the third host after its visibility timeout; the
    cut-off host's page, going on when it comes back, changes nothing. The third host's
    dashboard and metrics show the job through, and the dead host's range taken over."""
    config = deployment.celery_config("hosts")
    monkeypatch.setenv("SHARDKIT_HOSTS_TABLE", table.name)  # the workers inherit it
    records = redis.Redis.from_url(config.cache)
    broker = redis.Redis.from_url(config.broker)
    workers = Workers(config, records, tmp_path)
    cut, dead, survivor = deployment.workers
    held = {host: tmp_path / f"held-{host.name}" for host in (cut, dead)}
    app, kit = build(config)
    try:
        for host in deployment.workers:
            hold = {"SHARDKIT_HOSTS_HOLD": str(held[host])} if host in held else {}
            workers.start(host=host, env=hold)
        dashboard = Dashboard(deployment, survivor, tmp_path)
        engine = kit.store.engine

        def balance(key: int) -> int:
            with engine.connect() as conn:
                query = sa.select(table.c.balance).where(table.c.k == key)
                return int(conn.execute(query).scalar_one())

        def done_by() -> dict[str, int]:
            """Rows committed, by the address of the host that committed them."""
            pages = sa.table(f"{table.name}_pages", sa.column("host"), sa.column("size"))
            query = sa.select(pages.c.host, sa.func.sum(pages.c.size)).group_by(pages.c.host)
            with engine.connect() as conn:
                return {str(host): int(rows) for host, rows in conn.execute(query)}

        def handing_back() -> str:
            """What the broker holds: tasks unacknowledged, and the lock under which
            workers hand them back."""
            unacked, lock = broker.zcard("unacked_index"), broker.ttl("unacked_mutex")
            return f"({unacked} tasks unacknowledged, the hand-back lock's TTL {lock} s)"

        def connected(host: Host) -> int:
            """The store's connections from ``host``."""
            query = "SELECT count(*) FROM pg_stat_activity WHERE host(client_addr) = :a"
            with engine.connect() as conn:
                return int(conn.execute(sa.text(query), {"a": host.address}).scalar_one())

        job = kit.map(table, "host_work:add_ten", transactional=True, page_size=500)
        for host, path in held.items():
            wait_for(path.exists, f"{host} to hold a page", 120)
        first = {host: int(path.read_text()) for host, path in held.items()}
        cut.partition()
        cut_at = time.monotonic()
        dead.kill()
        for host in (cut, dead):  # its page's rows are changed by another host meanwhile
            wait_for(lambda h=host: connected(h) == 0, f"the store to drop {host}", 60)
            taken = f"{host}'s page taken over"
            wait_for(lambda h=host: balance(first[h]) == 10, taken, 120, handing_back)
        died_with = done_by().get(dead.address, 0)  # final: the store dropped the host
        time.sleep(max(0.0, PARTITION - (time.monotonic() - cut_at)))
        cut.heal()
        Path(f"{held[cut]}.release").touch()  # its page goes on, on a dropped connection
        status = job.wait(timeout=DEADLINE)
        with engine.connect() as conn:
            query = sa.select(table.c.balance, sa.func.count()).group_by(table.c.balance)
            balances = {int(balance): int(count) for balance, count in conn.execute(query)}
        assert balances == {10: ROWS}, "a row was changed twice, or missed"
        assert status.state == "complete"
        assert status.rows == ROWS
        assert status.pending == 0
        assert sum(done_by().values()) == ROWS
        assert done_by().get(dead.address, 0) == died_with  # nothing of it came later
        # The surviving host's dashboard, and its metrics, show the job done, and that a
        # range holding the dead host's page was run again with no failure recorded.
        shown = dashboard.get(f"/api/jobs/{status.id}")
        assert shown["job"]["state"] == "complete"
        assert {r["state"] for r in shown["ranges"]} == {"done"}
        assert dashboard.metric("shardkit_job_rows_total", job_id=status.id) == ROWS
        holding = [
            r
            for r in shown["ranges"]
            if (r["lo"] is None or int(r["lo"]) <= first[dead])
            and (r["hi"] is None or first[dead] < int(r["hi"]))
        ]
        assert max(r["runs"] - r["failures"] for r in holding) >= 2
        taken_over = shown["job"]["taken_over"]
        assert taken_over >= 1
        assert dashboard.metric("shardkit_job_ranges_taken_over_total", job_id=status.id) == (
            taken_over
        )
    finally:
        workers.stop_all()
        kit.close()
        app.close()
        records.close()
        broker.close()
