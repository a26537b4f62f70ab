"""A kit's options, defined once: the keyword arguments of ``connect``, ``build`` and
``shardkit.aio.connect``, and the upper-case keys of the Django app's ``SHARDKIT``
setting (``PREFIX``, ``CACHE_TTL``, …)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypedDict

from shardkit.errors import ConfigurationError
from shardkit.validation import ADJUST_DELAY, check_kit_options


class KitOptions(TypedDict, total=False):
    """A kit's options; each one left out takes its value in ``DEFAULTS`` (the prefix:
    ``$SHARDKIT_PREFIX`` first)."""

    prefix: str
    """Begins the names of the kit's tables: an identifier of at most 40 characters.
    Kits of one store with different prefixes share nothing (say, staging and
    production in one database)."""
    cache_ttl: float
    """Seconds a cached value may live, the bound on a cached read's staleness (more
    than 0, at most 30 days)."""
    max_shards: int
    """The most shards a counter may be given (≥ 1)."""
    key_retention: float
    """Seconds an idempotency key is kept at least (0 … 100 years)."""
    adjust_delay: float
    """Seconds a process's sharded writes' adjustments of cached values gather before
    they are sent together (0 … 60): how stale ``value()`` may be in other processes,
    traded against a cache call per write at 0."""


DEFAULTS: KitOptions = {
    "prefix": "shardkit_",
    "cache_ttl": 5.0,
    "max_shards": 1000,
    "key_retention": 86400.0,
    "adjust_delay": ADJUST_DELAY,
}


def kit_options(given: Mapping[str, Any]) -> KitOptions:
    """Every option: those ``given`` over ``$SHARDKIT_PREFIX`` and ``DEFAULTS``, checked.
    ``ConfigurationError`` names an unknown option or the first bad value."""
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ConfigurationError(
            f"unknown option {unknown[0]!r}; the options are {', '.join(DEFAULTS)}"
        )
    prefix = os.environ.get("SHARDKIT_PREFIX") or DEFAULTS["prefix"]
    options: KitOptions = {**DEFAULTS, "prefix": prefix, **given}  # type: ignore[typeddict-item]
    check_kit_options(**options)
    options["adjust_delay"] = float(options["adjust_delay"])
    return options


def counter_options(options: KitOptions) -> dict[str, Any]:
    """What a kit's counters take of its ``options`` (all but the prefix, which names the
    store's tables)."""
    return {name: value for name, value in options.items() if name != "prefix"}


__all__ = ["DEFAULTS", "KitOptions", "counter_options", "kit_options"]
