"""Counts on Django models: counting updates through the ORM, reads, admin, templates."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa
from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connections, models, transaction
from django.db.models import F, Value
from django.test import Client
from django.test.utils import CaptureQueriesContext

from executors import HeldExecutor
from shardkit.contrib.django import CountingQuerySet, NotACountingUpdate, ShardedCount, kit
from shardkit.contrib.django import statements as counting
from shardkit.contrib.django.counts import DEFAULT_EXISTS_TTL
from shardkit.contrib.django.querysets import check_managers
from shardkit.contrib.django.store import DjangoStore
from shardkit.counters import sharded
from shardkit.counters.sizing import LOOKBACK, WINDOW
from shardkit.errors import InvalidDelta, InvalidShardCount, ValidationError
from traces import queries_sent, statements_run
from videos.models import Video

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def views(video: Video) -> int:
    return video.views.value(fresh=True)


def test_a_counting_update_moves_the_counter_of_each_matched_object(database: str) -> None:
    a, b, c = (Video.objects.create(title=title) for title in "abc")
    assert Video.objects.filter(pk__in=[a.pk, b.pk]).update(views=F("views") + 2) == 2
    assert Video.objects.filter(pk=a.pk).update(views=F("views") - 3) == 1
    assert Video.objects.filter(pk=c.pk).update(views=5 + F("views")) == 1
    assert [views(a), views(b), views(c)] == [-1, 2, 5]
    assert Video.objects.filter(pk=-1).update(views=F("views") + 1) == 0


def test_a_filter_by_key_is_checked_at_once_and_matches_as_djangos(database: str) -> None:
    a, b = Video.objects.create(title="a"), Video.objects.create(title="b")
    with pytest.raises(ValueError, match="expected a number"):
        Video.objects.filter(pk="one")  # refused by the call, as Django refuses it
    by_key = Video.objects.filter(pk=str(a.pk))
    assert str(by_key.query) == str(models.QuerySet(Video).filter(pk=a.pk).query)
    assert list(by_key) == [a]
    assert (by_key.filter(title="b").exists(), by_key.exclude(title="b").count()) == (False, 1)
    assert list(Video.objects.filter(id__exact=b.pk).values_list("title", flat=True)) == ["b"]
    with pytest.raises(TypeError, match="slice"):
        Video.objects.filter(pk=a.pk)[:1].update(views=F("views") + 1)
    assert Video.objects.filter(pk=a.pk).filter(pk=b.pk).update(views=F("views") + 1) == 0
    assert Video.objects.filter(title="b").filter(pk=a.pk).update(views=F("views") + 1) == 0
    assert Video.objects.distinct().filter(pk=a.pk).update(views=F("views") + 1) == 1
    assert by_key.update(views=F("views") + 2) == 1
    assert (views(a), views(b)) == (3, 0)


def test_other_fields_update_in_the_same_call(database: str) -> None:
    a, b = Video.objects.create(title="a"), Video.objects.create(title="b")
    matched = Video.objects.filter(pk=a.pk).update(title="renamed", views=F("views") + 1)
    assert matched == 1
    assert list(Video.objects.order_by("pk").values_list("title", flat=True)) == ["renamed", "b"]
    assert (views(a), views(b)) == (1, 0)


def test_a_counting_update_shares_the_transaction_of_the_update(database: str) -> None:
    video = Video.objects.create(title="a")
    with transaction.atomic(using=database):
        Video.objects.filter(pk=video.pk).update(title="gone", views=F("views") + 10)
        video.views.incr(5)
        assert views(video) == 15  # visible inside the transaction
        transaction.set_rollback(True, using=database)
    assert views(video) == 0
    assert Video.objects.get(pk=video.pk).title == "a"
    with transaction.atomic(using=database):
        Video.objects.filter(pk=video.pk).update(views=F("views") + 1)
    assert views(video) == 1


def test_a_rolled_back_update_adds_nothing_to_a_buffered_count(
    database: str, settings: Any
) -> None:
    settings.SHARDKIT = {**settings.SHARDKIT, "EXECUTOR": HeldExecutor()}
    video = Video.objects.create(title="a")
    with transaction.atomic(using=database):
        Video.objects.filter(pk=video.pk).update(likes=F("likes") + 4)
        assert video.likes.counter.parts().total == 0  # taken when the transaction commits
        transaction.set_rollback(True, using=database)
    assert video.likes.value() == 0
    Video.objects.filter(pk=video.pk).update(likes=F("likes") + 4)
    assert video.likes.value() == 4


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (5, NotACountingUpdate),
        (F("views") * 2, NotACountingUpdate),
        (F("title") + 1, NotACountingUpdate),
        (F("views") + F("views"), NotACountingUpdate),
        (Value(3), NotACountingUpdate),
        (F("views") + 1.5, InvalidDelta),
        (F("views") + 2**63, InvalidDelta),
    ],
)
def test_an_update_that_is_not_a_counting_update_raises_and_writes_nothing(
    database: str, value: Any, error: type[Exception]
) -> None:
    video = Video.objects.create(title="a")
    with pytest.raises(error):
        Video.objects.filter(pk=video.pk).update(title="changed", views=value)
    assert Video.objects.get(pk=video.pk).title == "a"
    assert views(video) == 0


def test_counts_live_in_the_kits_database_only(database: str) -> None:
    other = "postgres" if database == "default" else "default"
    video = Video.objects.create(title="a")
    with pytest.raises(NotACountingUpdate, match="could not share its transaction"):
        Video.objects.using(other).filter(pk=video.pk).update(views=F("views") + 1)


@pytest.mark.slow
def test_counting_updates_from_many_threads_sharing_shard_rows_are_exact(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One shard per count: every write of a video's count is on one row, which the
    # threads write at once (an upsert that read and then wrote would lose increments).
    monkeypatch.setattr(Video.views, "shards", 1)
    videos = [Video.objects.create(title=f"v{i}") for i in range(2)]
    pks = [video.pk for video in videos]
    threads, rounds = 8, 25
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def write(index: int) -> None:
        try:
            start.wait()
            for turn in range(rounds):
                video = videos[(index + turn) % len(videos)]
                if turn % 5 == 4:
                    video.views.incr(2)  # through the counter, outside an update
                elif turn % 5 == 3:  # both rows, in one transaction, in key order
                    Video.objects.filter(pk__in=pks).update(views=F("views") + 1)
                else:
                    Video.objects.filter(pk=video.pk).update(views=F("views") + 1)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    workers = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors
    infos = [kit().store.counter(video.views.counter.name) for video in videos]
    assert [info and info.shards for info in infos] == [1, 1]
    expected = [0] * len(videos)
    for index in range(threads):
        for turn in range(rounds):
            if turn % 5 == 3:
                expected = [total + 1 for total in expected]
            else:
                expected[(index + turn) % len(videos)] += 2 if turn % 5 == 4 else 1
    # Each thread: 15 updates of +1, 5 of +1 on both, 5 increments of +2.
    assert sum(expected) == threads * (15 + 5 * 2 + 5 * 2)
    assert [views(video) for video in videos] == expected


def shard_rows(name: str) -> dict[int, int]:
    """The shard rows of counter ``name``, as the store holds them."""
    shards = kit().store.shards_table
    with kit().store.engine.connect() as conn:
        rows = conn.execute(sa.select(shards.c.shard, shards.c.value).where(shards.c.name == name))
        return {int(shard): int(value) for shard, value in rows}


def test_a_count_sizes_each_objects_counter_and_writes_within_its_current_shards(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Video.views.shards == "auto"  # the example's, by default
    video = Video.objects.create(title="a")
    assert Video.objects.filter(pk=video.pk).update(views=F("views") + 1) == 1
    counter = video.views.counter
    assert counter.shards == 1  # created with one
    assert shard_rows(counter.name) == {0: 1}
    counter.grow(4)  # as a growth decided by another process
    shard = counting.writer_ticket(kit()) % 4  # this thread's, among the current four
    assert Video.objects.filter(pk=video.pk).update(views=F("views") + 2) == 1
    assert Video.objects.filter(pk__in=[video.pk]).update(views=F("views") + 3) == 1
    assert shard_rows(counter.name) == {0: 1, shard: 5} if shard else {0: 6}
    monkeypatch.setattr(Video.views, "shards", 8)  # a fixed count: created with eight
    other = Video.objects.create(title="b")
    assert Video.objects.filter(pk__in=[other.pk]).update(views=F("views") + 1) == 1
    assert (other.views.counter.shards, views(other)) == (8, 1)
    assert shard_rows(other.views.counter.name) == {counting.writer_ticket(kit()) % 8: 1}
    for bad in ("many", 0, 2.5, True):
        with pytest.raises(InvalidShardCount):
            ShardedCount(shards=bad)  # type: ignore[arg-type]


def test_a_counting_update_writes_within_the_shards_its_process_holds(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object's counter this process holds open gives the statement its shards: a
    growth made elsewhere is taken up when they are read again, as ``incr()`` takes it."""
    monkeypatch.setattr(counting._tickets, "ticket", (os.getpid(), 5), raising=False)
    video = Video.objects.create(title="a")
    assert Video.objects.filter(pk=video.pk).update(views=F("views") + 1) == 1  # opens it
    name = video.views.counter.name
    kit().store.open_counter(name, "sharded", 4)  # grown by another process
    assert Video.objects.filter(pk=video.pk).update(views=F("views") + 2) == 1
    assert shard_rows(name) == {0: 3}  # within the one shard it holds
    monkeypatch.setattr(sharded, "_SHARDS_REFRESH", 0.0)  # as when they are 10 s old
    assert Video.objects.filter(pk=video.pk).update(views=F("views") + 4) == 1
    assert shard_rows(name) == {0: 3, 5 % 4: 4}
    assert views(video) == 7


