"""The Redis cache of an async kit (``redis.asyncio``): ``AsyncRedisCache``."""

from __future__ import annotations

from typing import Any

from shardkit._program import Awaiting
from shardkit._redis import redis_module
from shardkit.aio.sent_once import AsyncSentOnce
from shardkit.cache.redis import RedisCore, RedisRoles, _client

# The connections an async cache opened by URL keeps at most (redis-py's default).
_POOL = 100


class Lent:
    """``AsyncLending`` of a ``redis.asyncio`` client's connections: one is checked out
    of the client's pool per command (connected and checked by the pool) and goes back
    after it. Not held, as a sync client's are (``Held``): the pool of an async cache is
    bounded (``_POOL``) and shared with the client's other commands, which would wait
    for ever on connections held here."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    async def take(self) -> Any:
        return await self._pool.get_connection()

    async def give(self, conn: Any, sound: bool) -> None:
        try:
            if not sound:
                await conn.disconnect()
        finally:
            await self._pool.release(conn)

    def close(self) -> None:
        return None


class AsyncRedisCache(RedisCore, Awaiting):
    """Redis as the shared cache of an async kit (``redis.asyncio``): ``RedisCache``'s
    methods, awaited, on the same keys. Increments are sent once (``AsyncSentOnce``)."""

    def __init__(self, client: Any, *, url: str | None = None, owns_client: bool = False):
        super().__init__(client, url=url, owns_client=owns_client)
        self.roles = RedisRoles(AsyncSentOnce(client, Lent(client.connection_pool)))

    @classmethod
    def from_url(cls, url: str) -> AsyncRedisCache:
        """A cache on its own client, whose pool makes a coroutine wait for one of its
        ``_POOL`` connections rather than fail when all are busy (many coroutines of one
        process may send commands at once)."""
        redis_module()
        import redis.asyncio

        pool = _client(redis.asyncio.BlockingConnectionPool, url, max_connections=_POOL)
        return cls(redis.asyncio.Redis.from_pool(pool), url=url, owns_client=True)

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()


__all__ = ["AsyncRedisCache", "Lent"]
