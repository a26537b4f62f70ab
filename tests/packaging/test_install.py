"""What a fresh install gets: each extra, installed alone from the working tree into a
clean virtual environment (no test dependencies in it: Sybil alone, which runs the
page), runs its page of the documentation there against the real services. And what keeps a
fresh clone green when a dependency makes a new release: CI's pins cover everything the
tests install, and a dependency's own deprecation warnings do not fail the tests.

shardkit's wheel is built once per session, as ``pip install <repo>`` builds it (its build
backend in an isolated environment, from the working tree), and each extra's environment is
made once per session. uv makes them (``uv build --wheel``, ``uv venv``, ``uv pip install``)
and installs the build environments of ``python -m build``, taking the packages from its
cache and its index (PyPI unless uv's own settings name another); ``PIP_CONSTRAINT``, as CI
sets it, constrains them as it constrains pip.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from uv import find_uv_bin

from backends import CACHE_URLS, CELERY_BROKERS, ROOT, STORE_URLS
from page_runs import environ, names_of, run_page

DEADLINE = 300.0  # seconds a build or an install may take, on a busy machine
# What the pages name for the store and the cache (mapped to each extra's own here).
POSTGRES = "postgresql+psycopg://localhost/app"
REDIS_CACHE = "redis://localhost:6379/0"

Venv = Callable[..., Path]


def _run(command: list[str], **options: Any) -> str:
    """Run ``command``; its stdout, or the test fails showing what it printed."""
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=DEADLINE, check=False, **options
    )
    if done.returncode != 0:
        pytest.fail(
            f"{' '.join(command)} exited with {done.returncode}\n"
            f"--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-5000:]}"
        )
    return done.stdout


def _uv(*args: str) -> str:
    """Run uv (the test extra's) with ``args``, constrained as pip is."""
    return _run([find_uv_bin(), *args, "--quiet"], env=_uv_environ())


def _uv_environ() -> dict[str, str]:
    """The environment of uv, and of a build installing with it: ``PIP_CONSTRAINT``'s
    files (when set) constrain what it installs, build environments included; nothing of
    this session's Python path."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    constraints = os.environ.get("PIP_CONSTRAINT", "")
    if constraints:
        env["UV_CONSTRAINT"] = env["UV_BUILD_CONSTRAINT"] = constraints
    return env


def _build(kind: str, source: Path, out: Path) -> Path:
    """Build shardkit's ``kind`` (``sdist`` or ``wheel``) from ``source`` into ``out`` with
    ``python -m build``, a release's frontend, its isolated environment installed by uv;
    the distribution built."""
    command = [sys.executable, "-m", "build", "--installer", "uv", f"--{kind}"]
    _run([*command, "--outdir", str(out), str(source)], env=_uv_environ())
    (built,) = out.glob("shardkit-*")
    return built


def _clean_venv(path: Path, *wanted: str) -> str:
    """Make a virtual environment at ``path`` (no pip in it) holding ``wanted`` and what
    they require, nothing else; its Python."""
    _uv("venv", "--python", sys.executable, "--no-project", str(path))
    python = str(path / "bin" / "python")
    _uv("pip", "install", "--python", python, *wanted)
    return python


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """shardkit's wheel, built from the working tree."""
    out = tmp_path_factory.mktemp("wheel")
    _uv("build", "--wheel", "--python", sys.executable, "--out-dir", str(out), str(ROOT))
    (built,) = out.glob("shardkit-*.whl")
    return built


@pytest.fixture(scope="session")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """shardkit's sdist, built from the working tree as a release builds it."""
    return _build("sdist", ROOT, tmp_path_factory.mktemp("sdist"))


@pytest.fixture(scope="session")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """``venv(extra, *also)``: a virtual environment holding ``shardkit[extra]`` and what
    it requires, Sybil (which runs a page) and ``also``, nothing else (made once per
    session)."""
    made: dict[tuple[str, ...], Path] = {}

    def make(extra: str, *also: str) -> Path:
        key = (extra, *also)
        if key not in made:
            path = tmp_path_factory.mktemp(f"venv-{extra}")
            python = _clean_venv(path, f"shardkit[{extra}] @ {wheel.as_uri()}", "sybil", *also)
            # Clean: the test dependencies (which bring packages of their own) are absent.
            _run([python, "-c", "import importlib.util as u; assert not u.find_spec('pytest')"])
            made[key] = path
        return made[key]

    return make


def run_page_in(venv: Path, page: str, tmp_path: Path, **instead: str) -> None:
    """Run ``page`` (a path in the repository) with ``venv``'s Python, in ``tmp_path``,
    what it names mapped to the tests' own or to ``instead``'s."""
    path = ROOT / page
    run_page(path, tmp_path, names_of(path, **instead), venv)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "store", "cache"),
    [
        ("postgres", "postgres", "memory"),
        ("mysql", "mysql", "memory"),
        ("redis", "sqlite", "redis"),
        ("memcached", "sqlite", "memcached"),
    ],
)
def test_each_driver_extra_alone_runs_the_sharded_counters_guide(
    extra: str, store: str, cache: str, venv: Venv, tmp_path: Path
) -> None:
    store_url = STORE_URLS[store] or "sqlite:///app.db"
    run_page_in(
        venv(extra),
        "docs/guides/sharded.md",
        tmp_path,
        **{POSTGRES: store_url, REDIS_CACHE: CACHE_URLS[cache]},
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extras", "store", "cache"),
    [
        ("aio", "sqlite", "memory"),
        ("aio,postgres,redis", "postgres", "redis"),
        ("aio,mysql", "mysql", "memory"),
    ],
)
def test_the_aio_extra_runs_the_asyncio_page(
    extras: str, store: str, cache: str, venv: Venv, tmp_path: Path
) -> None:
    store_url = STORE_URLS[store] or "sqlite:///app.db"
    python = venv(extras, "fastapi", "httpx")  # the page's service, and its test client
    run_page_in(
        python,
        "docs/integrations/asyncio.md",
        tmp_path,
        **{POSTGRES: store_url, REDIS_CACHE: CACHE_URLS[cache]},
    )


