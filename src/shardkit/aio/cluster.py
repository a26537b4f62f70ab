"""The Redis Cluster cache of an async kit (``redis.asyncio``'s ``RedisCluster``):
``AsyncRedisClusterCache``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from shardkit._program import Awaiting
from shardkit._redis import redis_module
from shardkit.aio.pipes import AsyncNodePipes
from shardkit.aio.redis import Lent
from shardkit.cache.cluster import ClusterCore, _Commands, parse

# Commands of an async cluster cache in flight at once; the others wait their turn. The
# asyncio cluster client fails a command at once (MaxConnectionsError) when its node has
# all its connections (100) in use, where a pool would make it wait.
_IN_FLIGHT = 64


class _AsyncCommands(_Commands):
    """``_Commands`` of an asyncio ``RedisCluster``, which reads the cluster's map on its
    first command: the commands sent once, to a node found from the map, read it first.
    At most ``_IN_FLIGHT`` commands are in flight; the others wait for one to end."""

    def __init__(self, client: Any, sender: Callable[[str], Any]) -> None:
        super().__init__(client, sender)
        self._slots = asyncio.Semaphore(_IN_FLIGHT)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def limited(*args: Any, **kwargs: Any) -> Any:
            result = attribute(*args, **kwargs)
            return self._in_turn(result) if inspect.isawaitable(result) else result

        return limited

    async def _in_turn(self, command: Any) -> Any:
        async with self._slots:
            return await command

    def mget(self, keys: list[str]) -> Any:
        return self._in_turn(self._client.mget_nonatomic(keys))

    async def incrby(self, name: str, amount: int) -> Any:
        async with self._slots:
            await self._client.initialize()
            return await super().incrby(name, amount)

    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        async with self._slots:
            await self._client.initialize()
            return await super().evalsha(sha, numkeys, *keys_and_args)


class OwnNodes:
    """``AsyncNodeClients`` of an asyncio ``RedisCluster``: a client of each primary of our
    own, with the cluster client's credentials (it lends no pipeline pinned to one
    node), each command on a connection ``Lent`` by its pool."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._nodes: dict[str, Any] = {}

    async def ready(self) -> None:
        await self._client.initialize()  # the map, if no command has read it yet

    def client(self, node: Any) -> Any:
        own = self._nodes.get(node.name)
        if own is None:  # with every connection setting of the cluster client's
            import redis.asyncio

            pool = redis.asyncio.ConnectionPool(
                connection_class=node.connection_class, **node.connection_kwargs
            )
            own = self._nodes[node.name] = redis.asyncio.Redis.from_pool(pool)  # owns it
        return own

    def lending(self, client: Any) -> Lent:
        return Lent(client.connection_pool)

    async def close(self) -> None:
        for own in self._nodes.values():
            await own.aclose()
        self._nodes.clear()


class AsyncRedisClusterCache(ClusterCore, Awaiting):
    """Redis Cluster as the shared cache of an async kit (``redis.asyncio``'s
    ``RedisCluster``): ``RedisClusterCache``'s methods, awaited, on the same keys."""

    @classmethod
    def from_url(cls, url: str) -> AsyncRedisClusterCache:
        """A cache on the cluster that any of the URL's nodes belongs to (it connects on
        its first command)."""
        redis_module()
        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.asyncio.retry import Retry

        client = RedisCluster(**parse(url).client_options(ClusterNode, Retry))
        return cls(client, url=url, owns_client=True)

    _pipes_of, _nodes_of, _commands_of, _clock = AsyncNodePipes, OwnNodes, _AsyncCommands, asyncio

    async def close(self) -> None:
        await self._pipes.close()
        if self._owns_client:
            await self._client.aclose()


__all__ = ["AsyncRedisClusterCache"]
