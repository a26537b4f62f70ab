"""The dashboard as a person uses it: ``shardkit dashboard`` served by its own process
on PostgreSQL and Redis, opened in a real headless Chromium (Debian's, driven by
Playwright) while this process counts and runs a mapping job whose pages it releases a
few at a time. The page must show the job's progress advance and its range tree grow,
a counter's value change after increments and its shards' growth, hostile names as
plain text, and no console error. A screenshot of each page is kept in
``test-artifacts/`` (``$SHARDKIT_ARTIFACTS``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import shardkit
from backends import (
    CACHE_URLS,
    PREFIX,
    ROOT,
    free_port,
    numbered_table,
    require,
    store_url_for,
    wait_for,
)
from servers import unavailable
from shardkit.executor import LocalExecutor
from shardkit.store.sql import SqlStore

ARTIFACTS = Path(os.environ.get("SHARDKIT_ARTIFACTS", ROOT / "test-artifacts"))
CHROMIUM = os.environ.get("SHARDKIT_TEST_CHROMIUM", "/usr/bin/chromium")
ROWS = 2000
PAGE = 20

pytestmark = pytest.mark.slow


@pytest.fixture
def kit(sqlite_url: str) -> Iterator[shardkit.Kit]:
    store, cache = store_url_for("postgres", sqlite_url), CACHE_URLS["redis"]
    require(cache)
    # More workers than the job's fanout (4): its tree aims at a leaf per worker, so
    # the root's children split again, and the drawn tree grows as they do.
    executor = LocalExecutor(workers=16)
    with shardkit.connect(store, cache, prefix=PREFIX, executor=executor) as the_kit:
        yield the_kit


@pytest.fixture
def table(kit: shardkit.Kit) -> Iterator[sa.Table]:
    assert isinstance(kit.store, SqlStore)
    with numbered_table(kit.store.engine, "browsed", ROWS) as made:
        yield made


@pytest.fixture
def served(kit: shardkit.Kit, tmp_path: Path) -> Iterator[str]:
    """``shardkit dashboard`` on the kit's store and cache, in a process of its own."""
    port = free_port()
    command = [sys.executable, "-m", "shardkit", "--store", kit.store.url, "--cache"]
    command += [kit.cache.url, "--prefix", PREFIX, "dashboard", "--port", str(port)]
    command += ["--refresh", "0.2"]
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    log = tmp_path / "dashboard.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"

    def answers() -> bool:
        if process.poll() is not None:
            pytest.fail(f"the dashboard exited with {process.returncode}: {log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except OSError:
            return False

    try:
        wait_for(answers, "the dashboard to answer", 30)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def number(text: str | None) -> int:
    return int((text or "").replace(",", ""))


def test_the_dashboard_shows_a_job_and_counters_move_live(
    kit: shardkit.Kit, table: sa.Table, served: str
) -> None:
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        unavailable(f"no Chromium at {CHROMIUM} (Debian's package chromium)")
    from playwright.sync_api import expect, sync_playwright

    prefix = f"test:browsed:{uuid.uuid4().hex[:8]}:"
    views = kit.sharded(prefix + "views")
    views.incr(3)
    hostile = prefix + "<img src=x onerror=window.pwned=1>"
    kit.sharded(hostile).incr()
    permits = threading.Semaphore(0)  # one per page the job may visit

    def visit(batch: shardkit.Batch) -> None:
        if not permits.acquire(timeout=60):
            raise TimeoutError("no permit to visit a page")

    job = kit.map(table, visit, key="id", page_size=PAGE, fanout=4)
    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(served)
            page.fill("#prefix", prefix)

            # A counter's value changes on screen after increments.
            value = page.locator(f'#counters tr[data-name="{prefix}views"] td.value')
            expect(value).to_have_text("3")
            views.incr(4)
            expect(value).to_have_text("7")
            # A growth of its shards (sized by its load, as a hot counter grows) shows.
            shards = page.locator(f'#counters tr[data-name="{prefix}views"] td.shards')
            expect(shards).to_have_text("1")
            views.grow(4)
            expect(shards).to_have_text("1 → 4")
            expect(shards.locator(".grew")).to_have_attribute("title", re.compile("^grew"))
            # A hostile name is shown as text, never run.
            name = page.locator(f'#counters tr[data-name="{hostile}"] td.name')
            expect(name).to_have_text(hostile)
            assert page.evaluate("window.pwned") is None

            # The job's progress advances as its pages are released.
            rows = page.locator(f'#jobs tr[data-job="{job.id}"] td.rows')
            expect(rows).to_have_text("0")
            # (Two pages: the root's, which splits it, and one child's, which splits
            # that child; the other children wait, unsplit, for their first page.)
            permits.release(1)
            wait_for(lambda: number(rows.text_content()) > 0, "rows to show on screen", 30)
            shown = number(rows.text_content())
            permits.release(1)
            wait_for(lambda: number(rows.text_content()) > shown, "rows to advance", 30)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=ARTIFACTS / "dashboard.png", full_page=True)

            # Its page draws the range tree, which grows as ranges split.
            page.click(f'#jobs tr[data-job="{job.id}"] a')
            expect(page.locator("#job-id")).to_have_text(job.id)
            expect(page.locator("#job-state")).to_have_text("running")
            tree = page.locator("#tree rect")
            wait_for(lambda: tree.count() > 1, "the tree to show the root's split", 30)
            drawn = tree.count()
            permits.release(ROWS)  # enough for every page left
            job.wait(60)
            expect(page.locator("#job-state")).to_have_text("complete")
            expect(page.locator("#job-rows")).to_have_text(f"{ROWS:,}")
            ranges = len(job.ranges())
            wait_for(lambda: tree.count() == ranges, f"all {ranges} ranges drawn", 30)
            assert ranges > drawn
            assert page.locator("#tree rect.done").count() == ranges
            page.screenshot(path=ARTIFACTS / "dashboard-job.png", full_page=True)
        finally:
            browser.close()
    assert errors == []
