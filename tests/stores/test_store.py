"""The store conformance suite: every store backend passes the same tests."""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest

from backends import PREFIX, ROOT, STORE_URLS, require, run_together, store_url_for, wait_for
from shardkit.errors import (
    ConfigurationError,
    CounterKindMismatch,
    CounterOverflow,
    ValidationError,
)
from shardkit.store import Flushed, Store, open_store
from shardkit.store.base import RETIRED
from shardkit.store.sql.dialect import LibpqStatement
from shardkit.validation import INT64_MAX, INT64_MIN


def test_create_schema_is_idempotent(store: Store) -> None:
    store.create_schema()
    store.create_schema()


@pytest.mark.parametrize("kind", list(STORE_URLS))
def test_a_missing_table_is_made_and_a_development_versions_counters_refused(
    kind: str, sqlite_url: str
) -> None:
    """Creating the schema makes a table that is missing beside the others; a counters
    table without incarnations (a development version's) is refused with
    ``ConfigurationError``, by ``create_schema`` and by ``has_schema`` alike."""
    url = store_url_for(kind, sqlite_url)
    store = open_store(url, prefix=f"{PREFIX}v{uuid.uuid4().hex[:6]}_")
    engine = store.engine  # type: ignore[attr-defined]
    try:
        store.create_schema()
        store.open_counter("old", "sharded", 2)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {store.prefix}marks")  # type: ignore[attr-defined]
        assert not store.has_schema()
        store.create_schema()
        assert store.has_schema()
        store.open_counter("ids", "ids", 1)
        assert store.reserve("ids", 5) == 5
        assert store.counter("old") is not None  # nothing else was made again
        with engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {store.prefix}counters DROP COLUMN incarnation")  # type: ignore[attr-defined]
        for check in (store.create_schema, store.has_schema):
            with pytest.raises(ConfigurationError, match="development version"):
                check()
    finally:
        store.metadata.drop_all(engine)  # type: ignore[attr-defined]
        store.close()


def test_open_counter_creates_then_only_grows(store: Store, name: str) -> None:
    assert store.counter(name) is None
    assert store.open_counter(name, "sharded", 4).shards == 4
    assert store.open_counter(name, "sharded", 2).shards == 4
    assert store.open_counter(name, "sharded", 9).shards == 9
    assert store.open_counter(name, "sharded", 20, grow=False).shards == 9
    assert store.counter(name) == store.open_counter(name, "sharded", 1)
    assert name in [info.name for info in store.counters()]


def test_open_counter_refuses_another_kind_and_changes_nothing(store: Store, name: str) -> None:
    store.open_counter(name, "sharded", 3)
    with pytest.raises(CounterKindMismatch, match="sharded"):
        store.open_counter(name, "buffered", 8)
    info = store.counter(name)
    assert info is not None
    assert (info.kind, info.shards) == ("sharded", 3)


def test_add_creates_shard_rows_lazily_and_sums_them(store: Store, name: str) -> None:
    assert store.total(name) == 0
    assert store.add(name, 0, 5)
    assert store.add(name, 3, -2)
    assert store.add(name, 3, 10)
    assert store.total(name) == 13


def test_add_with_key_applies_once_per_counter(store: Store, name: str) -> None:
    assert store.add(name, 0, 7, key="req-1")
    assert not store.add(name, 1, 7, key="req-1")
    assert store.add(name, 0, 1, key="req-2")
    assert store.add(f"{name}:other", 0, 7, key="req-1")
    assert store.total(name) == 8
    assert store.total(f"{name}:other") == 7


def test_totals_reads_many_counters_unknown_ones_as_zero(store: Store, name: str) -> None:
    store.add(f"{name}:a", 0, 1)
    store.add(f"{name}:b", 0, 2)
    store.add(f"{name}:b", 1, 3)
    names = [f"{name}:a", f"{name}:b", f"{name}:none", f"{name}:a"]
    assert store.totals(names) == {f"{name}:a": 1, f"{name}:b": 5, f"{name}:none": 0}
    assert store.totals([]) == {}


