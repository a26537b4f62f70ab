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
    PREFIX,
    ROOT,
    STORE_URLS,
    drop_tables,
    free_port,
    require,
    require_broker,
)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNER = Path(__file__).resolve().parent / "pages.py"
DEADLINE = 600.0  # seconds a page may take, on a busy machine
SQL_SERVERS = ("postgresql", "mysql")  # where a page's tables outlive it

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


def environ(venv: Path, **variables: str) -> dict[str, str]:
    """The environment of a process of ``venv``: nothing of this session's Python path,
    Django settings or shardkit configuration, and no user site-packages."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV")
    inherited = {
        key: value
        for key, value in os.environ.items()
        if key not in dropped and not key.startswith("SHARDKIT_")
    }
    path = f"{venv / 'bin'}{os.pathsep}{inherited.get('PATH', '')}"
    return {
        **inherited,
        "PATH": path,
        "VIRTUAL_ENV": str(venv),
        "PYTHONNOUSERSITE": "1",
        **variables,
    }


def run_page(page: Path, workdir: Path, named: dict[str, str], venv: Path) -> None:
    """Run ``page``'s blocks with ``venv``'s Python (which has shardkit and Sybil) in
    ``workdir``, its kits' tables under a prefix of their own (dropped afterwards); fail
    the test showing what it printed if a block fails. What the page started and left
    running is killed."""
    prefix = f"{PREFIX}{uuid.uuid4().hex[:6]}_"
    env = environ(venv, SHARDKIT_PREFIX=prefix)
    log = workdir / ".output"  # a file: a process the page leaves running holds no pipe
    try:
        with log.open("w") as out:
            runner = subprocess.Popen(
                [str(venv / "bin" / "python"), str(RUNNER), str(page), str(workdir),
                 json.dumps(named)],
                cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        try:
            runner.wait(DEADLINE)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
    finally:
        drop_tables({used for used in named.values() if used.startswith(SQL_SERVERS)}, prefix)
    if runner.returncode != 0:
        pytest.fail(f"{page.name}:\n{log.read_text()[-8000:]}", pytrace=False)
