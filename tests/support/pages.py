"""A documentation page's code blocks, run as its reader would run them, in order.

The conventions the pages follow (``docs/`` and ``README.md``):

* a ``python`` block runs; the blocks of a page share one namespace, and a ``>>>``
  session's output is compared with what the page shows (``...`` matching anything);
* a ``python title="path/to/file.py"`` block is a file the reader writes: it is written
  (appended to, when a page writes it in parts) under the page's directory, where later
  blocks import it;
* a ``sh`` block runs in bash (``set -e``) in the page's directory, and must succeed;
* ``<!-- skip: next "why" -->`` leaves out the next block, saying why;
  ``<!-- invisible-code-block: python … -->`` is set-up the reader does not need to see;
* ``text`` and ``console`` blocks show output or a synopsis: nothing to run; a block of
  no language, or of another, is refused.

The URLs a page names (``postgresql+psycopg://localhost/app``, ``redis://localhost:6379/0``,
…) are replaced with the test services' before it runs: the same kinds of server, the
tests' own databases.

Run as ``python pages.py PAGE DIR NAMED`` (``NAMED``: a JSON object of what the page
names and what to use instead), by ``tests/docs/test_pages.py`` and, in a clean
environment holding one extra of shardkit and Sybil alone, by ``tests/packaging``.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import subprocess
import sys
import unittest
from collections.abc import Iterable, Mapping
from pathlib import Path

from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

_INFO = re.compile(r'(?P<language>[\w-]+)(?:[ \t]+title="(?P<title>[^"]+)")?[ \t]*$\n', re.M)
_SHOWN = {"text", "console", "json", "yaml", "ini", "toml", "html"}  # nothing to run


def _write(example: Example) -> None:
    """A titled block: the reader's file, written (or added to) in the page's folder."""
    path = Path(example.document.namespace["__workdir__"]) / example.region.lexemes["title"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as file:
        file.write(str(example.parsed))


def _shell(example: Example) -> None:
    """A ``sh`` block: bash runs it; what it prints goes to a file, which a server it
    leaves running in the background (``&``) may go on writing to."""
    workdir = Path(example.document.namespace["__workdir__"])
    with (workdir / ".sh-output").open("w+") as out:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", str(example.parsed)],
            cwd=workdir, stdout=out, stderr=subprocess.STDOUT, timeout=300, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            out.seek(0)
            raise AssertionError(
                f"{example.parsed.strip()!r} exited with {done.returncode}:\n{out.read()[-4000:]}"
            )


def _blocks(document: Document) -> Iterable[Region]:
    """Titled blocks and shell blocks (plain ``python`` blocks are Sybil's)."""
    for region in RawFencedCodeBlockLexer()(document):  # no language
        raise ValueError(f"{document.path}: a block of no language at {region.start}")
    for region in RawFencedCodeBlockLexer(_INFO)(document):
        language, title = region.lexemes["language"], region.lexemes["title"]
        region.parsed = region.lexemes["source"]
        if title:
            region.evaluator = _write
        elif language == "sh":
            region.evaluator = _shell
        elif language == "python" or language in _SHOWN:
            continue
        else:
            raise ValueError(f"{document.path}: a {language!r} block, which no page runs")
        yield region


SYBIL = Sybil(
    parsers=[
        PythonCodeBlockParser(doctest_optionflags=doctest.ELLIPSIS),  # ``>>>`` compared
        _blocks,
        SkipParser(),
    ]
)


def run(page: Path, workdir: Path, named: Mapping[str, str]) -> None:
    """Run every block of ``page`` in order, in ``workdir`` (the current directory, and
    first on ``sys.path``), what it names replaced as ``named`` says; raise at the first
    failure."""
    text = page.read_text()
    for name, used in named.items():
        text = text.replace(name, used)
    copy = workdir / f".{page.name}"  # the page as run: its lines where the page has them
    copy.write_text(text)
    document = SYBIL.parse(copy)
    document.namespace["__workdir__"] = str(workdir)
    for example in document:
        try:
            example.evaluate()
        except unittest.SkipTest:  # a block the page says to leave out
            continue


if __name__ == "__main__":
    page, workdir, named = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    os.chdir(workdir)
    sys.path.insert(0, str(workdir))
    run(page, workdir, named)
