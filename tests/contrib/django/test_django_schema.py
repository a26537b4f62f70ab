"""shardkit's tables in the Django database: ``migrate`` makes the missing ones, the
system check ``shardkit.W001`` names them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command

from shardkit.contrib.django import kit
from shardkit.contrib.django.conf import store_on
from shardkit.contrib.django.schema import check_tables, missing_tables, shardkit_tables
from shardkit.contrib.django.store import DjangoStore

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture
def new_prefix(database: str, settings: Any) -> Iterator[DjangoStore]:
    """``SHARDKIT['PREFIX']`` changed to a new one after the site was migrated: the store
    on the test's database with the new prefix. Its tables are dropped afterwards, and
    the app's migrations applied again if a test unapplied them."""
    before = settings.SHARDKIT
    settings.SHARDKIT = {**before, "PREFIX": f"sk{uuid.uuid4().hex[:8]}_"}
    store = store_on(database)
    yield store
    settings.SHARDKIT = before
    call_command("migrate", "shardkit", database=database, verbosity=0)
    for table in reversed(shardkit_tables(store)):
        table.drop(store.engine, checkfirst=True)


def test_migrate_creates_the_tables_of_a_new_prefix(database: str, new_prefix: DjangoStore) -> None:
    names = [table.name for table in shardkit_tables(new_prefix)]
    assert missing_tables(new_prefix) == names
    assert check_tables(databases=None) == []  # the check reaches a database only if asked
    (warning,) = check_tables(databases=[database])
    assert warning.id == "shardkit.W001"
    assert all(name in warning.msg for name in names)
    assert warning.hint == f"python manage.py migrate --database {database} creates them"

    out, err = StringIO(), StringIO()
    # With its system checks: W001 warns, and does not stop the command that fixes it.
    call_command("migrate", database=database, skip_checks=False, stdout=out, stderr=err)
    assert "shardkit.W001" in err.getvalue()
    assert f"Created shardkit's tables {', '.join(names)}" in out.getvalue()
    assert missing_tables(new_prefix) == []
    assert check_tables(databases=[database]) == []
    counter = kit().sharded(f"prefix-{uuid.uuid4().hex[:8]}")
    counter.incr(3)
    assert counter.value(fresh=True) == 3


def test_migrate_creates_a_table_the_store_gained_after_the_site_was_migrated(
    database: str, new_prefix: DjangoStore
) -> None:
    call_command("migrate", database=database, verbosity=0)
    new_prefix.maxima_table.drop(new_prefix.engine)  # as if a new version defined it
    assert missing_tables(new_prefix) == [new_prefix.maxima_table.name]
    assert [warning.id for warning in check_tables(databases=[database])] == ["shardkit.W001"]
    call_command("migrate", database=database, verbosity=0)
    assert missing_tables(new_prefix) == []


def test_migrating_the_app_to_zero_leaves_its_tables_dropped(
    database: str, new_prefix: DjangoStore
) -> None:
    names = [table.name for table in shardkit_tables(new_prefix)]
    call_command("migrate", database=database, verbosity=0)
    assert missing_tables(new_prefix) == []
    call_command("migrate", "shardkit", "zero", database=database, verbosity=0)
    assert missing_tables(new_prefix) == names  # post_migrate made none again
    assert check_tables(databases=[database]) == []  # unapplied migrations say it all
    call_command("migrate", "shardkit", database=database, verbosity=0)
    assert missing_tables(new_prefix) == []


def test_the_apps_migrations_describe_its_models() -> None:
    """``makemigrations --check`` finds nothing to write for the app: its model of the
    counters table (for the admin) is in its migrations as it is defined."""
    out = StringIO()
    call_command("makemigrations", "shardkit", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()
