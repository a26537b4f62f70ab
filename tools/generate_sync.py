"""Generate the thread forms of the concurrency pieces from their asyncio forms.

Each module in ``SOURCES`` (under ``src/shardkit/aio/``) is the one source of a piece;
its thread form under ``src/shardkit/_sync/`` is made from it by ``unasync`` (``async``
and ``await`` dropped, each name of ``RENAMED`` renamed, ``shardkit.aio.x`` imported as
``shardkit._sync.x``), then formatted by ruff::

    python tools/generate_sync.py          # write the thread forms
    python tools/generate_sync.py --check  # fail if one is not what its source makes (CI)
"""

from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
import tempfile
from pathlib import Path

import unasync

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("combine.py", "adjuster.py", "sent_once.py", "pipes.py")
FROM, TO = "src/shardkit/aio", "src/shardkit/_sync"
RENAMED = {
    "aio": "_sync",  # shardkit.aio.x imported: shardkit._sync.x, its generated sync form
    "AsyncCombiner": "Combiner",
    "AsyncWrite": "Write",
    "AsyncAdjuster": "Adjuster",
    "AsyncLock": "Lock",
    "AsyncEvent": "Event",
    "AsyncBackground": "Background",
    "AsyncSentOnce": "SentOnce",
    "AsyncLending": "Lending",
    "AsyncNodePipes": "NodePipes",
    "AsyncNodeClients": "NodeClients",
    "ashielded": "shielded",
    "arun": "run",
}
HEADER = "# Generated from {source} by tools/generate_sync.py: edit that one.\n"


def generate(into: Path) -> list[Path]:
    """Write the thread forms under ``into`` (a copy of the tree's layout); their paths."""
    rule = unasync.Rule(f"/{FROM}/", f"/{TO}/", additional_replacements=RENAMED)
    made = []
    for name in SOURCES:
        source = into / FROM / name
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text((ROOT / FROM / name).read_text())
        unasync.unasync_files([str(source)], [rule])
        target = into / TO / name
        target.write_text(HEADER.format(source=f"shardkit/aio/{name}") + target.read_text())
        made.append(target)
    files = [str(path) for path in made]
    ruff = [sys.executable, "-m", "ruff"]
    config = ["--quiet", "--config", str(ROOT / "pyproject.toml"), *files]
    subprocess.run([*ruff, "check", "--fix", *config], check=True)
    subprocess.run([*ruff, "format", *config], check=True)
    return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    check = parser.parse_args().check
    stale = 0
    with tempfile.TemporaryDirectory() as scratch:
        for made in generate(Path(scratch)):
            current = ROOT / TO / made.name
            wanted = made.read_text()
            have = current.read_text() if current.exists() else ""
            if have == wanted:
                continue
            if check:
                stale += 1
                diff = difflib.unified_diff(
                    have.splitlines(keepends=True),
                    wanted.splitlines(keepends=True),
                    str(current.relative_to(ROOT)),
                    "generated",
                )
                sys.stdout.writelines(diff)
            else:
                current.parent.mkdir(parents=True, exist_ok=True)
                current.write_text(wanted)
                print(f"wrote {current.relative_to(ROOT)}")
    if stale:
        print(f"{stale} generated module(s) out of date: run python tools/generate_sync.py")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
