"""What a database ran, read from the driver's own trace."""

from __future__ import annotations

import contextlib
import re
import tempfile
from collections.abc import Iterator
from typing import Any

from django.db import connections

# A reply of the server in libpq's trace: "B <length> CommandComplete "SELECT 3"".
_COMMAND_COMPLETE = re.compile(r'^B\t\d+\tCommandComplete\t "(\w+)', re.MULTILINE)
# What ends a round trip the client starts, in libpq's trace: a simple query (its text)
# or the Sync closing an extended query's messages.
_SENT = re.compile(r'^F\t\d+\t(?:Query\t "(.*)"|(Sync))$', re.MULTILINE)


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
    with _wire(raw) as wire:
        yield ran
    ran += _COMMAND_COMPLETE.findall(wire[0])


@contextlib.contextmanager
def queries_sent(alias: str) -> Iterator[list[str]]:
    """The round trips this thread's Django connection ``alias`` (PostgreSQL) started
    with the server inside the block, as libpq's trace of the wire shows them: a simple
    query's text, or ``"extended"`` for an extended query (Parse, Bind, Execute, Sync)."""
    connection = connections[alias]
    connection.ensure_connection()
    sent: list[str] = []
    with _wire(connection.connection) as wire:
        yield sent
    sent += [text or "extended" for text, _ in _SENT.findall(wire[0])]


@contextlib.contextmanager
def _wire(raw: Any) -> Iterator[list[str]]:
    """libpq's trace of psycopg's connection ``raw`` inside the block: the list yielded
    holds its text once the block ends."""
    from psycopg import pq

    text: list[str] = []
    with tempfile.TemporaryFile() as trace:
        raw.pgconn.trace(trace.fileno())
        raw.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield text
        finally:
            raw.pgconn.untrace()  # flushes the trace
            trace.seek(0)
            text.append(trace.read().decode())
