"""Running a documentation page (``pages.py``) from a test: in a process of its own,
in a directory of its own, with what the page names mapped to the tests' own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from backends import (
    CACHE_URLS,
    CELERY_BROKERS,
    ROOT,
    STORE_URLS,
    free_port,
    require,
    require_broker,
)
from shardkit.mapper.tables import ledger_tables
from shardkit.store import open_store

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNER = Path(__file__).resolve().parent / "pages.py"
DEADLINE = 600.0  # seconds a page may take, on a busy machine

# The servers the pages name, and the tests' own: the same kind of server, the tests'
# database there.
SERVERS = {
    "postgresql+psycopg://localhost/app": STORE_URLS["postgres"],
    "mysql+pymysql://root@localhost/app": STORE_URLS["mysql"],
    "redis://localhost:6379/0": CACHE_URLS["redis"],
    "memcached://localhost:11211": CACHE_URLS["memcached"],
    "redis://localhost:6379/1": CELERY_BROKERS["redis"],
    "amqp://guest:guest@localhost//": CELERY_BROKERS["rabbitmq"],
}


def names_of(page: Path, **instead: str) -> dict[str, str]:
    """What ``page`` names, mapped to the tests' own (or to ``instead``'s, keyed by
    what the page names); the servers are required. Tables, a Celery queue and ports of
    the run's own besides."""
    text = page.read_text()
    named = {name: instead.get(name, used) for name, used in SERVERS.items() if name in text}
    for used in named.values():
        if used in CELERY_BROKERS.values():
            require_broker(used)
        elif used != "memory://" and not used.startswith("sqlite"):
            require(used)
    own = uuid.uuid4().hex[:12]
    return {
        **named,
        '"counters"': f'"counters_{own}"',
        "-Q counters": f"-Q counters_{own}",
        '"accounts"': f'"accounts_{own}"',
        '"audit"': f'"audit_{own}"',
        "9464": str(free_port()),
        "8050": str(free_port()),
    }


def run_page(
    page: Path, workdir: Path, named: dict[str, str], python: str, env: dict[str, str]
) -> None:
    """Run ``page``'s blocks with ``python`` (which has shardkit and Sybil) in ``workdir``;
    fail the test showing what it printed if a block fails. What the page started and
    left running is killed."""
    log = workdir / ".output"  # a file: a process the page leaves running holds no pipe
    with log.open("w") as out:
        runner = subprocess.Popen(
            [python, str(RUNNER), str(page), str(workdir), json.dumps(named)],
            cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        runner.wait(DEADLINE)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)
        runner.wait()
    if runner.returncode != 0:
        pytest.fail(f"{page.name}:\n{log.read_text()[-8000:]}", pytrace=False)


def drop_tables(named: dict[str, str], prefix: str) -> None:
    """Drop the tables a page's kits made with ``prefix`` on the servers it used."""
    for url in {used for used in named.values() if used.startswith(("postgresql", "mysql"))}:
        store = open_store(url, prefix=prefix)
        store.metadata.drop_all(store.engine)  # type: ignore[attr-defined]
        ledger_tables(prefix).metadata.drop_all(store.engine)  # type: ignore[attr-defined]
        store.close()
