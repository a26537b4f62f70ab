"""What the hosts of a multi-host test run.

``add_ten`` is a transactional mapping function (``host_work:add_ten``, run by Celery
workers on the hosts): it adds 10 to the ``balance`` of each row of the page in the
table ``$SHARDKIT_HOSTS_TABLE``, and records the page (the address of the host that
ran it, as PostgreSQL sees it, its first key and its size) in ``<table>_pages``, in the
job's transaction. With ``$SHARDKIT_HOSTS_HOLD`` set to a path, a process holds one
page, its first once ``HOLD_AFTER`` pages are committed, its transaction open: it writes
the page's first key to that path, then waits until ``<path>.release`` exists.

This module run as a program writes counters from one host:

    python host_work.py KIND STORE CACHE PREFIX NAME DIRECTORY THREADS

Each of its ``THREADS`` threads writes the counter ``NAME`` until the file
``DIRECTORY/stop`` exists, and appends one fixed-size record per acknowledged write to
its own file ``DIRECTORY/<pid>-<thread>.acks`` with one ``write`` call (a SIGKILL loses
at most the acknowledgement being recorded): a value, and when the call that was
acknowledged began and returned (``time.monotonic()``, one clock for every process of
the machine, whatever its network namespace):

* ``sharded``: ``incr(1, key="<pid>-<thread>-<n>")``, the thread's ``n``-th key,
  retried with the same key after a failure until it is acknowledged (the record: ``n``,
  or ``-n`` where the retry found the key applied already); a thread that is stopped
  finishes its write first; one more thread reads the counter's cached value
  (``value()``) over and over;
* ``buffered``: ``incr(1)`` (the record: 1; a failed one is not recorded, though it
  may have counted);
* ``buffered-keyed``: as ``sharded`` (keys, retried until acknowledged), on a buffered
  counter, without the reader;
* ``ids``: ``next()`` (the record: the id).

Failures are counted in ``DIRECTORY/<pid>-<thread>.failures`` (one byte each). With
``$SHARDKIT_HOSTS_METRICS`` (``address:port``) set, the process serves the metrics it
recorded there (``/metrics``). It prints ``ready`` once its kit is connected and writes have begun.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import sqlalchemy as sa

import shardkit

RECORD = struct.Struct("<qdd")  # a Call
PAUSE = 0.05  # seconds a thread waits after a failure


class Call(NamedTuple):
    """An acknowledged write, as a writer thread recorded it."""

    value: int
    began: float
    """When the call that was acknowledged began (``time.monotonic()``)."""
    ended: float
    """When it returned."""


def calls(directory: Path, pid: int | None = None) -> dict[str, list[Call]]:
    """The records of each thread in ``directory`` (of process ``pid``'s), in the order
    it made them, by its name (``<pid>-<thread>``)."""
    threads: dict[str, list[Call]] = {}
    for path in sorted(directory.glob(f"{pid or '*'}-*.acks")):
        data = path.read_bytes()
        whole = data[: len(data) // RECORD.size * RECORD.size]
        threads[path.stem] = [Call(*record) for record in RECORD.iter_unpack(whole)]
    return threads


def acknowledged(directory: Path, pid: int | None = None) -> list[int]:
    """The values of every thread's records in ``directory`` (of process ``pid``'s)."""
    return [call.value for made in calls(directory, pid).values() for call in made]


def acknowledged_count(directory: Path, pid: int | None = None) -> int:
    """How many records the threads in ``directory`` (process ``pid``'s) made: the
    length of ``acknowledged``, from the files' sizes (polled while writers write)."""
    paths = directory.glob(f"{pid or '*'}-*.acks")
    return sum(path.stat().st_size // RECORD.size for path in paths)


def failures(directory: Path, pid: int | None = None) -> int:
    """How many writes failed in ``directory``'s threads (process ``pid``'s)."""
    return sum(path.stat().st_size for path in directory.glob(f"{pid or '*'}-*.failures"))


def _thread(write: Callable[[int], int], directory: Path, number: int, keyed: bool) -> None:
    stem = directory / f"{os.getpid()}-{number}"
    acks = os.open(f"{stem}.acks", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    failed = os.open(f"{stem}.failures", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    stop = directory / "stop"
    sequence = 0
    while not stop.exists():
        sequence += 1
        while True:
            began = time.monotonic()
            try:
                value = write(sequence)
                break
            except shardkit.ShardkitError:
                os.write(failed, b"x")
                if not keyed:
                    value = None
                    break
                time.sleep(PAUSE)
        if value is not None:
            os.write(acks, RECORD.pack(value, began, time.monotonic()))


_held = threading.Event()  # this process held a page already
HOLD = 600.0  # seconds a held page waits for its release at most
HOLD_AFTER = 20  # pages committed before one is held: the job has split by then


def _committed(conn: Any, pages: Any) -> int:
    return int(conn.execute(sa.select(sa.func.count()).select_from(pages)).scalar_one())


def add_ten(batch: Any) -> None:
    name = os.environ["SHARDKIT_HOSTS_TABLE"]
    table = sa.table(name, sa.column("k"), sa.column("balance"))
    pages = sa.table(f"{name}_pages", sa.column("host"), sa.column("first"), sa.column("size"))
    keys = [row["k"] for row in batch.rows]
    batch.conn.execute(
        sa.update(table).where(table.c.k.in_(keys)).values(balance=table.c.balance + 10)
    )
    host = sa.func.host(sa.func.inet_client_addr())  # the address the store sees
    batch.conn.execute(sa.insert(pages).values(host=host, first=keys[0], size=len(keys)))
    hold = os.environ.get("SHARDKIT_HOSTS_HOLD")
    if hold and not _held.is_set() and _committed(batch.conn, pages) >= HOLD_AFTER:
        _held.set()
        Path(f"{hold}.tmp").write_text(str(keys[0]))
        os.rename(f"{hold}.tmp", hold)
        deadline = time.monotonic() + HOLD
        while not os.path.exists(f"{hold}.release") and time.monotonic() < deadline:
            time.sleep(0.05)


# The kinds whose writes carry keys, retried until acknowledged.
KEYED = ("sharded", "buffered-keyed")


def _writer(kit: shardkit.Kit, kind: str, name: str, thread: int) -> Callable[[int], int]:
    """Thread ``thread``'s write of the counter ``name``: its sequence number in, the
    value to record out."""
    if kind.startswith("ids"):  # ids-sequence: one id a round trip, one sequence
        ids = kit.ids(name, block=50, sub_block=1 if kind == "ids-sequence" else 10)
        return lambda _: ids.next()
    counter: Any = kit.sharded(name, shards=8) if kind == "sharded" else kit.buffered(name)

    def write(sequence: int) -> int:
        if kind in KEYED:  # False when a retry finds it applied: counted once all the same
            applied = counter.incr(1, key=f"{os.getpid()}-{thread}-{sequence}")
            return sequence if applied else -sequence
        counter.incr(1)
        return 1

    return write


def _reader(kit: shardkit.Kit, name: str, directory: Path) -> None:
    """Read the counter's cached value until ``directory/stop`` exists; a failed read
    is its metrics' alone (a cache cut off: ``reading a cached value``)."""
    counter = kit.sharded(name, shards=8)
    while not (directory / "stop").exists():
        with contextlib.suppress(shardkit.ShardkitError):
            counter.value()
        time.sleep(PAUSE)


def main(
    kind: str, store: str, cache: str, prefix: str, name: str, where: str, threads: str
) -> None:
    directory = Path(where)
    kit = shardkit.connect(store, cache, prefix=prefix)
    if "SHARDKIT_HOSTS_METRICS" in os.environ:  # address:port: what this process recorded
        from prometheus_client import start_http_server

        from shardkit.monitor.exporter import registry

        address, port = os.environ["SHARDKIT_HOSTS_METRICS"].rsplit(":", 1)
        start_http_server(int(port), address, registry(None))
    running = [
        threading.Thread(
            target=_thread, args=(_writer(kit, kind, name, n), directory, n, kind in KEYED)
        )
        for n in range(int(threads))
    ]
    if kind == "sharded":
        running.append(threading.Thread(target=_reader, args=(kit, name, directory)))
    for thread in running:
        thread.start()
    print("ready", flush=True)
    for thread in running:
        thread.join()
    kit.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
