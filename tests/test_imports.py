"""Every module of the package imports alone, as the first module of a program, and no
module imports itself through others."""

from __future__ import annotations

import graphlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from backends import ROOT, SUPPORT


def package_modules() -> list[str]:
    """Every module of shardkit, found in its file tree (none imported here)."""
    spec = importlib.util.find_spec("shardkit")
    assert spec is not None
    assert spec.submodule_search_locations
    top = Path(next(iter(spec.submodule_search_locations)))
    names = []
    for path in sorted(top.rglob("*.py")):
        parts = ("shardkit", *path.relative_to(top).with_suffix("").parts)
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_each_module_imports_alone_first() -> None:
    names = package_modules()
    assert len(names) > 90  # the tree was found
    assert "shardkit._sync.adjuster" in names
    path = [str(SUPPORT), str(ROOT / "examples" / "django_site"), os.environ.get("PYTHONPATH")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, path)),
        "DJANGO_SETTINGS_MODULE": "site_settings",
    }
    run = subprocess.run(
        [sys.executable, str(SUPPORT / "import_alone.py"), *names],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    results = json.loads(run.stdout)
    assert sorted(results) == sorted(names)
    failed = {name: result["error"] for name, result in results.items() if result["error"]}
    assert not failed, "\n".join(f"{name}:\n{error}" for name, error in failed.items())
    # The models, and what reads them, are imported after Django's setup; no other module.
    assert {name for name, result in results.items() if result["django_setup"]} <= {
        name for name in names if name.startswith("shardkit.contrib.django.")
    }


def packages(module: str) -> set[str]:
    """The packages that importing ``module`` imports first."""
    parts = module.split(".")
    return {".".join(parts[:end]) for end in range(1, len(parts))}


def test_no_import_circle() -> None:
    """No module imports itself through others, type-only imports included (the import
    contracts' ``acyclic_siblings`` finds circles between a package's children, not
    those through the package's own ``__init__``). Importing a module imports its
    packages first: an import of ``a.b.c`` counts as one of ``a.b`` and ``a`` too, but
    not of the importer's own packages, which are being imported already."""
    graph = grimp.build_graph("shardkit", include_external_packages=False, cache_dir=None)
    imports = {
        module: set().union(
            *(
                {imported} | (packages(imported) - packages(module) - {module})
                for imported in graph.find_modules_directly_imported_by(module)
            )
        )
        for module in graph.modules
    }
    assert len(imports) > 90  # the package was found
    assert "shardkit.store" in imports["shardkit.mapper.tables"]  # through shardkit.store.sql
    try:
        tuple(graphlib.TopologicalSorter(imports).static_order())
    except graphlib.CycleError as error:
        pytest.fail("an import circle: " + " -> ".join(reversed(error.args[1])))
