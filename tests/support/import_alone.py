"""Import each module named on the command line alone and first, in a process of its own;
print, as JSON, each module's error (``null`` when it imported) and whether Django was
set up first.

Each module is imported in a child forked from this process, which has imported none of
shardkit: the module is the first of the package that child imports, as it would be the
first in a program that starts with it. A module that Django refuses to import before
its apps are loaded (``AppRegistryNotReady``: one that defines or reads models) is
imported again in a fresh child after ``django.setup()`` (``DJANGO_SETTINGS_MODULE``), as
Django imports it. ``shardkit.__main__`` runs the command: it is imported with
``--help``, and exiting with status 0 counts as imported::

    python tests/support/import_alone.py shardkit.kit shardkit._sync.adjuster ...
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import multiprocessing
import os
import sys
import traceback

# Others' modules that the package imports, loaded once here rather than in every child:
# they are not shardkit's, and loading them first leaves the order in which shardkit's
# modules import one another as it is.
PRELOADED = (
    "click",
    "django.core.management",
    "django.db.migrations",
    "django.db.models",
    "django.http",
    "django.urls",
    "prometheus_client",
    "rich",
    "sqlalchemy.dialects.sqlite",
    "sqlalchemy.ext.asyncio",
    "sqlalchemy.ext.compiler",
)


def imported(name: str, setup: bool) -> str | None:
    """Import ``name`` (after ``django.setup()`` when ``setup``); the error, if one."""
    try:
        if setup:
            import django

            django.setup()
        if name.rpartition(".")[2] == "__main__":
            sys.argv = [name, "--help"]
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    importlib.import_module(name)
                except SystemExit as exit:
                    if exit.code not in (0, None):
                        raise
        else:
            importlib.import_module(name)
    except BaseException as exc:
        if not setup and type(exc).__name__ == "AppRegistryNotReady":
            return "AppRegistryNotReady"
        return "".join(traceback.format_exception(exc, limit=-4))
    return None


def bare(name: str) -> str | None:
    return imported(name, setup=False)


def after_setup(name: str) -> str | None:
    return imported(name, setup=True)


def main(names: list[str]) -> dict[str, dict[str, object]]:
    for name in PRELOADED:
        importlib.import_module(name)
    assert not any(m == "shardkit" or m.startswith("shardkit.") for m in sys.modules)
    # A fresh child for each module (maxtasksperchild=1), forked from this process.
    fork = multiprocessing.get_context("fork")
    with fork.Pool(os.cpu_count(), maxtasksperchild=1) as pool:
        errors = dict(zip(names, pool.map(bare, names, chunksize=1), strict=True))
        later = [name for name, error in errors.items() if error == "AppRegistryNotReady"]
        errors |= dict(zip(later, pool.map(after_setup, later, chunksize=1), strict=True))
    return {name: {"error": errors[name], "django_setup": name in later} for name in names}


if __name__ == "__main__":
    json.dump(main(sys.argv[1:]), sys.stdout)
