"""The shape of the repository, kept so: modules of one purpose (none of the package over
600 lines), an architecture page a reader gets through (500 lines at most), benchmarks on
a harness of their own (none imports ``shardkit.demo``), and the import contract that
keeps the package off the benchmarks naming every one of them."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from backends import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest's own dependency before 3.11
    import tomli as tomllib

MODULE_LINES = 600
ARCHITECTURE_LINES = 500
BENCHMARKS = ROOT / "benchmarks"


def lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_of_the_package_is_over_600_lines() -> None:
    modules = sorted((ROOT / "src" / "shardkit").rglob("*.py"))
    assert len(modules) > 50  # the package, not an empty folder
    over = {str(m.relative_to(ROOT)): lines(m) for m in modules if lines(m) > MODULE_LINES}
    assert over == {}, f"split these into modules of one purpose each: {over}"


def test_the_architecture_page_is_within_500_lines() -> None:
    page = ROOT / "docs" / "architecture.md"
    assert lines(page) <= ARCHITECTURE_LINES, f"{page.name}: {lines(page)} lines"


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, by absolute name (``from a import b``: ``a`` and
    ``a.b``, as ``b`` may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_benchmark_imports_the_demo() -> None:
    """The benchmarks' writer processes are their harness's (``benchmarks/harness.py``),
    not the product's demo."""
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert any(path.name == "harness.py" for path in scripts)
    importing = sorted(
        path.name
        for path in scripts
        if any(name.split(".")[:2] == ["shardkit", "demo"] for name in imported(path))
    )
    assert importing == [], f"these import shardkit.demo: {importing}"


def test_the_contract_that_keeps_the_package_off_the_benchmarks_names_every_one() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = (
        contract
        for contract in config["tool"]["importlinter"]["contracts"]
        if contract["name"] == "The package never imports the benchmarks"
    )
    assert contract["source_modules"] == ["shardkit"]
    assert sorted(contract["forbidden_modules"]) == sorted(
        path.stem for path in BENCHMARKS.glob("*.py")
    )
