"""The counters' guarantees with writers on three hosts, while hosts are cut off and
killed: every count is checked against what the writers recorded as acknowledged."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import shardkit
from backends import PREFIX, sample, wait_for
from deployment import Deployment
from host_work import acknowledged, calls, failures
from hosts import Host
from received import pending_on

pytestmark = pytest.mark.slow

PARTITION = 10.0  # seconds a host stays cut off
WRITES = "shardkit_write_seconds_count"
FELL_BACK = "shardkit_failures_ridden_out_total"
READING = "reading a cached value"
PROGRESS = 100  # acknowledged writes that show a host's writers going on
THREADS = 4  # writer threads on each host
HOLD = 58  # the advisory lock with which the test holds the store's commits


@contextlib.contextmanager
def _commits_held(deployment: Deployment, host: Host) -> Iterator[None]:
    """Within the block, every commit of ``host``'s writes to the store's shard rows
    waits at the store (a deferred trigger of the test's own waits for an advisory lock
    the test holds), one at least (awaited); they are made as the block exits. Only
    ``host``'s: a held commit of another host would keep its shard row locked, and
    ``host``'s writes could all come to wait for those rows instead, before commit."""
    engine = sa.create_engine(deployment.store_url)
    shards, hold = f"{PREFIX}shards", f"{PREFIX}held"
    waiting = sa.text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'"
        " AND host(client_addr) = :address"
    )
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_advisory_lock(:lock)"), {"lock": HOLD})
            conn.commit()
            with engine.begin() as ddl:
                ddl.exec_driver_sql(
                    f"CREATE FUNCTION {hold}() RETURNS trigger LANGUAGE plpgsql AS"
                    f" $$ BEGIN IF inet_client_addr() = '{host.address}' THEN"
                    f" PERFORM pg_advisory_xact_lock_shared({HOLD}); END IF; RETURN NULL; END $$"
                )
                ddl.exec_driver_sql(
                    f"CREATE CONSTRAINT TRIGGER {hold} AFTER INSERT OR UPDATE ON {shards}"
                    f" DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {hold}()"
                )

            def waits() -> bool:
                return bool(conn.execute(waiting, {"address": host.address}).scalar_one())

            wait_for(waits, f"a commit of {host} waiting at the store", 60)
            conn.rollback()
            try:
                yield
            finally:
                conn.execute(sa.text("SELECT pg_advisory_unlock(:lock)"), {"lock": HOLD})
                conn.commit()
        with engine.begin() as ddl:
            ddl.exec_driver_sql(f"DROP TRIGGER {hold} ON {shards}")
            ddl.exec_driver_sql(f"DROP FUNCTION {hold}()")
    finally:
        engine.dispose()


def test_acknowledged_sharded_increments_count_once_across_partitions(
    deployment: Deployment, tmp_path: Path
) -> None:
    """Writers retry a failed increment with its key until it is acknowledged: a host
    cut off mid-write, or the host of a cache primary, loses and doubles nothing — the
    count is exactly the number of keys written. Each host is cut off while one of its
    writes waits at the store to commit, which it does then: the store drops the cut-off
    host's connections meanwhile, so that write fails when the host comes back, and its
    retry finds its key applied. The cut-off host's reads of the counter's cached value
    (from a primary on another host) fail over to the store, which it cannot reach
    either: its metrics count the failed writes and reads."""
    name = f"test:hosts:sharded:{uuid.uuid4().hex}"
    deployment.writers("sharded", name, tmp_path, THREADS)
    with shardkit.connect(deployment.store_url, deployment.cache_url, prefix=PREFIX) as kit:
        owner = kit.cache.owner(kit.sharded(name)._value_key)  # type: ignore[attr-defined]
    # The hosts cut off in turn: first one whose cached value lives on another host.
    hosts = sorted(deployment.workers, key=lambda h: owner.startswith(f"{h.address}:"))

    def read_failed() -> bool:
        """The first host cut off counted a read of the cached value that failed, read
        from inside it (its cluster client gives up once no node answers, retries and
        reading the cluster's map again included)."""
        metrics = deployment.metrics(hosts[0], within=True)
        return sample(metrics, FELL_BACK, action=READING) >= 1

    for host in hosts:
        deployment.goes_on(host, PROGRESS)
    for victim in hosts[:2]:  # each holds a cache primary and a replica, and writers
        with _commits_held(deployment, victim):
            victim.partition()
        cut_at, cut = time.monotonic(), deployment.acked(victim)
        for host in hosts:
            if host is not victim:
                deployment.goes_on(host, PROGRESS)
        time.sleep(max(0.0, PARTITION - (time.monotonic() - cut_at)))
        if victim is hosts[0]:  # cut off until a read of the cached value has failed
            wait_for(read_failed, "the cut-off host's failed read in its metrics", 120)
        assert deployment.acked(victim) <= cut + THREADS  # the replies in flight at the cut
        victim.heal()
        deployment.goes_on(victim, PROGRESS)
        failed = failures(tmp_path, deployment.pid(victim))
        assert failed >= 1
        metrics = deployment.metrics(victim)
        assert sample(metrics, WRITES, kind="sharded", outcome="failed") == failed
        # The held write's retry found its key applied.
        assert any(call.value < 0 for call in deployment.calls(victim))
    deployment.stop_writers()
    keys, repeated = _keys_acknowledged(tmp_path)
    with shardkit.connect(deployment.store_url, deployment.cache_url, prefix=PREFIX) as kit:
        assert kit.sharded(name).value(fresh=True) == keys
    print(f"keys {keys}, failures {failures(tmp_path)}, retries found applied {repeated}")


