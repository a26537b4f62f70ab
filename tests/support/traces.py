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
