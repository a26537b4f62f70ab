"""``Replicas`` on a Redis Cluster client: ``AsyncNodePipes`` on ``redis.asyncio``'s,
``NodePipes`` on redis-py's sync one; written once here, the sync form generated from it
(``shardkit/_sync/pipes.py``, by ``tools/generate_sync.py``). See
``shardkit.cache.cluster`` for why an increment waits for a replica."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from shardkit._redis import INCR, Unreplicated, redis_module
from shardkit.aio.sent_once import AsyncLending, AsyncSentOnce

# How long an increment waits for a replica to acknowledge it.
WAIT_MS = 500


class Alone:
    """The primaries whose ``ROLE`` (asked after an increment no replica acknowledged)
    lists no replica: their increments are not waited for (each would wait the whole
    timeout, and a primary with no replica cannot be replaced by a stale one) but asked
    ``ROLE`` again with each, until it lists one."""

    def __init__(self) -> None:
        self._alone: set[str] = set()

    def waits(self, node: str) -> bool:
        return node not in self._alone

    def found(self, node: str, role: Any) -> bool:
        """Note ``ROLE``'s answer of ``node``; whether it lists a replica."""
        if role[2]:  # a primary's ROLE lists its replicas third
            self._alone.discard(node)
            return True
        self._alone.add(node)
        return False


class AsyncNodeClients(Protocol):
    """A cluster client's nodes, each as a client of its own: the form's choice
    (``shardkit.cache.cluster.Nodes``, ``shardkit.aio.cluster.OwnNodes``)."""

    async def ready(self) -> None:
        """Read the cluster's map, if no command has read it yet."""

    def client(self, node: Any) -> Any:
        """A client of ``node`` alone."""

    def lending(self, client: Any) -> AsyncLending:
        """Where a sender on ``client`` takes its connections from."""

    async def close(self) -> None:
        """Close the clients made here."""


class AsyncNodePipes:
    """Plays ``Replicas`` on a cluster ``client``: an increment and its ``WAIT`` in one
    pipeline on the key's primary, and the increments sent once (``sender``), on the
    clients of ``nodes``."""

    def __init__(self, client: Any, nodes: AsyncNodeClients) -> None:
        self._client = client
        self._nodes = nodes
        self._alone = Alone()
        self._senders: dict[str, AsyncSentOnce] = {}  # by node

    def sender(self, key: str) -> AsyncSentOnce:
        """Sends once to the primary of ``key``."""
        node = self._client.get_node_from_key(key)
        own = self._nodes.client(node)
        sender = self._senders.get(node.name)
        if sender is None or sender.client is not own:  # new, or made again by redis-py
            if sender is not None:
                sender.close()
            sender = self._senders[node.name] = AsyncSentOnce(own, self._nodes.lending(own))
        return sender

    async def incr(self, key: str, delta: int) -> Any:
        await self._nodes.ready()
        node = self._client.get_node_from_key(key)
        own = self._nodes.client(node)
        waits = self._alone.waits(node.name)
        async with own.pipeline(transaction=False) as pipe:
            pipe.evalsha(INCR.sha, 1, key, delta)
            if waits:
                pipe.wait(1, WAIT_MS)
            else:  # a replica that is back must be waited for from this increment on
                pipe.execute_command("ROLE")
            value, answer = await pipe.execute()
        if waits and answer:  # a replica acknowledged it
            return value
        role = await own.execute_command("ROLE") if waits else answer
        if self._alone.found(node.name, role):
            raise Unreplicated(f"no replica of {node.name} acknowledged within {WAIT_MS} ms")
        return value

    async def refresh(self) -> None:
        redis = redis_module()
        with contextlib.suppress(redis.RedisError, redis.exceptions.RedisClusterException):
            await self._client.nodes_manager.initialize()

    async def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
        await self._nodes.close()


__all__ = ["AsyncNodeClients", "AsyncNodePipes"]