def test_a_fixed_count_grows_a_counter_held_with_fewer_shards_before_it_writes(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A count of ``shards=8`` whose object's counter this process holds as automatic (1
    shard) grows it to 8 before its first counting update, which writes within the 8."""
    monkeypatch.setattr(counting._tickets, "ticket", (os.getpid(), 5), raising=False)
    monkeypatch.setattr(Video.views, "shards", 8)
    video = Video.objects.create(title="a")
    name = Video.views.counter_name(Video, video.pk)
    assert kit().sharded(name).shards == 1  # held, automatic
    assert Video.objects.filter(pk=video.pk).update(views=F("views") + 2) == 1
    assert shard_rows(name) == {5: 2}  # ticket 5 among 8 shards
    assert (kit().store.counter(name).shards, views(video)) == (8, 2)  # type: ignore[union-attr]


def test_a_count_opens_each_objects_counter_through_the_kit_once(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counting updates, ``incr()`` and ``value()`` of an object open its counters
    through the kit once; again only once the kit stopped holding one (ended here)."""
    the_kit = kit()
    opened: list[str] = []
    for kind in ("sharded", "buffered"):
        real = getattr(the_kit, kind)

        def opening(name: str, *args: Any, real: Any = real) -> Any:
            opened.append(name)
            return real(name, *args)

        monkeypatch.setattr(the_kit, kind, opening)  # counts the kit's opens
    video = Video.objects.create(title="a")
    for _ in range(3):
        assert Video.objects.filter(pk=video.pk).update(views=F("views") + 1) == 1
        assert Video.objects.filter(pk__in=[video.pk]).update(likes=F("likes") + 1) == 1
        video.views.incr()
        video.likes.incr()
        assert views(video) > 0
    names = [Video.views.counter_name(Video, video.pk), Video.likes.counter_name(Video, video.pk)]
    assert sorted(opened) == sorted(names)
    the_kit.delete(names[0])
    video.views.incr()
    assert opened.count(names[0]) == 2
    assert views(video) == 1


