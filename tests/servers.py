"""Throwaway servers that tests start, break and stop themselves, on free loopback ports.

The machine's shared services are never stopped, restarted or wiped: a test that needs a
server to misbehave starts its own here.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from conftest import CI

DEADLINE = 30.0  # seconds a server may take to answer


def need_program(name: str) -> str:
    """The path of program ``name``; skips the test without it (fails under CI=true)."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
    if path is None:
        reason = f"{name} is not installed (.ci/run installs it with apt)"
        if CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    """Return once ``port`` accepts connections; fail the test, with the server's log, if
    ``process`` exits or ``DEADLINE`` passes first."""
    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the server on port {port} did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.02)


def _as_postgres_user(folder: Path) -> list[str]:
    """Servers that refuse to run as root (PostgreSQL's, PgBouncer) switch to ``postgres``."""
    if os.geteuid() != 0:
        return []
    shutil.chown(folder, "postgres")
    return ["-u", "postgres"]


@contextmanager
def pgbouncer(postgres_url: str, folder: Path, *, pool_mode: str = "transaction") -> Iterator[str]:
    """A PgBouncer in ``pool_mode`` in front of the server of ``postgres_url`` (any database
    on it, trusted); yields the same URL through PgBouncer."""
    program = need_program("pgbouncer")
    url = make_url(postgres_url)
    port = free_port()
    (folder / "users.txt").write_text(f'"{url.username}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        f"[databases]\n* = host={url.host} port={url.port or 5432}\n"
        f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\npool_mode = {pool_mode}\n"
        "max_client_conn = 500\ndefault_pool_size = 20\n"
    )
    log = folder / "pgbouncer.log"
    switch = _as_postgres_user(folder)
    with log.open("wb") as out:
        process = subprocess.Popen(
            [program, *switch, str(folder / "pgbouncer.ini")], stdout=out, stderr=out
        )
    try:
        wait_for_port(port, process, log)
        yield url.set(port=port).render_as_string(hide_password=False)
    finally:
        process.kill()
        process.wait(DEADLINE)