def _keys_acknowledged(directory: Path) -> tuple[int, int]:
    """How many keys the writers recording in ``directory`` had acknowledged, each
    once, in turn (checked), and how many of them a retry found applied already."""
    threads = calls(directory)
    for thread, made in threads.items():
        assert [abs(call.value) for call in made] == list(range(1, len(made) + 1)), thread
    keys = {f"{thread}-{abs(call.value)}" for thread, made in threads.items() for call in made}
    repeated = sum(call.value < 0 for made in threads.values() for call in made)
    return len(keys), repeated


def _taking_ids(deployment: Deployment, directory: Path, kind: str) -> tuple[str, Host]:
    """Start id takers on every worker host (``ids``: by sub-blocks of 10;
    ``ids-sequence``: one id a round trip), recording in ``directory``; once each host
    has taken ids, the allocator's name and the host of the cache primary that holds its
    keys."""
    name = f"test:hosts:ids:{uuid.uuid4().hex}"
    deployment.writers(kind, name, directory, THREADS)
    for host in deployment.workers:
        deployment.goes_on(host, PROGRESS)
    with shardkit.connect(deployment.store_url, deployment.cache_url, prefix=PREFIX) as kit:
        owner = kit.cache.owner(kit.ids(name)._pointer_key)  # type: ignore[attr-defined]
    [holder] = [host for host in deployment.workers if owner.startswith(f"{host.address}:")]
    return name, holder


def _handed_out_once(deployment: Deployment, directory: Path) -> None:
    deployment.stop_writers()
    ids = acknowledged(directory)
    assert len(set(ids)) == len(ids), "an id was handed out twice"


def test_ids_never_repeat_across_a_dead_primary_host(
    deployment: Deployment, tmp_path: Path
) -> None:
    """The host of the allocator's cache primary dies, with writers (the primary's
    replica, on another host, takes over). No id is handed out twice, before or after,
    though every host's writers take sub-blocks of the shared blocks."""
    _, dead = _taking_ids(deployment, tmp_path, "ids")
    dead.kill()
    deployment.cluster.wait_healthy()
    assert deployment.primaries_on(dead) == 0
    for host in deployment.workers:
        if host is not dead:
            deployment.goes_on(host, PROGRESS)
    _handed_out_once(deployment, tmp_path)


def test_ids_never_repeat_across_a_cut_off_host_rejoining(
    deployment: Deployment, tmp_path: Path
) -> None:
    """The host of the allocator's cache primary is cut off with its writers (the
    primary's replica, on another host, takes over) and rejoins. While it is cut off its
    writers get no id: its primary hands out nothing its replica did not acknowledge,
    and soon refuses (the cluster's majority is out of its reach). The other hosts'
    writers go on meanwhile, and the cut-off host's once it is back, above every id
    handed out before the cut. No id is handed out twice. (One id a round trip: with
    sub-blocks, the cut-off host would hand out the rest of its own.)"""
    name, victim = _taking_ids(deployment, tmp_path, "ids-sequence")
    cut = deployment.cut_off(victim, PARTITION, PROGRESS)
    deployment.goes_on(victim, PROGRESS)
    _handed_out_once(deployment, tmp_path)
    phases = {
        host: Counter(cut.phase(call) for call in deployment.calls(host))
        for host in deployment.workers
    }
    waited = [c for c in deployment.calls(victim) if c.began < cut.healing < c.ended]
    failed = failures(tmp_path, deployment.pid(victim))
    print(f"ids by host and phase: {phases}; waiting at the heal {len(waited)}, failed {failed}")
    assert phases[victim]["during"] == 0  # the cut-off host got none:
    # Each of its writers waited until the heal, or gave up (a call retries for 15 s, which
    # a loaded machine can spend within the cut) and raised: none was handed an id.
    assert waited
    assert len(waited) + failed >= THREADS
    for host in deployment.workers:
        assert phases[host]["before"] >= PROGRESS  # every host took ids before the cut,
        assert phases[host]["after"] >= 1  # and after it
        if host is not victim:
            assert phases[host]["during"] >= 1  # the others went on through it
    everywhere = [call for host in deployment.workers for call in deployment.calls(host)]
    before = [call.value for call in everywhere if cut.phase(call) == "before"]
    after = [call.value for call in everywhere if cut.phase(call) == "after"]
    assert min(after) > max(before)  # ids go on from above what was handed out
    with shardkit.connect(deployment.store_url, deployment.cache_url, prefix=PREFIX) as kit:
        assert max(call.value for call in everywhere) <= kit.ids(name).reserved()


