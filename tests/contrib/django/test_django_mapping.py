"""Django querysets as mapping sources, and ``manage.py shardkit_jobs``."""

from __future__ import annotations

import pickle
import threading
from functools import partial
from typing import Any

import pytest
from django.core.management import call_command
from django.db import transaction
from django.db.models import F
from django.db.models.signals import post_init

from executors import HeldExecutor
from shardkit import Batch, Completion, ConfigurationError, JobNotFound
from shardkit.contrib.django import kit
from shardkit.contrib.django.source import QuerySetSource
from shardkit.mapper.spec import Signer
from videos.models import Account

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def make_accounts(count: int) -> None:
    Account.objects.bulk_create(
        Account(email=f"user{i:05}@example.com", active=i % 4 != 0) for i in range(count)
    )


@pytest.mark.slow
def test_a_queryset_is_mapped_exactly_once_through_failing_pages(database: str) -> None:
    make_accounts(3000)
    failed: set[int] = set()
    completions: list[int] = []
    lock = threading.Lock()

    def add_credit(batch: Batch) -> None:
        assert all(isinstance(row, Account) and row.active for row in batch.rows)
        ids = [row.pk for row in batch.rows]
        # Through the ORM, in the transaction that commits the page's checkpoint.
        Account.objects.filter(pk__in=ids).update(balance=F("balance") + 10)
        with lock:
            first = ids[0]
            if first % 7 == 0 and first not in failed:  # about 1 page in 7 fails once
                failed.add(first)
                raise RuntimeError(f"page at {first} failed after its update")

    def notify(completion: Completion) -> None:
        completions.append(completion.rows)

    job = kit().map(
        Account.objects.filter(active=True),
        add_credit,
        transactional=True,
        page_size=40,
        fanout=4,
        on_complete=notify,
    )
    status = job.wait(timeout=120)
    active = Account.objects.filter(active=True).count()
    assert failed  # pages did fail, and were retried
    assert status.state == "complete"
    assert status.rows == active == 2250
    assert status.depth >= 1  # the range split
    assert sorted(set(Account.objects.filter(active=True).values_list("balance", flat=True))) == [
        10
    ]
    assert set(Account.objects.filter(active=False).values_list("balance", flat=True)) == {0}
    assert completions == [active]


def test_a_values_queryset_is_mapped_without_building_an_instance_per_row(
    database: str,
) -> None:
    """The stated cost and the way past it: a model queryset's pages are model
    instances, one built per row visited (Django's ``post_init`` counts them); a
    ``values_list()`` or ``values()`` queryset's are tuples or dicts, no instance built,
    in a transactional job too."""
    make_accounts(120)
    built: list[int] = []

    def count(instance: Account, **_: Any) -> None:
        built.append(instance.pk)

    def visit(queryset: Any, **options: Any) -> list[Any]:
        seen: list[Any] = []

        def keep(batch: Any) -> None:
            # A page's rows count once it commits: on SQLite under Django 4.2 (no
            # IMMEDIATE transactions) a transactional page can meet the other worker's
            # lock, fail and run again.
            transaction.on_commit(partial(seen.extend, batch.rows), using=database)

        job = kit().map(queryset, keep, page_size=20, **options)
        assert job.wait(timeout=60).rows == len(seen)
        return seen

    active = Account.objects.filter(active=True)
    post_init.connect(count, sender=Account)
    try:
        pairs = visit(active.values_list("balance", "id"), fanout=2, transactional=True)
        named = visit(Account.objects.values_list("pk", "email", named=True))
        flat = visit(Account.objects.values_list("id", flat=True))
        dicts = visit(active.values("email", "pk"))
        every = visit(Account.objects.values())
        assert built == []
        instances = visit(active)
    finally:
        post_init.disconnect(count, sender=Account)
    ids = sorted(active.values_list("id", flat=True))
    assert len(ids) == 90
    assert sorted(pairs) == sorted((0, pk) for pk in ids)
    assert all(type(row) is tuple for row in pairs)
    assert sorted(row.pk for row in named) == sorted(flat) == sorted(row["id"] for row in every)
    assert sorted(flat) == sorted(Account.objects.values_list("id", flat=True))
    assert sorted(row["pk"] for row in dicts) == ids
    assert sorted(built) == sorted(row.pk for row in instances) == ids  # one per row
    with pytest.raises(ConfigurationError, match="must hold its key 'id'"):
        kit().map(Account.objects.values_list("email", "balance"), lambda batch: None)
    with pytest.raises(ConfigurationError, match="must hold its key 'email'"):
        kit().map(Account.objects.values("id"), lambda batch: None, key="email")