@pytest.mark.parametrize("database", ["postgres"], indirect=True)
def test_counting_updates_waiting_on_their_row_grow_the_count_once(
    database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Counting updates held on their row by another transaction, with other writers
    reported (as other processes would report themselves): the object's counter grows
    once, and counts exactly."""
    caplog.set_level(logging.INFO, logger="shardkit")
    video = Video.objects.create(title="a")
    Video.objects.filter(pk=video.pk).update(views=F("views") + 1)
    name = video.views.counter.name
    settings = kit().settings
    second = int(time.time() / WINDOW)
    for offset in range(-LOOKBACK, 4):  # three more writers, every second of the run
        kit().cache.add(settings.cache_key(name, f"sharded:writers:{second + offset}"), 3, 60)
    shards = kit().store.shards_table.name
    stop = threading.Event()

    def hold_the_row() -> None:  # another writer's transactions on the row
        try:
            while not stop.is_set():
                with transaction.atomic(using=database):
                    with connections[database].cursor() as cursor:
                        cursor.execute(
                            f"SELECT value FROM {shards} WHERE name = %s FOR UPDATE", [name]
                        )
                    time.sleep(0.01)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_the_row)
    holder.start()
    done = 1
    try:
        end = time.monotonic() + 2.5 * WINDOW
        while time.monotonic() < end:
            done += Video.objects.filter(pk=video.pk).update(views=F("views") + 1)
    finally:
        stop.set()
        holder.join()
    assert (video.views.counter.shards, views(video)) == (4, done)
    growths = [r.getMessage() for r in caplog.records if "grew" in r.getMessage()]
    assert len(growths) == 1, growths
    assert re.search(f"{re.escape(repr(name))} grew from 1 to 4 shards", growths[0])


@pytest.mark.parametrize("database", ["postgres"], indirect=True)
@pytest.mark.parametrize("by", ["update", "incr"])
def test_threads_waiting_on_their_row_grow_the_count_to_as_many_shards(
    database: str, by: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Eight threads of one process, each writing on a home shard of its own (its
    ticket), whose writes — counting updates, or ``incr()`` — wait on the one row their
    transactions hold: the object's counter grows once, to eight shards — the process
    counted as one writer, it would keep its one — and counts exactly."""
    caplog.set_level(logging.INFO, logger="shardkit")
    video = Video.objects.create(title="a")
    counter = video.views.counter  # created with one shard; the threads are its writers
    stop = threading.Event()
    done = [0] * 8

    def write(slot: int) -> None:
        try:
            while not stop.is_set():
                with transaction.atomic(using=database):
                    if by == "update":
                        Video.objects.filter(pk=video.pk).update(views=F("views") + 1)
                    else:
                        video.views.incr()
                    time.sleep(0.002)  # the rest of the transaction's work, the row held
                done[slot] += 1
        finally:
            connections.close_all()

    threads = [threading.Thread(target=write, args=(slot,)) for slot in range(8)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 10 * WINDOW
        while counter.shards == 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert (counter.shards, views(video)) == (8, sum(done))
    growths = [r.getMessage() for r in caplog.records if "grew" in r.getMessage()]
    assert len(growths) == 1, growths
    assert re.search(f"{re.escape(repr(counter.name))} grew from 1 to 8 shards", growths[0])


def test_with_counts_reads_a_page_of_counts_in_one_store_query(database: str) -> None:
    videos = [Video.objects.create(title=f"v{i:02}") for i in range(12)]
    for i, video in enumerate(videos):
        Video.objects.filter(pk=video.pk).update(views=F("views") + i, likes=F("likes") + 2 * i)
    store = kit().store
    assert isinstance(store, DjangoStore)
    statements: list[str] = []
    here = threading.current_thread()  # not a buffered count's flush on a worker thread

    def record(*args: Any) -> None:
        if threading.current_thread() is here:
            statements.append(args[2])

    sa.event.listen(store.engine, "before_cursor_execute", record)
    page = list(Video.objects.with_counts("views").order_by("title")[:10])
    assert len(statements) == 1
    assert [video.views.value() for video in page] == list(range(10))
    assert len(statements) == 1  # values read with the page, no query per object
    both = list(Video.objects.with_counts().order_by("title"))
    assert [int(video.likes) for video in both] == [2 * i for i in range(12)]
    assert [str(video.views) for video in both] == [str(i) for i in range(12)]


def test_a_read_of_counts_is_one_statement_on_djangos_connection(database: str) -> None:
    videos = [Video.objects.create(title=f"v{i}") for i in range(3)]
    for i, video in enumerate(videos):
        video.views.incr(i)
    with statements_run(database) as ran:  # outside a transaction: no BEGIN, no ROLLBACK
        page = list(Video.objects.with_counts("views").order_by("pk"))
    assert ran == ["SELECT", "SELECT"]  # the page, then its counts
    assert [video.views.value() for video in page] == [0, 1, 2]
    with statements_run(database) as ran, transaction.atomic(using=database):
        videos[0].views.incr(5)
        assert views(videos[0]) == 5  # read in the caller's transaction, no savepoint
    assert ran == ["BEGIN", "INSERT", "SELECT", "COMMIT"]


def test_a_counting_update_of_a_sharded_count_is_one_statement(database: str) -> None:
    a, b = Video.objects.create(title="a"), Video.objects.create(title="b")
    views(a)  # the counter exists: the first update of an object in a process opens it
    with statements_run(database) as ran:
        assert Video.objects.filter(pk=a.pk).update(views=F("views") + 3) == 1
    assert ran == ["INSERT"]  # finds the object and adds to its shard row
    with statements_run(database) as ran:
        assert Video.objects.filter(title="nobody").update(views=F("views") + 1) == 0
    assert ran == ["INSERT"]
    with statements_run(database) as ran:
        matched = Video.objects.filter(pk=a.pk).update(title="A", views=F("views") + 1)
    assert matched == 1
    assert [s for s in ran if s not in ("BEGIN", "COMMIT")] == ["INSERT", "UPDATE"]
    assert (views(a), views(b)) == (4, 0)
    assert Video.objects.get(pk=a.pk).title == "A"


@pytest.mark.parametrize("database", ["postgres"], indirect=True)
def test_a_counting_update_runs_prepared_unless_behind_a_pooler(database: str) -> None:
    video = Video.objects.create(title="a")
    for _ in range(3):
        assert Video.objects.filter(pk=video.pk).update(views=F("views") + 1) == 1
    connection = connections[database]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pooled = cursor.fetchone()[0] != connection.connection.info.backend_pid
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [row[0] for row in cursor.fetchall()]
    # Planned once per connection, where no pooler may move it to another session.
    counting = [sql for sql in prepared if sql.startswith("INSERT INTO") and "EXISTS" in sql]
    assert len(counting) == (0 if pooled else 1)
    assert views(video) == 3


@pytest.mark.parametrize("database", ["postgres"], indirect=True)
def test_a_counting_update_first_in_a_transaction_begins_it_as_psycopg_would(
    database: str,
) -> None:
    """The transaction's first statement, run through libpq: the transaction is begun on
    the server with the connection's settings, and the count rolls back with it."""
    import psycopg

    video = Video.objects.create(title="a")
    connection = connections[database]
    raw = connection.connection
    raw.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    raw.read_only = False
    try:
        with transaction.atomic(using=database):
            assert Video.objects.filter(pk=video.pk).update(views=F("views") + 2) == 1
            with connection.cursor() as cursor:
                cursor.execute("SELECT current_setting('transaction_isolation')")
                assert cursor.fetchone()[0] == "repeatable read"
            assert views(video) == 2  # the same transaction's
            transaction.set_rollback(True, using=database)
    finally:
        raw.isolation_level = raw.read_only = None
    assert views(video) == 0
    assert Video.objects.filter(pk=video.pk).update(views=F("views") + 1) == 1  # autocommit
    assert views(video) == 1


@pytest.mark.parametrize("database", ["postgres"], indirect=True)
def test_a_counting_update_first_in_a_transaction_sends_its_begin_with_it(database: str) -> None:
    """Where it runs prepared (not behind a pooler), the statement of a counting update
    by key that is the first of its transaction goes with the transaction's BEGIN, in
    one round trip (psycopg sends its BEGIN on its own); a second statement of the
    transaction is one more, and the COMMIT another."""
    connection = connections[database]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pooled = cursor.fetchone()[0] != connection.connection.info.backend_pid
    video = Video.objects.create(title="a")
    assert Video.objects.filter(pk=video.pk).update(views=F("views") + 1) == 1  # opened
    with transaction.atomic(using=database):  # prepared at its first run on a connection
        assert Video.objects.filter(pk=video.pk).update(views=F("views") + 2) == 1
    with queries_sent(database) as sent, transaction.atomic(using=database):
        assert Video.objects.filter(pk=video.pk).update(views=F("views") + 3) == 1
        assert Video.objects.filter(pk=video.pk).update(views=F("views") + 4) == 1
    if pooled:  # BEGIN, then each statement sent whole
        assert sent == ["extended", "extended", "extended", "COMMIT"]
    else:
        assert sent[0].startswith("BEGIN; EXECUTE "), sent
        assert sent[1:] == ["extended", "COMMIT"]
    assert views(video) == 10
    with transaction.atomic(using=database):
        assert Video.objects.filter(pk=video.pk).update(views=F("views") + 5) == 1
        transaction.set_rollback(True, using=database)
    assert views(video) == 10


def counting_runs(database: str) -> int:
    """How many times the server has run the counting statement prepared on Django's
    connection ``database`` (its plans made, by ``pg_prepared_statements``)."""
    with connections[database].cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(generic_plans + custom_plans), 0) FROM pg_prepared_statements"
            " WHERE statement LIKE 'INSERT INTO%%' AND statement LIKE '%%EXISTS%%'"
        )
        return int(cursor.fetchone()[0])