def test_names_are_compared_exactly(store: Store, name: str) -> None:
    variants = [f"{name}:Case", f"{name}:case", f"{name}:case ", f"{name}:ça 😀"]
    for index, variant in enumerate(variants):
        store.open_counter(variant, "sharded", 1)
        store.add(variant, 0, index + 1)
    assert store.totals(variants) == {v: i + 1 for i, v in enumerate(variants)}
    listed = {info.name for info in store.counters()}
    assert set(variants) <= listed


def test_values_span_signed_64_bit(store: Store, name: str) -> None:
    store.add(f"{name}:max", 0, INT64_MAX)
    store.add(f"{name}:min", 0, INT64_MIN)
    assert store.totals([f"{name}:max", f"{name}:min"]) == {
        f"{name}:max": INT64_MAX,
        f"{name}:min": INT64_MIN,
    }


def test_an_overflowing_write_fails_and_changes_nothing(store: Store, name: str) -> None:
    """Refused as CounterOverflow, not a BackendError (which says it may have applied)."""
    store.add(name, 0, INT64_MAX)
    with pytest.raises(CounterOverflow):
        store.add(name, 0, 1)
    with pytest.raises(CounterOverflow):
        store.add(name, 0, 1, key="overflow")
    assert store.total(name) == INT64_MAX
    # The failed keyed write rolled back its key too: it applies once the value allows.
    store.add(name, 1, -5)
    assert store.add(name, 1, 1, key="overflow")
    assert store.total(name) == INT64_MAX - 4


def test_purge_keys_forgets_old_keys_only(store: Store, name: str) -> None:
    store.add(name, 0, 1, key="old")
    cutoff = time.time() + 0.001
    while time.time() <= cutoff:  # keys recorded from now on are newer than the cutoff
        pass
    store.add(name, 0, 1, key="new")
    assert store.purge_keys(cutoff) >= 1
    assert store.add(name, 0, 1, key="old")  # forgotten: applies again
    assert not store.add(name, 0, 1, key="new")  # kept
    assert store.total(name) == 3


def test_concurrent_opens_and_grows_of_one_counter(store: Store, name: str) -> None:
    """Processes opening a counter each with its own shard count race on one row."""

    def work(seed: int) -> None:
        for shards in random.Random(seed).sample(range(1, 60), 12):
            store.open_counter(name, "sharded", shards, grow=bool(shards % 2))

    run_together(8, work)  # raises what any opener raised
    info = store.counter(name)
    assert info is not None
    grown = [s for seed in range(8) for s in random.Random(seed).sample(range(1, 60), 12) if s % 2]
    assert info.shards >= max(grown)


def test_generations_are_recorded_once_and_advanced_by_compare_and_set(
    store: Store, name: str
) -> None:
    store.add_generation(name, 7)
    store.add_generation(name, 7)
    store.add_generation(name, INT64_MAX)
    assert store.generations([name, f"{name}:none"]) == {
        name: {7: Flushed(0, 0), INT64_MAX: Flushed(0, 0)}
    }
    assert store.advance(name, 7, Flushed(0, 0), Flushed(10, 3))
    # A stale reading (another flush got there first) changes nothing.
    assert not store.advance(name, 7, Flushed(0, 0), Flushed(12, 3))
    assert not store.advance(name, 8, Flushed(0, 0), Flushed(1, 0))
    assert store.advance(name, INT64_MAX, Flushed(0, 0), Flushed(INT64_MAX, 0))
    assert store.generations([name])[name] == {7: Flushed(10, 3), INT64_MAX: Flushed(INT64_MAX, 0)}


def test_totals_add_flushed_generations_to_shard_rows(store: Store, name: str) -> None:
    store.add(name, 0, 5)
    store.add_generation(name, 1)
    store.add_generation(name, 2)
    store.advance(name, 1, Flushed(), Flushed(100, 30))
    store.advance(name, 2, Flushed(), Flushed(0, 1))
    assert store.total(name) == 5 + 70 - 1
    assert store.totals([name, f"{name}:none"]) == {name: 74, f"{name}:none": 0}


