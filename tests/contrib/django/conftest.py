"""Fixtures of the example site's tests: each test runs on SQLite and on PostgreSQL.

A test's models and shardkit's tables are on one database, ``database``: a router
sends every model there and the app's ``SHARDKIT['STORE']`` names it. PostgreSQL is
configured by the tests' settings (``site_settings.py``) when its server answers;
without it those tests skip, and fail when CI=true.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from backends import CI
from shardkit.contrib.django import kit
from shardkit.contrib.django.schema import shardkit_tables
from shardkit.contrib.django.store import DjangoStore


class OneDatabase:
    """A database router that sends every model to ``alias``."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_read(self, model: type, **hints: Any) -> str:
        return self.alias

    db_for_write = db_for_read


@pytest.fixture(params=["default", "postgres"])
def database(request: pytest.FixtureRequest, settings: Any) -> Iterator[str]:
    alias: str = request.param
    if alias not in settings.DATABASES:
        reason = f"database {alias!r} is not configured: its server did not answer"
        if CI:
            pytest.fail(f"service required in CI: {reason}")
        pytest.skip(reason)
    settings.DATABASE_ROUTERS = [OneDatabase(alias)]
    settings.SHARDKIT = {**settings.SHARDKIT, "STORE": alias}
    yield alias
    store = kit().store
    assert isinstance(store, DjangoStore)
    with store.engine.begin() as conn:  # shardkit's rows: Django's flush leaves them
        for table in shardkit_tables(store):
            conn.execute(table.delete())