@pytest.mark.parametrize("database", ["postgres"], indirect=True)
def test_with_psycopgs_preparing_on_a_counting_update_runs_prepared_first_in_a_transaction(
    database: str,
) -> None:
    """With psycopg preparing statements of its own (``prepare_threshold`` and
    ``server_side_binding`` in ``OPTIONS``), a counting update that begins a transaction
    runs prepared, with its BEGIN in one round trip, even after psycopg deallocated every
    statement of the session on a rollback (found missing, the transaction is rolled
    back and the statement sent again, prepared first); a later one in the transaction
    is sent whole, as the docs state: the server runs the prepared statement once per
    transaction."""
    from django.db.backends.postgresql.base import ServerBindingCursor

    connection = connections[database]
    connection.ensure_connection()
    raw = connection.connection
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        if cursor.fetchone()[0] != raw.info.backend_pid:  # behind a pooler
            assert raw.prepare_threshold is None  # psycopg's preparing turned off
            return
    video = Video.objects.create(title="a")
    assert Video.objects.filter(pk=video.pk).update(views=F("views") + 1) == 1  # opened
    factory = raw.cursor_factory
    raw.prepare_threshold, raw.cursor_factory = 0, ServerBindingCursor
    try:
        with transaction.atomic(using=database):  # prepared at its first run on a connection
            assert Video.objects.filter(pk=video.pk).update(views=F("views") + 1) == 1
        for delta, lost in ((2, False), (3, True)):
            runs = counting_runs(database)
            with queries_sent(database) as sent, transaction.atomic(using=database):
                assert Video.objects.filter(pk=video.pk).update(views=F("views") + delta) == 1
                assert Video.objects.filter(pk=video.pk).update(views=F("views") + delta) == 1
            begun = sent[0]
            assert begun.startswith("BEGIN; EXECUTE "), sent
            # Found missing: rolled back, prepared again, sent again.
            again = ["ROLLBACK", "extended", begun] if lost else []
            assert sent[1:] == [*again, "extended", "COMMIT"]
            assert counting_runs(database) == runs + 1
            # psycopg prepares statements of its own (the read, at once), then
            # deallocates them all, the counting statement too, as it rolls back.
            with transaction.atomic(using=database):
                Video.objects.get(pk=video.pk)
                transaction.set_rollback(True, using=database)
            assert counting_runs(database) == 0
    finally:
        raw.prepare_threshold, raw.cursor_factory = None, factory
    assert views(video) == 12