def test_concurrent_advances_of_one_generation_have_one_winner(store: Store, name: str) -> None:
    store.add_generation(name, 1)
    winners: list[int] = []

    def work(index: int) -> None:
        if store.advance(name, 1, Flushed(), Flushed(index + 1, 0)):
            winners.append(index)

    run_together(8, work)
    assert len(winners) == 1
    assert store.generations([name])[name][1] == Flushed(winners[0] + 1, 0)


def test_retire_folds_generations_into_one_once(store: Store, name: str) -> None:
    for generation, sums in ((1, Flushed(50, 8)), (2, Flushed(5, 0))):
        store.add_generation(name, generation)
        store.advance(name, generation, Flushed(), sums)
    assert not store.retire(name, 1, Flushed(50, 7))  # not what is recorded: kept
    assert store.retire(name, 1, Flushed(50, 8))
    assert not store.retire(name, 1, Flushed(50, 8))
    assert store.retire(name, 2, Flushed(5, 0))
    assert store.generations([name]) == {name: {RETIRED: Flushed(55, 8)}}
    assert store.total(name) == 47


def test_raise_max_only_raises_and_maxima_reads_the_highest_shard(store: Store, name: str) -> None:
    counter = store.open_counter(name, "monotonic", 10)
    store.raise_max(counter, 0, 10)
    store.raise_max(counter, 0, 7)  # lower: kept at 10
    store.raise_max(counter, 3, 12)
    store.raise_max(counter, 5, INT64_MAX)
    store.raise_max(store.open_counter(f"{name}:b", "monotonic", 10), 1, 4)
    assert store.maxima([name, f"{name}:b", f"{name}:none"]) == {
        name: INT64_MAX,
        f"{name}:b": 4,
        f"{name}:none": 0,
    }
    assert store.total(name) == 0  # maxima are not shard sums


def test_concurrent_raises_keep_the_highest(store: Store, name: str) -> None:
    counter = store.open_counter(name, "monotonic", 1)
    run_together(8, lambda index: [store.raise_max(counter, 0, index * 100 + i) for i in range(20)])
    assert store.maxima([name])[name] == 719


def test_delete_removes_every_row_of_the_counter_in_one_go(store: Store, name: str) -> None:
    sharded = store.open_counter(name, "sharded", 4)
    assert store.add(name, 1, 5, key="k")
    store.open_counter(f"{name}:b", "buffered", 1)
    store.add_generation(f"{name}:b", 7)
    store.advance(f"{name}:b", 7, Flushed(), Flushed(up=3))
    deleted = store.delete(name)
    assert deleted is not None
    assert (deleted.info, deleted.generations) == (sharded, [])
    assert (store.counter(name), store.total(name)) == (None, 0)
    assert store.delete(name) is None
    assert store.add(name, 1, 1, key="k")  # its key went with it
    buffered = store.delete(f"{name}:b")
    assert buffered is not None
    assert buffered.generations == [7]
    assert store.generations([f"{name}:b"]) == {}
    assert store.total(f"{name}:b") == 0


def test_reset_is_a_new_empty_incarnation_of_the_same_counter(store: Store, name: str) -> None:
    old = store.open_counter(name, "monotonic", 3)
    store.raise_max(old, 1, 50)
    assert store.delete(name, reset=True) is not None
    new = store.counter(name)
    assert new is not None
    assert (new.kind, new.shards) == ("monotonic", 3)
    assert new.incarnation != old.incarnation
    assert store.maxima([name]) == {name: 0}
    store.raise_max(old, 2, 70)  # an object of the old incarnation persists a value
    assert store.maxima([name]) == {name: 0}  # which the new one never reads
    store.raise_max(new, 0, 4)
    assert store.maxima([name]) == {name: 4}


def test_an_allocator_is_never_reset_and_its_mark_outlives_it(store: Store, name: str) -> None:
    store.open_counter(name, "ids", 1)
    assert store.reserve(name, 10) == 10
    with pytest.raises(ValidationError, match="id allocator"):
        store.delete(name, reset=True)
    assert store.total(name) == 10
    assert store.delete(name) is not None
    assert store.total(name) == 0  # no allocator: no value
    store.open_counter(name, "sharded", 2)
    assert store.total(name) == 0  # the mark is no sharded counter's value
    store.delete(name)
    store.open_counter(name, "ids", 1)
    assert store.total(name) == 10
    assert store.reserve(name, 5) == 15


