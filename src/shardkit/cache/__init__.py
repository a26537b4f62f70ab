"""The shared cache: one interface, backends chosen by URL or handed in as live clients."""

from __future__ import annotations

import importlib
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
    return cast(Cache, _open(target, asyncio=False))


def open_async_cache(target: str | Any) -> Any:
    """An async kit's cache for a URL (as ``open_cache``'s) or a live ``redis.asyncio``
    or pymemcache client: ``AsyncRedisCache``, ``AsyncRedisClusterCache``,
    ``MemoryCache`` (which never blocks), or memcached's blocking ``MemcachedCache``, for
    the async kit to run in threads."""
    return _open(target, asyncio=True)


# Each kind of cache: its module, and its classes for the sync and the async kit.
_KINDS = {
    "cluster": ("shardkit.cache.cluster", "RedisClusterCache", "AsyncRedisClusterCache"),
    "redis": ("shardkit.cache.redis", "RedisCache", "AsyncRedisCache"),
    "memcached": ("shardkit.cache.memcached", "MemcachedCache", "MemcachedCache"),
}
_SCHEMES = {"redis": "redis", "rediss": "redis", "unix": "redis", "memcached": "memcached"}


def _open(target: str | Any, *, asyncio: bool) -> Any:
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
        return _class(kind, asyncio).from_url(target)
    module = type(target).__module__
    redis = "redis.asyncio" if asyncio else "redis"
    if module == f"{redis}.cluster":
        return _class("cluster", asyncio)(target)
    if module.startswith(redis) and (asyncio or not module.startswith("redis.asyncio")):
        return _class("redis", asyncio)(target)
    if module.startswith("pymemcache"):
        return _class("memcached", asyncio)(target)
    client = "a redis.asyncio" if asyncio else "a redis"
    raise ConfigurationError(
        f"a cache is a URL, {client} or pymemcache client, or a Cache, not {type(target).__name__}"
    )


def _class(kind: str, asyncio: bool) -> Any:
    module, sync, awaited = _KINDS[kind]
    return getattr(importlib.import_module(module), awaited if asyncio else sync)


__all__ = ["Cache", "MemoryCache", "open_async_cache", "open_cache"]
