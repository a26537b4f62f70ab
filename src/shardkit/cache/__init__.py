"""The shared cache: one interface, backends chosen by URL or handed in as live clients."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, cast

from shardkit import _urls
from shardkit.cache.base import Cache
from shardkit.cache.memory import MemoryCache
from shardkit.errors import ConfigurationError


def open_cache(target: str | Cache | Any) -> Cache:
    """A cache for a URL (``memory://``, ``redis://…``, ``rediss://…``,
    ``redis+cluster://host:port[,…]``, ``memcached://host:port``), a live redis-py
    (``Redis``, ``RedisCluster``) or pymemcache client, or a ``Cache``."""
    if isinstance(target, Cache):
        return target
    return cast(Cache, open_kind(target, CACHES, asyncio=False))


# The class of each kind of cache (its module, its name): the sync kit's.
CACHES = {
    "cluster": ("shardkit.cache.cluster", "RedisClusterCache"),
    "redis": ("shardkit.cache.redis", "RedisCache"),
    "memcached": ("shardkit.cache.memcached", "MemcachedCache"),
}
_SCHEMES = {"redis": "redis", "rediss": "redis", "unix": "redis", "memcached": "memcached"}


def open_kind(target: str | Any, classes: Mapping[str, tuple[str, str]], *, asyncio: bool) -> Any:
    """The cache for a URL or a live client (of redis-py's asyncio API if ``asyncio``),
    of the class ``classes`` names for its kind (``cluster``, ``redis``, ``memcached``;
    ``memory://`` is the ``MemoryCache``). ``ConfigurationError`` for anything else."""
    if isinstance(target, str):
        if target.partition(":")[0].lower() in ("redis+cluster", "rediss+cluster"):
            kind = "cluster"
        else:
            scheme = _urls.scheme(target)
            if scheme == "memory":
                return MemoryCache()
            if scheme not in _SCHEMES:
                raise ConfigurationError(
                    f"unknown cache URL scheme in {_urls.redact(target)!r}: a cache is "
                    "memory://, redis://, rediss://, unix://, redis+cluster:// or memcached://"
                )
            kind = _SCHEMES[scheme]
        return _class(classes[kind]).from_url(target)
    module = type(target).__module__
    redis = "redis.asyncio" if asyncio else "redis"
    if module == f"{redis}.cluster":
        return _class(classes["cluster"])(target)
    if module.startswith(redis) and (asyncio or not module.startswith("redis.asyncio")):
        return _class(classes["redis"])(target)
    if module.startswith("pymemcache"):
        return _class(classes["memcached"])(target)
    client = "a redis.asyncio" if asyncio else "a redis"
    raise ConfigurationError(
        f"a cache is a URL, {client} or pymemcache client, or a Cache, not {type(target).__name__}"
    )


def _class(where: tuple[str, str]) -> Any:
    module, name = where
    return getattr(importlib.import_module(module), name)


__all__ = ["CACHES", "Cache", "MemoryCache", "open_cache", "open_kind"]
