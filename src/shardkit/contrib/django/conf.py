"""The app's settings, ``settings.SHARDKIT``, and the kit built from them.

::

    SHARDKIT = {
        "STORE": "default",             # the Django database alias of shardkit's tables
        "CACHE": "redis://localhost:6379/0",  # a cache URL, a live client, or an entry
                                        # of CACHES (a Redis one) whose client to share
        "EXECUTOR": None,               # None (threads of this process), a Celery app, an
                                        # Executor, or the import path of either
        "PREFIX": "shardkit_",          # table names (migrate creates them anew if changed)
        "SECRET": None,                 # signs mapping closures ($SHARDKIT_SECRET)
        "CACHE_TTL": 5.0, "MAX_SHARDS": 1000, "KEY_RETENTION": 86400.0,
        "ADJUST_DELAY": 0.1,            # seconds writes' cache adjustments gather
        "DASHBOARD_TOKEN": None,        # lets the dashboard cancel and resume jobs
        "METRICS_COUNTERS": [],         # counters whose values /metrics exports
    }

The kit is built in ``AppConfig.ready()`` without reaching the database or the cache,
and built again when a test overrides ``SHARDKIT``. A bad setting raises
``ImproperlyConfigured`` there.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections

from shardkit.cache import open_cache
from shardkit.errors import ConfigurationError, ShardkitError
from shardkit.executor import Executor, LocalExecutor, Marks, Task
from shardkit.kit import Kit, build
from shardkit.mapper.spec import resolve
from shardkit.options import DEFAULTS

from .store import DjangoStore

_DEFAULTS: dict[str, Any] = {
    "STORE": "default",
    "CACHE": "memory://",
    "EXECUTOR": None,
    "SECRET": None,
    **{name.upper(): value for name, value in DEFAULTS.items()},  # the kit's options
    "DASHBOARD_TOKEN": None,
    "METRICS_COUNTERS": [],
}

_lock = threading.Lock()
_kit: Kit | None = None


def options() -> dict[str, Any]:
    """``settings.SHARDKIT`` over the defaults; ``ImproperlyConfigured`` for anything
    that is not a dict or names an unknown option."""
    given = getattr(settings, "SHARDKIT", {})
    if not isinstance(given, dict):
        raise ImproperlyConfigured(f"settings.SHARDKIT must be a dict, not {type(given).__name__}")
    unknown = sorted(set(given) - set(_DEFAULTS))
    if unknown:
        raise ImproperlyConfigured(
            f"unknown SHARDKIT option {unknown[0]!r}; the options are {', '.join(_DEFAULTS)}"
        )
    return {**_DEFAULTS, **given}


def store_on(alias: str) -> DjangoStore:
    """A store on database ``alias`` with the configured prefix (its tables' names)."""
    return DjangoStore(alias, prefix=options()["PREFIX"])


def migration_store(schema_editor: Any) -> DjangoStore:
    """The store on the database a migration runs on, with the configured prefix."""
    return store_on(schema_editor.connection.alias)


def _cache(value: Any) -> Any:
    """The cache a setting names: a URL or a live client as they are, or the alias of an
    entry of ``CACHES``, whose Redis client is shared (Django's ``RedisCache`` or
    django-redis': the same connection pool, the server its ``LOCATION`` names first)."""
    if not isinstance(value, str) or "://" in value:
        return value
    entries = getattr(settings, "CACHES", {})
    if value not in entries:
        raise ConfigurationError(
            f"SHARDKIT['CACHE'] is a cache URL or an entry of CACHES "
            f"({', '.join(map(repr, entries)) or 'none'}), not {value!r}"
        )
    from django.core.cache import caches

    backend: Any = caches[value]
    module = type(backend).__module__
    if module == "django.core.cache.backends.redis":
        return backend._cache.get_client(write=True)
    if module.startswith("django_redis") and type(backend.client).__name__ != "ShardClient":
        return backend.client.get_client(write=True)
    raise ConfigurationError(
        f"CACHES[{value!r}] is a {type(backend).__name__} ({module}): shardkit shares the "
        "client of a Redis cache (Django's RedisCache, django-redis); give it a URL instead"
    )


def _executor(value: Any) -> Executor | None:
    """The executor a setting names: None, an Executor, a Celery app, or an import path
    (``"proj.celery:app"``) of either."""
    if isinstance(value, str):
        value = resolve(value)
    if value is None or isinstance(value, Executor):
        return value
    if type(value).__module__.startswith("celery"):
        from shardkit.contrib.celery import CeleryExecutor

        return CeleryExecutor(value)
    raise ConfigurationError(
        f"SHARDKIT['EXECUTOR'] is None, a Celery app or a shardkit Executor, not {value!r}"
    )


class DjangoLocalExecutor(LocalExecutor):
    """The local executor, whose tasks run as Django expects of work outside a request:
    each closes the thread's database connections that ``CONN_MAX_AGE`` says to close,
    before and after it runs (a pool thread's connection would otherwise stay open).
    Celery's own Django support does the same for its workers."""

    def bind(self, tasks: Mapping[str, Task], marks: Marks) -> None:
        super().bind({name: _in_django(task) for name, task in tasks.items()}, marks)


def _in_django(task: Task) -> Task:
    def run(args: Mapping[str, Any]) -> object:
        close_old_connections()
        try:
            return task(args)
        finally:
            close_old_connections()

    return run


def _build() -> Kit:
    """A kit built from the settings; ``ImproperlyConfigured`` if they are wrong."""
    option = options()
    try:
        return build(
            DjangoStore(option["STORE"], prefix=option["PREFIX"]),
            open_cache(_cache(option["CACHE"])),
            executor=_executor(option["EXECUTOR"]) or DjangoLocalExecutor(),
            secret=option["SECRET"],
            **{name: option[name.upper()] for name in DEFAULTS},
        )
    except ShardkitError as exc:
        raise ImproperlyConfigured(f"settings.SHARDKIT: {exc}") from exc


def configure() -> Kit:
    """Build the kit from the settings, replacing (and closing) the one before."""
    global _kit
    kit = _build()
    with _lock:
        old, _kit = _kit, kit
    if old is not None:
        old.close()
    return kit


def kit() -> Kit:
    """The kit of the Django app: its store is the database ``SHARDKIT['STORE']``."""
    global _kit
    built = _kit  # read once: ``configure`` may replace it meanwhile
    if built is not None:
        return built
    with _lock:
        if _kit is None:  # only if the app's ready() has not run
            _kit = _build()
        return _kit


def database() -> str:
    """The alias of the database the kit's store is on."""
    store = kit().store
    assert isinstance(store, DjangoStore)
    return store.alias


def reconfigure(*, setting: str, **kwargs: Any) -> None:
    """``setting_changed`` receiver: a test that overrides SHARDKIT gets a kit built
    from its settings."""
    if setting == "SHARDKIT":
        configure()


__all__ = ["configure", "database", "kit", "migration_store", "options", "store_on"]
