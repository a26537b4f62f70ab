"""The ``shardkit`` command: parses, calls the public API, renders with Rich.

Exit status: 0 done; 1 failed, with one line on stderr (``error: …``); 2 a usage error,
with Click's message naming the argument or option. Names, keys, URLs, job ids and error
messages are printed as they are, never read as markup; control and formatting
characters show as escapes (``\\x1b``, ``\\u200f``). Output that is not a terminal is
never wrapped or cut; on a terminal, lines are broken at spaces only and a name or job id
is never split (a listing too wide for a table shows each row as a block). ``--json``
prints a JSON object, or JSON Lines for lists, with the keys the reference lists.
Commands that only read (``get``, ``list``, ``jobs``, …) create nothing: a missing store
or table is an error naming the URL and the prefix.
"""

from __future__ import annotations

from . import counters, serve  # noqa: F401  (their commands join ``main``)
from .base import Context, main, shown
from .counters import flush, worker
from .jobs import jobs

__all__ = ["Context", "flush", "jobs", "main", "shown", "worker"]
