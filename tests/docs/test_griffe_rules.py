"""The API reference's Griffe extension (``tools/griffe_rules.py``): a core's rules are
shown on its sync and async forms as called, and its walk of a package never follows an
alias (a re-export), which would loop where modules re-export each other."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import griffe

from backends import ROOT


def rules_module() -> ModuleType:
    path = ROOT / "tools" / "griffe_rules.py"
    spec = importlib.util.spec_from_file_location("griffe_rules", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_forms_show_their_rules_as_called() -> None:
    rules = rules_module()
    extensions = griffe.load_extensions(rules.RulesAsCalled)
    package = griffe.load("shardkit", search_paths=[str(ROOT / "src")], extensions=extensions)
    sharded = package["kit.Kit"].members["sharded"]
    awaited = package["aio.AsyncKit"].members["sharded"]
    assert (str(sharded.returns), "async" in sharded.labels) == ("ShardedCounter", False)
    assert (str(awaited.returns), "async" in awaited.labels) == ("AsyncShardedCounter", True)


def test_the_walk_finds_each_class_once_where_it_is_defined(tmp_path: Path) -> None:
    """Modules that re-export each other (and their package): the walk ends, and finds
    each class once, under the module that defines it."""
    package = tmp_path / "ring"
    package.mkdir()
    (package / "__init__.py").write_text("from ring.left import Left\nfrom ring import right\n")
    (package / "left.py").write_text("import ring\nfrom ring import right\n\nclass Left: ...\n")
    (package / "right.py").write_text("import ring\nfrom ring import left\n\nclass Right: ...\n")
    loaded = griffe.load("ring", search_paths=[str(tmp_path)], resolve_aliases=True)
    found = [cls.path for cls in rules_module()._classes(loaded)]
    assert sorted(found) == ["ring.left.Left", "ring.right.Right"]
