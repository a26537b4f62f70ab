"""Every code block of the README and of the documentation site runs, in order, against
the services it names (``pages.py`` says how each kind of block is run): a changed API
breaks a test here, not a reader. Each page runs in a process of its own, in a
directory of its own, with tables of its own (``$SHARDKIT_PREFIX``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from backends import CACHE_URLS, CELERY_BROKERS, PREFIX, ROOT, STORE_URLS, require, require_broker
from shardkit.mapper.tables import ledger_tables
from shardkit.store import open_store

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNER = Path(__file__).resolve().parents[1] / "support" / "pages.py"
DEADLINE = 600.0  # seconds a page may take, on a busy machine

# What the pages name, and the tests' own of it: the same kind of server, the tests'
# database there; tables and a Celery queue of the page's own (names_of).
NAMED = {
    "postgresql+psycopg://localhost/app": STORE_URLS["postgres"],
    "mysql+pymysql://root@localhost/app": STORE_URLS["mysql"],
    "redis://localhost:6379/0": CACHE_URLS["redis"],
    "memcached://localhost:11211": CACHE_URLS["memcached"],
    "redis://localhost:6379/1": CELERY_BROKERS["redis"],
    "amqp://guest:guest@localhost//": CELERY_BROKERS["rabbitmq"],
}


def run_page(page: Path, workdir: Path, named: dict[str, str], python: str, env: dict[str, str]) -> None:
    """Run ``page``'s blocks with ``python`` (which has shardkit and Sybil) in ``workdir``;
    fail the test showing what it printed if a block fails."""
    log = workdir / ".output"  # a file: a process the page leaves running holds no pipe
    with log.open("w") as out:
        runner = subprocess.Popen(
            [python, str(RUNNER), str(page), str(workdir), json.dumps(named)],
            cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        runner.wait(DEADLINE)
    finally:  # what the page started and left running (a worker, when a block failed)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)
        runner.wait()
    if runner.returncode != 0:
        pytest.fail(f"{page.name}:\n{log.read_text()[-8000:]}", pytrace=False)


def names_of(page: Path) -> dict[str, str]:
    """What ``page`` names, mapped to the tests' own (the servers required)."""
    text = page.read_text()
    named = {url: used for url, used in NAMED.items() if url in text}
    for used in named.values():
        (require_broker if used in CELERY_BROKERS.values() else require)(used)
    own = uuid.uuid4().hex[:12]
    return {
        **named,
        '"counters"': f'"counters_{own}"',
        "-Q counters": f"-Q counters_{own}",
        '"accounts"': f'"accounts_{own}"',
        '"audit"': f'"audit_{own}"',
    }


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    named = names_of(page)
    prefix = f"{PREFIX}doc{PAGES.index(page)}_"
    env = {
        **{key: value for key, value in os.environ.items() if not key.startswith("SHARDKIT_")},
        "SHARDKIT_PREFIX": prefix,
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the tests' own Django site
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    try:
        run_page(page, tmp_path, named, sys.executable, env)
    finally:
        for url in {used for used in named.values() if used.startswith(("postgresql", "mysql"))}:
            store = open_store(url, prefix=prefix)
            store.metadata.drop_all(store.engine)  # type: ignore[attr-defined]
            ledger_tables(prefix).metadata.drop_all(store.engine)  # type: ignore[attr-defined]
            store.close()
