"""The Redis cache of an async kit (``redis.asyncio``): ``AsyncRedisCache``."""

from __future__ import annotations

from typing import Any

from shardkit._program import Awaiting
from shardkit.cache.redis import RedisCore, RedisRoles, _client, _redis_module, _Sender

# The connections an async cache opened by URL keeps at most (redis-py's default).
_POOL = 100


class AsyncSentOnce(_Sender):
    """``_Sender`` of a ``redis.asyncio`` client: an increment goes on a connection
    checked out of the client's pool for it (connected and checked by the pool), which
    redis-py closes if the send or the read fails or is cancelled (a reply may be on its
    way) before it goes back."""

    async def _once(self, *command: Any) -> Any:
        conn = await self._pool.get_connection()
        try:
            await conn.send_command(*command)
            return await conn.read_response()
        finally:
            await self._pool.release(conn)


class AsyncRedisCache(RedisCore, Awaiting):
    """Redis as the shared cache of an async kit (``redis.asyncio``): ``RedisCache``'s
    methods, awaited, on the same keys. Increments are sent once (``AsyncSentOnce``)."""

    def __init__(self, client: Any, *, url: str | None = None, owns_client: bool = False):
        super().__init__(client, url=url, owns_client=owns_client)
        self.roles = RedisRoles(AsyncSentOnce(client))

    @classmethod
    def from_url(cls, url: str) -> AsyncRedisCache:
        """A cache on its own client, whose pool makes a coroutine wait for one of its
        ``_POOL`` connections rather than fail when all are busy (many coroutines of one
        process may send commands at once)."""
        _redis_module()
        import redis.asyncio

        pool = _client(redis.asyncio.BlockingConnectionPool, url, max_connections=_POOL)
        return cls(redis.asyncio.Redis.from_pool(pool), url=url, owns_client=True)

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()


__all__ = ["AsyncRedisCache", "AsyncSentOnce"]
