"""Fixtures of the example site's tests: each test runs on SQLite and on PostgreSQL.

A test's models and shardkit's tables are on one database, ``database``: a router
sends every model there and the app's ``SHARDKIT['STORE']`` names it. PostgreSQL is
configured by the site's settings when its server answers; without it those tests
skip, and fail when CI=true.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from django.db import connections

from shardkit.contrib.django import kit
from shardkit.contrib.django.store import DjangoStore
from shardkit.executor import Marks, Task

# A reply of the server in libpq's trace: "B <length> CommandComplete "SELECT 3"".
_COMMAND_COMPLETE = re.compile(r'^B\t\d+\tCommandComplete\t "(\w+)', re.MULTILINE)
CI = os.environ.get("CI", "").lower() == "true"


@contextlib.contextmanager
def statements_run(alias: str) -> Iterator[list[str]]:
    """The statements (their first word: SELECT, BEGIN, …) that the database ran for
    this thread's Django connection ``alias`` inside the block, as the driver sees them:
    SQLite's trace of the statements it ran, or the command tags of PostgreSQL's replies
    in libpq's trace of the wire (so BEGIN and ROLLBACK sent by psycopg itself count)."""
    connection = connections[alias]
    connection.ensure_connection()
    raw: Any = connection.connection
    ran: list[str] = []
    if connection.vendor == "sqlite":
        raw.set_trace_callback(lambda sql: ran.append(sql.split()[0].upper()))
        try:
            yield ran
        finally:
            raw.set_trace_callback(None)
        return
    from psycopg import pq

    with tempfile.TemporaryFile() as trace:
        raw.pgconn.trace(trace.fileno())
        raw.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield ran
        finally:
            raw.pgconn.untrace()  # flushes the trace
            trace.seek(0)
            ran += _COMMAND_COMPLETE.findall(trace.read().decode())


class OneDatabase:
    """A database router that sends every model to ``alias``."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_read(self, model: type, **hints: Any) -> str:
        return self.alias

    db_for_write = db_for_read


class HeldExecutor:
    """An executor that keeps what is submitted to it and runs nothing."""

    url = "held://"

    def __init__(self) -> None:
        self.submitted: list[tuple[str, Mapping[str, Any]]] = []

    def bind(self, tasks: Mapping[str, Task], marks: Marks) -> None:
        pass

    def submit(self, task: str, args: Mapping[str, Any], **options: Any) -> bool:
        self.submitted.append((task, args))
        return True

    def close(self) -> None:
        pass


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
        for table in store.metadata.sorted_tables:
            conn.execute(table.delete())