@pytest.mark.parametrize("kind", list(STORE_URLS))
def test_racing_schema_creations_all_succeed(kind: str, sqlite_url: str) -> None:
    """Processes that start together (a Celery worker and its app, gunicorn workers) each
    create the schema: every racer succeeds, however their table creations interleave."""
    url = store_url_for(kind, sqlite_url)
    for _ in range(3):
        prefix = f"{PREFIX}race{uuid.uuid4().hex[:6]}_"
        stores = [open_store(url, prefix=prefix) for _ in range(6)]
        try:
            run_together(len(stores), lambda i, racers=stores: racers[i].create_schema())
            stores[0].add("race", 0, 1)
            assert stores[-1].total("race") == 1
        finally:
            stores[0].metadata.drop_all(stores[0].engine)  # type: ignore[attr-defined]
            for store in stores:
                store.close()


def test_a_redoable_statement_is_prepared_again_when_the_session_lost_it() -> None:
    """``LibpqStatement.redoable`` after a ``DEALLOCATE ALL``: outside a transaction it
    prepares the statement again and runs it; in one, whose failure the lost statement
    aborted, it returns None, and its next run, after the rollback, prepares it first."""
    import psycopg

    url = STORE_URLS["postgres"]
    assert url is not None
    require(url)
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        run = LibpqStatement("SELECT $1::int + 1").redoable(conn)
        assert run([1]).get_value(0, 0) == b"2"
        conn.execute("DEALLOCATE ALL")
        assert run([2]).get_value(0, 0) == b"3"
        conn.autocommit = False
        conn.execute("DEALLOCATE ALL")  # in the transaction it begins
        assert run([3]) is None
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        conn.rollback()
        assert run([4]).get_value(0, 0) == b"5"
        prepared = conn.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'SELECT $1%'"
        ).fetchone()
        assert prepared == (1,)


def test_a_thread_waiting_in_a_pipeline_holds_no_gil() -> None:
    """What the scaling guide states of threads: with psycopg's binary implementation
    (the one installed, which the guide names), a thread whose pipeline (``executemany``,
    as SQLAlchemy runs a list of parameters) waits for the server holds no GIL. This
    thread, meanwhile, sees it wait on a lock and releases the lock through a pipeline
    of its own. (A wait holding the GIL would stop this thread until the server's
    ``lock_timeout`` failed the other.)"""
    import psycopg

    url = STORE_URLS["postgres"]
    assert url is not None
    require(url)
    assert psycopg.pq.__impl__ == "binary"
    assert '`psycopg.pq.__impl__ == "binary"`' in (ROOT / "docs" / "scaling.md").read_text()
    assert psycopg.Pipeline.is_supported()  # executemany pipelines its statements
    key = random.getrandbits(62)
    dsn = url.replace("+psycopg", "")
    with (
        psycopg.connect(dsn, autocommit=True) as holder,
        psycopg.connect(dsn, autocommit=True) as waiter,
    ):
        holder.execute("SELECT pg_advisory_lock(%s)", [key])
        waiter.execute("SET lock_timeout = '30s'")
        pid = waiter.info.backend_pid
        ended: list[object] = []

        def pipeline() -> None:
            try:
                with waiter.cursor() as cursor:
                    cursor.executemany("SELECT pg_advisory_xact_lock(%s)", [(key,)] * 3)
                ended.append("done")
            except psycopg.Error as exc:
                ended.append(exc)

        thread = threading.Thread(target=pipeline)
        thread.start()
        try:
            waiting = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s"
            wait_for(
                lambda: holder.execute(waiting, [pid]).fetchone() == ("Lock",),
                "the pipelined statement to wait on the lock",
                status=lambda: ended,
            )
            with holder.cursor() as cursor:
                cursor.executemany("SELECT pg_advisory_unlock(%s)", [(key,)])
        finally:
            thread.join(60)
    assert ended == ["done"]
