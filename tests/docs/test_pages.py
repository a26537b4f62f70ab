"""Every code block of the README and of the documentation site runs, in order, against
the services it names (``pages.py`` says how each kind of block is run): a changed API
breaks a test here, not a reader. Each page runs in a process of its own, in a
directory of its own, with tables of its own (``$SHARDKIT_PREFIX``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from backends import PREFIX, ROOT
from page_runs import PAGES, drop_tables, names_of, run_page


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    named = names_of(page)
    prefix = f"{PREFIX}doc{PAGES.index(page)}_"
    env = {
        **{key: value for key, value in os.environ.items() if not key.startswith("SHARDKIT_")},
        "SHARDKIT_PREFIX": prefix,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the tests' own Django site
    try:
        run_page(page, tmp_path, named, sys.executable, env)
    finally:
        drop_tables(named, prefix)