def test_buffered_counts_lose_at_most_the_dead_hosts_pending_and_double_nothing(
    deployment: Deployment, tmp_path: Path
) -> None:
    """A host dies with a cache primary and with writers. What can be lost is what its
    primary held beyond the store at that moment (its replica may not have it yet),
    and what was counted between that reading and the death; nothing counts twice. The
    surviving hosts' scheduled flushes go on (their metrics show them)."""
    name = f"test:hosts:buffered:{uuid.uuid4().hex}"
    deployment.writers("buffered", name, tmp_path, THREADS)
    dead = deployment.workers[0]
    for host in deployment.workers:
        deployment.goes_on(host, PROGRESS)
    with shardkit.connect(deployment.store_url, deployment.cache_url, prefix=PREFIX) as kit:
        counter = kit.buffered(name)
        [primary] = [node for node in deployment.cluster.primaries() if node.host is dead]
        before = deployment.acked()
        on_victim = pending_on(kit, counter, f"{primary.address}:{primary.port}")
        dead.kill()
        exposed = on_victim + deployment.acked() - before
        deployment.cluster.wait_healthy()
        survivors = [host for host in deployment.workers if host is not dead]

        def flushes() -> float:
            """Scheduled flushes the surviving hosts ran (their lag's observations)."""
            return sum(
                value
                for host in survivors
                for (sample, _), value in deployment.metrics(host).items()
                if sample == "shardkit_flush_lag_seconds_count"
            )

        flushed = flushes()
        wait_for(lambda: flushes() > flushed, "a surviving host's scheduled flush", 60)
        deployment.goes_on(None, PROGRESS)
        deployment.stop_writers()  # the survivors' kits close: their flushes run
        acked, failed = len(acknowledged(tmp_path)), failures(tmp_path)
        total = counter.value()
        # A failed increment may have counted (its reply was lost), and so may the dead
        # host's writes in flight when it died, unanswered: one a thread.
        assert acked - exposed <= total <= acked + failed + THREADS
        print(f"acked {acked}, counted {total}, exposed {exposed}, failed {failed}")


@pytest.mark.parametrize("kind", ["buffered", "buffered-keyed"])
def test_buffered_increments_that_raised_are_the_only_doubt_across_a_cut_off_store_host(
    deployment: Deployment, tmp_path: Path, kind: str
) -> None:
    """Writers on every host; the store's host is cut off with its writers. Its writers'
    increments fail (the cache is out of their reach) with ``BackendUnavailable``, none
    acknowledged while it is cut off; a failed one may or may not have counted (one in
    flight at the cut may have reached the cache). The other hosts' increments go into
    the cache until their periodic look at the store (``cache_ttl``) waits for it, and
    may fail then, having counted nothing; their flushes fail until the store is back.
    The cache loses nothing. Without keys, the count lies within [acknowledged,
    acknowledged + failed], each side counted exactly: exact or within that stated
    doubt. With keys (``buffered-keyed``: each writer retries a failed increment with
    its key until it is acknowledged), it is exact: the number of keys. Either way a
    flush then moves all of it into the store."""
    name = f"test:hosts:buffered:{uuid.uuid4().hex}"
    victim = deployment.hosts[0]
    deployment.writers(kind, name, tmp_path, THREADS, on=list(deployment.hosts))
    for host in deployment.hosts:
        deployment.goes_on(host, PROGRESS)
    cut = deployment.cut_off(victim, PARTITION, 0)
    deployment.goes_on(victim, PROGRESS)
    failed = failures(tmp_path, deployment.pid(victim))
    metrics = deployment.metrics(victim)
    assert failed >= 1
    assert sample(metrics, WRITES, kind="buffered", outcome="failed") == failed
    deployment.stop_writers()
    phases = Counter(cut.phase(call) for call in deployment.calls(victim))
    assert phases["during"] == 0  # the cut-off host's writers had none acknowledged
    acked, raised = len(acknowledged(tmp_path)), failures(tmp_path)
    with shardkit.connect(deployment.store_url, deployment.cache_url, prefix=PREFIX) as kit:
        counter = kit.buffered(name)
        total = counter.value()
        if kind == "buffered-keyed":
            assert total == _keys_acknowledged(tmp_path)[0] == acked
        else:
            assert acked <= total <= acked + raised
        counter.flush()
        assert counter.parts() == (total, 0)
    print(f"acked {acked}, raised {raised} ({failed} on the cut-off host), counted {total}")
