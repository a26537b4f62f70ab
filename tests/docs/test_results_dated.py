"""Benchmark results carry their date as data: every table of figures in
``benchmarks/results/`` and on the benchmarks page names, in itself or in the text right
before or after it, the day it was measured or the revision it was measured (or filed) at."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backends import ROOT

PAGES = [*sorted((ROOT / "benchmarks" / "results").glob("*.md")), ROOT / "docs" / "benchmarks.md"]
FIGURE = re.compile(r"[\d,.]+\s*(\u00d7|x|/s|%|s|ms|\u00b5s)?")  # a measure: a ratio, a rate, …
DATED = re.compile(r"\b(20\d\d-\d\d-\d\d|[0-9a-f]{7,40})\b")  # a day or a revision


def blocks(text: str) -> list[tuple[str, list[str]]]:
    """The page as runs of lines: ``table``, ``heading`` (one line each) or ``text``."""
    runs: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        kind = "table" if line.startswith("|") else "heading" if line.startswith("#") else "text"
        if runs and runs[-1][0] == kind != "heading":
            runs[-1][1].append(line)
        else:
            runs.append((kind, [line]))
    return runs


def undated(text: str) -> tuple[int, list[str]]:
    """How many tables of figures ``text`` has, and the header of each that names no
    day or revision in itself or the text next to it."""
    runs = blocks(text)
    figures, missing = 0, []
    for index, (kind, lines) in enumerate(runs):
        cells = [cell.strip().strip("*") for line in lines[2:] for cell in line.split("|")]
        if kind != "table" or not any(FIGURE.fullmatch(cell) for cell in cells if cell):
            continue
        figures += 1
        near = list(lines)
        for other in (index - 1, index + 1):
            if 0 <= other < len(runs) and runs[other][0] == "text":
                near += runs[other][1]
        if not any(DATED.search(line) for line in near):
            missing.append(lines[0])
    return figures, missing


def test_a_table_without_its_date_is_found() -> None:
    page = "## Run\n\nWith 16 writers:\n\n| mode | ops/s |\n| --- | --: |\n| sharded | 9,076 |\n"
    assert undated(page) == (1, ["| mode | ops/s |"])
    assert undated(page.replace("16 writers", "16 writers, at 0923364")) == (1, [])
    assert undated(page + "\nMeasured 2026-11-28.\n") == (1, [])
    assert undated("| script | what |\n| --- | --- |\n| `soak.py` | uptime |\n") == (0, [])


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_table_of_figures_names_its_date_or_revision(page: Path) -> None:
    figures, missing = undated(page.read_text(encoding="utf-8"))
    assert figures > 0  # a page of results, read as one
    assert missing == [], f"{len(missing)} of {figures} tables undated, the first: {missing[0]}"
