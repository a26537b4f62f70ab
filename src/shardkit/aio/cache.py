"""Caches of the async kit that have no asyncio client of their own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from shardkit.cache.base import Cache


class OffloadedCache:
    """A blocking cache (memcached, through pymemcache's pooled, thread-safe client) for
    an async kit: each call runs in the event loop's default thread pool, so it never
    blocks the loop. (There is no well-kept asyncio memcached client to build on; this is
    what ``asyncio.to_thread`` is for.) The same keys and meanings as the cache itself;
    a cancelled call may still complete in its thread."""

    def __init__(self, cache: Cache) -> None:
        self._cache = cache
        self.url = cache.url
        self.shared = cache.shared

    async def get(self, key: str) -> int | None:
        return await asyncio.to_thread(self._cache.get, key)

    async def get_many(self, keys: Iterable[str]) -> dict[str, int]:
        return await asyncio.to_thread(self._cache.get_many, list(keys))

    async def add(self, key: str, value: int, ttl: float | None) -> bool:
        return await asyncio.to_thread(self._cache.add, key, value, ttl)

    async def add_many(self, values: Mapping[str, int], ttl: float | None) -> None:
        await asyncio.to_thread(self._cache.add_many, dict(values), ttl)

    async def incr(self, key: str, delta: int) -> int | None:
        return await asyncio.to_thread(self._cache.incr, key, delta)

    async def incr_many(self, deltas: Mapping[str, int]) -> None:
        await asyncio.to_thread(self._cache.incr_many, dict(deltas))

    async def bump(self, key: str, delta: int) -> int:
        return await asyncio.to_thread(self._cache.bump, key, delta)

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._cache.delete, key)

    async def close(self) -> None:
        await asyncio.to_thread(self._cache.close)


__all__ = ["OffloadedCache"]