def test_a_counting_statement_is_seen_by_execute_wrappers_and_the_query_log(
    database: str,
) -> None:
    video = Video.objects.create(title="a")
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    connection = connections[database]
    with connection.execute_wrapper(wrapper):  # as instrumentation (APM) installs
        assert Video.objects.filter(pk=video.pk).update(views=F("views") + 1) == 1
    with CaptureQueriesContext(connection) as logged:  # as DEBUG logs them
        assert Video.objects.filter(pk=video.pk).update(views=F("views") + 1) == 1
    shards = kit().store.shards_table.name
    assert next(sql for sql in seen if shards in sql).startswith("INSERT INTO")
    assert any(shards in query["sql"] for query in logged.captured_queries)
    assert views(video) == 2


def test_a_counting_update_of_a_buffered_count_by_key_needs_no_read(database: str) -> None:
    video = Video.objects.create(title="a")
    video.likes.incr()  # its counter has a generation: increments are cache commands only
    with statements_run(database) as ran:
        assert Video.objects.filter(pk=video.pk).update(title="b", likes=F("likes") + 2) == 1
    assert ran == ["UPDATE"]  # its row count says whether the object matched
    with statements_run(database) as ran:
        assert Video.objects.filter(pk=-1).update(title="c", likes=F("likes") + 2) == 0
    assert ran == ["UPDATE"]
    with statements_run(database) as ran:
        assert Video.objects.filter(pk=video.pk).update(likes=F("likes") + 1) == 1
    assert ran == ["SELECT"]  # whether it exists: nothing else would say
    assert video.likes.value() == 4


