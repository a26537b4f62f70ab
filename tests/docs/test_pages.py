"""Every code block of the README and of the documentation site runs, in order, against
the services it names (``pages.py`` says how each kind of block is run): a changed API
breaks a test here, not a reader. Each page runs in a process of its own, in a
directory of its own, with tables of its own (``$SHARDKIT_PREFIX``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from backends import ROOT
from page_runs import PAGES, names_of, run_page


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    run_page(page, tmp_path, names_of(page), Path(sys.prefix))