def test_a_queryset_of_another_database_is_refused(database: str) -> None:
    other = "postgres" if database == "default" else "default"
    with pytest.raises(ConfigurationError, match="SHARDKIT"):
        kit().map(Account.objects.using(other).all(), lambda batch: None)
    with pytest.raises(ConfigurationError, match="not unique"):
        kit().map(Account.objects.all(), lambda batch: None, key="active")


def test_a_pickled_queryset_source_carries_its_query_not_its_rows(database: str) -> None:
    make_accounts(20)
    queryset = Account.objects.filter(active=False, email__startswith="user0001")
    source = QuerySetSource(queryset)
    signer = Signer("s3cret")
    text = signer.dumps(source)
    assert queryset._result_cache is None  # not evaluated by pickling
    assert b"user00012@example.com" not in pickle.dumps(source)
    rebuilt = signer.loads(text)
    assert isinstance(rebuilt, QuerySetSource)
    assert list(rebuilt.queryset.values_list("email", flat=True).order_by("email")) == [
        "user00012@example.com",
        "user00016@example.com",
    ]
    # A values_list queryset's rows keep their shape: tuples, its key read from them.
    pairs = signer.loads(signer.dumps(QuerySetSource(queryset.values_list("email", "id"))))
    assert isinstance(pairs, QuerySetSource)
    rows = sorted(pairs.queryset)
    assert [row[0] for row in rows] == ["user00012@example.com", "user00016@example.com"]
    assert [pairs.key_of(row) for row in rows] == [row[1] for row in rows]


def test_jobs_command_lists_and_shows_jobs(
    database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    make_accounts(50)
    seen: list[Any] = []
    job = kit().map(Account.objects.all(), lambda batch: seen.extend(batch.rows), page_size=20)
    job.wait(timeout=60)
    assert len(seen) == 50
    call_command("shardkit_jobs")
    assert job.id[:8] in capsys.readouterr().out
    call_command("shardkit_jobs", "status", job.id)
    shown = capsys.readouterr().out
    assert "complete" in shown
    assert "50" in shown
    with pytest.raises(Exception, match="no job"):
        call_command("shardkit_jobs", "status", "no-such-job")


@pytest.mark.parametrize("ending", ["commit", "rollback"])
def test_a_job_started_in_an_atomic_block_runs_once_the_block_commits(
    database: str, settings: Any, ending: str
) -> None:
    """The job is recorded in the caller's transaction, which other connections do not
    see until it commits: its first task is submitted then, not before (a task run
    before would find no job to run, and the job would wait for ever); a block that
    rolls back leaves no job and submits nothing."""
    held = HeldExecutor()
    settings.SHARDKIT = {**settings.SHARDKIT, "EXECUTOR": held, "SECRET": "s" * 32}
    make_accounts(10)
    with transaction.atomic(using=database):
        job = kit().map(Account.objects.all(), add_one, transactional=True, page_size=4)
        assert held.submitted == []  # the job is not there yet for a worker to see
        transaction.set_rollback(ending == "rollback", using=database)
    if ending == "rollback":
        assert held.submitted == []
        with pytest.raises(JobNotFound):
            job.status()
        return
    assert len(held.submitted) == 1  # the root range's task, once the block commits
    while held.submitted:  # each task as a worker runs it: the root, then its children
        _, args = held.submitted.pop()
        kit().mapper.run_range(args["job"], args["range"])
    assert job.wait(timeout=60).rows == 10
    assert set(Account.objects.values_list("balance", flat=True)) == {1}


def add_one(batch: Batch) -> None:
    Account.objects.filter(pk__in=[r.pk for r in batch.rows]).update(balance=F("balance") + 1)


def test_a_transactional_page_joins_no_outer_transaction(database: str) -> None:
    """A job started inside the caller's atomic block runs its pages in their own
    transactions: the caller's rollback does not undo them."""
    make_accounts(10)

    def add(batch: Batch) -> None:
        Account.objects.filter(pk__in=[r.pk for r in batch.rows]).update(balance=F("balance") + 1)

    with transaction.atomic(using=database):
        job = kit().map(Account.objects.all(), add, transactional=True, page_size=4)
    job.wait(timeout=60)
    assert set(Account.objects.values_list("balance", flat=True)) == {1}
