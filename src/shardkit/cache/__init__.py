"""The shared cache: one interface, backends chosen by URL or handed in as live clients."""

from __future__ import annotations

from typing import Any

from shardkit import _urls
from shardkit.cache.base import Cache
from shardkit.cache.memory import MemoryCache
from shardkit.errors import ConfigurationError


def open_cache(target: str | Cache | Any) -> Cache:
    """A cache for a URL (``memory://``, ``redis://…``, ``rediss://…``,
    ``redis+cluster://host:port[,…]``, ``memcached://host:port``), a live redis-py
    (``Redis``, ``RedisCluster``) or pymemcache client, or a ``Cache``."""
    if isinstance(target, str):
        if target.partition(":")[0].lower() in ("redis+cluster", "rediss+cluster"):
            from shardkit.cache.cluster import RedisClusterCache

            return RedisClusterCache.from_url(target)
        scheme = _urls.scheme(target)
        if scheme == "memory":
            return MemoryCache()
        if scheme in ("redis", "rediss", "unix"):
            from shardkit.cache.redis import RedisCache

            return RedisCache.from_url(target)
        if scheme == "memcached":
            from shardkit.cache.memcached import MemcachedCache

            return MemcachedCache.from_url(target)
        raise ConfigurationError(f"unknown cache URL scheme in {_urls.redact(target)!r}")
    if isinstance(target, Cache):
        return target
    module = type(target).__module__
    if module == "redis.cluster":
        from shardkit.cache.cluster import RedisClusterCache

        return RedisClusterCache(target)
    if module.startswith("redis"):
        from shardkit.cache.redis import RedisCache

        return RedisCache(target)
    if module.startswith("pymemcache"):
        from shardkit.cache.memcached import MemcachedCache

        return MemcachedCache(target)
    raise ConfigurationError(
        f"a cache is a URL, a redis or pymemcache client, or a Cache, not {type(target).__name__}"
    )


__all__ = ["Cache", "MemoryCache", "open_cache"]
