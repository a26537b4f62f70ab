"""The thread forms under ``shardkit/_sync/`` are what ``tools/generate_sync.py`` makes
from their asyncio sources under ``shardkit/aio/``, every one of them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from backends import ROOT

AIO, SYNC = ROOT / "src" / "shardkit" / "aio", ROOT / "src" / "shardkit" / "_sync"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_sync", ROOT / "tools/generate_sync.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_thread_form_is_what_its_marked_source_makes(tmp_path: Path) -> None:
    tool = generator()
    marked = {
        path.name for path in AIO.glob("*.py") if tool.MARKER in path.read_text().splitlines()
    }
    forms = {path.name for path in SYNC.glob("*.py")} - {"__init__.py"}
    assert "adjuster.py" in marked  # the sources were found
    assert forms == marked  # a source for every thread form, a thread form for every source
    made = {path.name: path.read_text() for path in tool.generate(tmp_path)}
    assert made.keys() == marked  # the generator makes every marked source's
    for name in sorted(forms):
        assert (SYNC / name).read_text() == made[name], f"_sync/{name}: run tools/generate_sync.py"