def test_a_buffered_count_takes_an_object_seen_to_exist_as_existing(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    video, other = Video.objects.create(title="a"), Video.objects.create(title="b")
    video.likes.incr()  # its counter has a generation: increments are cache commands only
    with transaction.atomic(using=database):  # seen in a transaction that rolls back: unseen
        assert Video.objects.filter(pk=video.pk).update(likes=F("likes") + 1) == 1
        transaction.set_rollback(True, using=database)
    with statements_run(database) as ran:
        assert Video.objects.filter(pk=video.pk).update(likes=F("likes") + 1) == 1
    assert ran == ["SELECT"]
    with statements_run(database) as ran:
        for _ in range(3):
            assert Video.objects.filter(pk=str(video.pk)).update(likes=F("likes") + 1) == 1
    assert ran == []  # seen: the increments are cache commands alone
    assert video.likes.value() == 5
    # Deleted elsewhere (another process, raw SQL): still taken as existing within the TTL.
    with connections[database].cursor() as cursor:
        cursor.execute("DELETE FROM videos_video WHERE id = %s", [video.pk])
    assert Video.objects.filter(pk=video.pk).update(likes=F("likes") + 1) == 1
    monkeypatch.setattr(Video.likes, "exists_ttl", 0.001)
    start = time.monotonic()
    while time.monotonic() - start <= 0.001:  # the sighting grows older than the TTL
        time.sleep(0.001)
    with statements_run(database) as ran:
        assert Video.objects.filter(pk=video.pk).update(likes=F("likes") + 1) == 0
    assert ran == ["SELECT"]
    # Deleted through the ORM here: forgotten at once.
    monkeypatch.undo()
    assert Video.objects.filter(pk=other.pk).update(likes=F("likes") + 1) == 1
    Video.objects.filter(pk=other.pk).delete()
    with statements_run(database) as ran:
        assert Video.objects.filter(pk=other.pk).update(likes=F("likes") + 1) == 0
    assert ran == ["SELECT"]


def test_exists_ttl_is_for_buffered_counts_only() -> None:
    with pytest.raises(ValidationError, match="exists_ttl is for buffered counts"):
        ShardedCount(exists_ttl=5)
    for bad in (-1, "5", True, float("nan")):
        with pytest.raises(ValidationError, match="exists_ttl"):
            ShardedCount(buffered=True, exists_ttl=bad)  # type: ignore[arg-type]
    assert ShardedCount(buffered=True, exists_ttl=5).exists_ttl == 5.0


def test_a_buffered_count_takes_an_object_seen_to_exist_by_default() -> None:
    assert ShardedCount(buffered=True).exists_ttl == DEFAULT_EXISTS_TTL == 60.0
    assert ShardedCount(buffered=True, exists_ttl=0).exists_ttl == 0.0  # reads every time
    assert ShardedCount().exists_ttl == 0.0  # a sharded count's statement finds the object
    assert Video.likes.exists_ttl == DEFAULT_EXISTS_TTL  # the example's, by default


def test_a_counting_update_moves_cached_values_only_when_it_commits(database: str) -> None:
    video = Video.objects.create(title="a")
    assert video.views.value() == 0  # cached
    with transaction.atomic(using=database):
        Video.objects.filter(pk=video.pk).update(views=F("views") + 10)
        transaction.set_rollback(True, using=database)
    assert video.views.value() == 0  # the cached value never showed the rolled-back 10
    Video.objects.filter(pk=video.pk).update(views=F("views") + 1)
    assert video.views.value() == 1  # cached, and moved at the commit
    assert views(video) == 1


def test_templates_and_the_admin_show_counts(database: str, admin_client: Client) -> None:
    video = Video.objects.create(title="Hello")
    Video.objects.filter(pk=video.pk).update(views=F("views") + 7, likes=F("likes") + 3)
    page = Client().get("/").content.decode()
    assert f'<a href="/videos/{video.pk}/">Hello</a>: 7 views, 3 likes' in page
    changelist = admin_client.get("/admin/videos/video/").content.decode()
    assert '<td class="field-views">7</td>' in changelist
    assert '<td class="field-likes">3</td>' in changelist
    change = admin_client.get(f"/admin/videos/video/{video.pk}/change/").content.decode()
    assert '<div class="readonly">7</div>' in change


def test_a_video_page_counts_its_views_and_takes_likes(database: str) -> None:
    video = Video.objects.create(title="Hello")
    client = Client()
    assert "1 views, 0 likes" in client.get(f"/videos/{video.pk}/").content.decode()
    assert "2 views, 0 likes" in client.get(f"/videos/{video.pk}/").content.decode()
    liked = client.post(f"/videos/{video.pk}/like")
    assert (liked.status_code, liked["Location"]) == (302, f"/videos/{video.pk}/")
    assert "3 views, 1 likes" in client.get(f"/videos/{video.pk}/").content.decode()
    assert client.get("/videos/0/").status_code == 404
    assert client.get(f"/videos/{video.pk}/like").status_code == 405
    assert views(video) == 3


def test_buffered_counts_are_flushed_by_the_command(
    database: str, settings: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    held = HeldExecutor()
    settings.SHARDKIT = {**settings.SHARDKIT, "EXECUTOR": held}
    video = Video.objects.create(title="a")
    Video.objects.filter(pk=video.pk).update(likes=F("likes") + 5)
    counter = video.likes.counter
    assert counter.parts() == (0, 5)
    [(task, args)] = held.submitted
    assert (task, args["name"]) == ("flush", counter.name)
    call_command("shardkit_flush", "--all")
    assert f"{counter.name} +5" in capsys.readouterr().out
    assert counter.parts() == (5, 0)


def test_buffered_counts_are_flushed_by_the_executor(database: str) -> None:
    video = Video.objects.create(title="a")
    Video.objects.filter(pk=video.pk).update(likes=F("likes") + 5)
    counter = video.likes.counter
    deadline = time.monotonic() + 10  # the model's interval is 1 s
    while counter.parts().stored != 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert counter.parts() == (5, 0)


def test_bad_settings_raise_improperly_configured(settings: Any) -> None:
    for bad in (
        {"STOER": "default"},
        {"STORE": "nowhere"},
        {"CACHE": "carrier-pigeon://"},
        {"EXECUTOR": "no.such.module:app"},
        {"EXECUTOR": 42},
        {"PREFIX": "no spaces"},
        {"CACHE_TTL": 0},
    ):
        with pytest.raises(ImproperlyConfigured, match="SHARDKIT"):
            settings.SHARDKIT = bad


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_nothing_happens_at_import_and_ready_raises_improperly_configured() -> None:
    imported = run_python(
        "import os; os.environ.pop('DJANGO_SETTINGS_MODULE', None)\n"
        "import shardkit.contrib.django, shardkit.contrib.django.apps\n"
        "from django.conf import settings; assert not settings.configured; print('ok')"
    )
    assert imported.stdout.strip() == "ok", imported.stderr
    setup = run_python(
        "import django; from django.conf import settings\n"
        "settings.configure(INSTALLED_APPS=['shardkit.contrib.django'], DATABASES={'default': "
        "{'ENGINE': 'django.db.backends.sqlite3', 'NAME': 'x.sqlite3'}},\n"
        "    SHARDKIT={'CACHE': 'carrier-pigeon://'})\n"
        "django.setup()"
    )
    assert "ImproperlyConfigured: settings.SHARDKIT: unknown cache URL scheme" in setup.stderr


def test_a_celery_app_named_in_settings_runs_the_kits_tasks(settings: Any) -> None:
    from celery import Celery

    from shardkit.contrib.celery import CeleryExecutor

    settings.SHARDKIT = {**settings.SHARDKIT, "EXECUTOR": "django_site.celery:app"}
    executor = kit().executor
    assert isinstance(executor, CeleryExecutor)
    assert isinstance(executor.app, Celery)
    assert {"shardkit.flush", "shardkit.flush_all", "shardkit.map_range"} <= set(executor.app.tasks)


def test_the_site_passes_the_system_check() -> None:
    assert check_managers([apps.get_app_config("videos")]) == []


@pytest.mark.django_isolate_apps("videos")
def test_a_model_with_counts_and_a_plain_manager_fails_the_system_check(
    django_isolated_apps: Any,
) -> None:
    class Plain(models.Model):
        hits = ShardedCount()

        class Meta:
            app_label = "videos"

    class Counting(models.Model):
        hits = ShardedCount()
        objects = CountingQuerySet.as_manager()

        class Meta:
            app_label = "videos"

    errors = check_managers(list(django_isolated_apps.get_app_configs()))
    assert [(error.id, error.obj) for error in errors] == [("shardkit.E001", Plain)]


@pytest.mark.parametrize("autocommit", [False, True])
def test_the_store_leaves_no_atomic_block_open(database: str, autocommit: bool) -> None:
    store = kit().store
    assert isinstance(store, DjangoStore)
    rows = store.read("reading", sa.select(sa.literal(7)), autocommit=autocommit)
    assert [tuple(row) for row in rows] == [(7,)]
    assert not connections[database].in_atomic_block
    with transaction.atomic(using=database):
        store.read("reading", sa.select(sa.literal(8)), autocommit=autocommit)
        assert connections[database].in_atomic_block  # the caller's, still open
    assert not connections[database].in_atomic_block
