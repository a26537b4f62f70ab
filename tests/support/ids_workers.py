"""Entry points of the processes the id-allocator fault tests start (importable by a
child), and the record format they share with the tests.

Each thread of a taker writes every id it is handed to its own file, one fixed-size
record per id, with one ``write`` system call before it asks for the next id: once
``next()`` has returned an id and the thread has asked for another, the id is in the file
(the kernel's page cache), whatever happens to the process afterwards. A SIGKILL can only
lose the ids ``next()`` was returning at that moment, which no caller saw, and the rest
of the process's sub-block: holes, which the allocator allows.

Flags are lock-free shared bytes, never ``multiprocessing`` events or queues: a process
SIGKILLed while it held such a primitive's lock would leave it locked for every other one.
"""

from __future__ import annotations

import os
import struct
import threading
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


def taker(
    where: Where,
    name: str,
    block: int,
    sub_block: int,
    paths: list[str],
    start: Any,
    stop: Any,
    conn: Any,
    count: int | None = None,
) -> None:
    """Once ``start.value`` is set, take ids of the allocator ``name`` (``block`` ids
    reserved at a time, ``sub_block`` taken from a block at a time) one by one on one
    thread per file of ``paths``, each appending every id it is handed to its file
    before taking the next, until ``stop.value`` is set or it has taken ``count``. Sends
    ``(ids taken, (first, last) of the sub-block's ids still in hand, None)`` on
    ``conn`` once every thread is done, or ``(ids taken, None, traceback)`` if anything
    failed."""
    taken = [0] * len(paths)
    try:
        store_url, cache_url, prefix = where
        with shardkit.connect(store_url, cache_url, prefix=prefix) as kit:
            ids = kit.ids(name, block=block, sub_block=sub_block)
            files = [
                os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                for path in paths
            ]
            errors: list[str] = []

            def take(index: int) -> None:
                try:
                    while not stop.value and taken[index] != count:
                        record = RECORD.pack(ids.next())
                        if os.write(files[index], record) != len(record):
                            raise OSError(f"short write to {paths[index]}")
                        taken[index] += 1
                except BaseException:
                    errors.append(traceback.format_exc())

            try:
                wait_until(lambda: bool(start.value), "the start")
                threads = [threading.Thread(target=take, args=(i,)) for i in range(len(paths))]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            finally:
                for fd in files:
                    os.close(fd)
            if errors:
                raise RuntimeError(errors[0])
            rest = (ids._next, ids._last)
        conn.send((sum(taken), rest, None))
    except BaseException:
        conn.send((sum(taken), None, traceback.format_exc()))
