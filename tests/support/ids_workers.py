"""Entry points of the processes the id-allocator fault tests start (importable by a
child), and the record format they share with the tests.

A taker writes every id it is handed to its own file, one fixed-size record per id, with
one ``write`` system call before it asks for the next id: once ``next()`` has returned an
id and the taker has asked for another, the id is in the file (the kernel's page cache),
whatever happens to the process afterwards. A SIGKILL can only lose the id ``next()`` was
returning at that moment, which no caller saw: a hole, which the allocator allows.

Flags are lock-free shared bytes, never ``multiprocessing`` events or queues: a process
SIGKILLed while it held such a primitive's lock would leave it locked for every other one.
"""

from __future__ import annotations

import os
import struct
import traceback
from typing import Any

import shardkit
from buffered_workers import wait_until

Where = tuple[str, str, str]  # (store URL, cache URL, table prefix)
RECORD = struct.Struct("<q")  # one id, 8 bytes: records never straddle a page


def read_ids(path: str) -> list[int]:
    """The ids recorded in ``path``, in the order they were handed out."""
    with open(path, "rb") as file:
        data = file.read()
    assert len(data) % RECORD.size == 0, f"{path}: a torn record ({len(data)} bytes)"
    return [value for (value,) in RECORD.iter_unpack(data)]


def recorded(path: str) -> int:
    """How many ids ``path`` holds so far (0 before the taker created it)."""
    try:
        return os.stat(path).st_size // RECORD.size
    except FileNotFoundError:
        return 0


def last_id(path: str) -> int:
    """The id ``path`` recorded last (0 before it recorded any)."""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            if size < RECORD.size:
                return 0
            file.seek(size - size % RECORD.size - RECORD.size)
            (value,) = RECORD.unpack(file.read(RECORD.size))
            return int(value)
    except FileNotFoundError:
        return 0


def taker(where: Where, name: str, block: int, path: str, start: Any, stop: Any, conn: Any) -> None:
    """Once ``start.value`` is set, take ids of the allocator ``name`` (``block`` ids
    reserved at a time) one by one until ``stop.value`` is set, appending each to the
    file ``path`` before taking the next. Sends ``(ids taken, None)`` on ``conn`` when
    stopped, or ``(ids taken, traceback)`` if anything failed."""
    taken = 0
    try:
        store_url, cache_url, prefix = where
        with shardkit.connect(store_url, cache_url, prefix=prefix) as kit:
            ids = kit.ids(name, block=block)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            try:
                wait_until(lambda: bool(start.value), "the start")
                while not stop.value:
                    record = RECORD.pack(ids.next())
                    if os.write(fd, record) != len(record):
                        raise OSError(f"short write to {path}")
                    taken += 1
            finally:
                os.close(fd)
        conn.send((taken, None))
    except BaseException:
        conn.send((taken, traceback.format_exc()))