@pytest.mark.slow
def test_the_django_extra_alone_runs_the_django_page(venv: Venv, tmp_path: Path) -> None:
    run_page_in(
        venv("django"), "docs/integrations/django.md", tmp_path, **{REDIS_CACHE: "memory://"}
    )


@pytest.mark.slow
def test_the_metrics_and_dashboard_extras_alone_serve_the_operating_page(
    venv: Venv, tmp_path: Path
) -> None:
    run_page_in(
        venv("metrics,dashboard"), "docs/operating.md", tmp_path, **{POSTGRES: "sqlite:///app.db"}
    )


@pytest.mark.slow
@pytest.mark.parametrize("broker", list(CELERY_BROKERS))
def test_the_celery_extra_alone_runs_the_celery_page_on_a_real_worker(
    broker: str, venv: Venv, tmp_path: Path
) -> None:
    run_page_in(
        venv("celery"),
        "docs/integrations/celery.md",
        tmp_path,
        **{
            "redis://localhost:6379/1": CELERY_BROKERS[broker],
            POSTGRES: "sqlite:///app.db",
            REDIS_CACHE: "memory://",
        },
    )


# What a working tree holds that no distribution may: caches, bytecode, databases, venvs.
_ARTIFACT = re.compile(
    r"(^|/)(__pycache__|\.pytest_cache|\.mypy_cache|\.ruff_cache|\.import_linter_cache"
    r"|\.hypothesis|test-artifacts|\.venv[^/]*|dist|build)(/|$)|\.(pyc|db|db-wal|db-shm)$"
)


@pytest.mark.slow
def test_the_sdist_rebuilds_and_its_wheel_alone_runs_the_demo(sdist: Path, tmp_path: Path) -> None:
    """The sdist holds what a rebuild needs and no artifact of the working tree; the wheel
    built from it, installed alone in a clean environment, runs ``shardkit demo``."""
    with tarfile.open(sdist) as tar:
        members = {name.partition("/")[2] for name in tar.getnames()}
        tar.extractall(tmp_path, filter="data")
    needed = {"pyproject.toml", "README.md", "LICENSE", "src/shardkit/py.typed"}
    assert needed <= members
    assert sorted(name for name in members if _ARTIFACT.search(name)) == []
    unpacked = tmp_path / sdist.name.removesuffix(".tar.gz")
    rebuilt = _build("wheel", unpacked, tmp_path / "wheels")
    env = tmp_path / "venv"
    _clean_venv(env, str(rebuilt))
    out = _run(
        [str(env / "bin" / "shardkit"), "demo", "--writers", "1", "--seconds", "0.2", "--json"],
        cwd=tmp_path,
        env=environ(env),
    )
    demo = json.loads(out.splitlines()[-1])
    assert demo["exact"] is True
    assert [race["mode"] for race in demo["races"]] == ["naive", "sharded", "buffered"]


def _required(requirement: Requirement, seen: set[tuple[str, frozenset[str]]]) -> None:
    """Add to ``seen`` the distribution ``requirement`` names, with its extras, and,
    recursively, what its installed metadata requires on this interpreter."""
    key = (canonicalize_name(requirement.name), frozenset(requirement.extras))
    if key in seen:
        return
    seen.add(key)
    for text in metadata.requires(requirement.name) or []:
        required = Requirement(text)
        marker = required.marker
        if marker is None or any(marker.evaluate({"extra": e}) for e in {"", *key[1]}):
            _required(required, seen)


def test_ci_pins_every_distribution_the_tests_install() -> None:
    pins = {}
    for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    seen: set[tuple[str, frozenset[str]]] = set()
    _required(Requirement("shardkit[test]"), seen)  # as installed by `pip install -e .[test]`
    installed = {name for name, _ in seen} - {"shardkit"}
    assert sorted(installed - set(pins)) == []
    assert all(pins.values())  # exact versions
    assert "shardkit" not in pins  # the editable project cannot be constrained
    assert {"psycopg", "cryptography", "packaging", "redis", "kombu", "pytest"} <= installed


def test_a_dependencys_own_deprecation_is_shown_and_one_caused_here_is_an_error() -> None:
    """pyproject's warning filters (in force in every test): a deprecation warning a
    dependency raises in its own code is shown; one attributed to shardkit's code or a
    test's (as a deprecated function's warning is to its caller) is an error, and so is
    any other warning."""
    deprecations = [DeprecationWarning, PendingDeprecationWarning]
    with warnings.catch_warnings(record=True) as shown:
        for category, module in zip(deprecations, ["kombu.utils", "django.db"], strict=True):
            warnings.warn_explicit("old", category, f"{module}.py", 1, module=module)
    assert [warning.category for warning in shown] == deprecations
    for module in (
        "shardkit",
        "shardkit.kit",
        "test_install",
        "conftest",
        "contrib.django.test_django_counts",
        "servers",
        "mapper_workers",
    ):
        for category in deprecations:
            with pytest.raises(category):
                warnings.warn_explicit("old", category, f"{module}.py", 1, module=module)
    with pytest.raises(UserWarning):
        warnings.warn_explicit("odd", UserWarning, "kombu/x.py", 1, module="kombu.x")
