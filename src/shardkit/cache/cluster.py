"""Redis Cluster as the shared cache (redis-py's ``RedisCluster``), by URL
(``redis+cluster://host:port[,host:port…]``) or as a live client.

A key lives on the primary that owns its hash slot. Keys that one command reads or
changes together must share a slot: every key of one counter carries the counter's name
as a hash tag (``Options.cache_key``), a buffered counter's generation its own tag, so
that its stripes can be placed on different primaries (``owner``). Reads of many keys
are one command per primary (``MGET`` per slot group, sent by redis-py), ``incr_many``
one script per slot. MOVED and ASK redirections and a failover's new topology are
followed by the client.

A primary acknowledges a write before its replicas have it, so a failover can bring a
key back to an older value. For ``incr`` — what ids and monotonic values are handed out
from — that would hand a value out twice: ``incr`` therefore returns only once a replica
has the increment too (``WAIT``), when the primary has one (up to ``_WAIT_MS`` for a
replica that does not answer; then the value is handed out, as with no replica).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from shardkit import _urls
from shardkit._program import run
from shardkit.cache.redis import _INCR, RedisCache, RedisCore, _redis_module
from shardkit.errors import BackendError, BackendUnavailable, ConfigurationError

# How long an increment waits for a replica to acknowledge it.
_WAIT_MS = 500
# Errors of a slot on the move: ask the cluster where it is now, and try again there.
_MOVING = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")
# How long a command on one primary is retried while the cluster fails over (a replica
# is promoted once the others have missed the primary for cluster-node-timeout).
_FAILOVER = 15.0


class _Commands:
    """The role ``Client`` played by a ``RedisCluster``: its commands, with ``MGET`` of
    keys in many slots sent as one ``MGET`` per slot (redis-py's ``mget_nonatomic``;
    each value is read atomically, the set of them is not)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def mget(self, keys: list[str]) -> Any:
        return self._client.mget_nonatomic(keys)


class RedisClusterCache(RedisCache):
    """Redis Cluster as the shared cache: ``RedisCache``'s contract on every primary of a
    cluster, plus ``owner``/``owners`` (where a key lives), which a buffered counter's
    stripes are placed by. Thread-safe and fork-safe (each node's pool reconnects in a
    child)."""

    @classmethod
    def from_url(cls, url: str) -> RedisClusterCache:
        """A cache on the cluster that any of ``redis+cluster://[user:pw@]host:port[,…]``'s
        nodes belongs to (``rediss+cluster://`` for TLS; database 0 only)."""
        redis = _redis_module()
        from redis.cluster import ClusterNode, RedisCluster

        parts = _urls.split(url, "cache", ports=False)
        hosts = parts.netloc.rpartition("@")[2]
        nodes = [n for n in hosts.split(",") if n]
        if not nodes or parts.path not in ("", "/", "/0") or parts.query:
            raise ConfigurationError(
                "a Redis Cluster URL is redis+cluster://[user:password@]host:port[,host:port…]"
                f", not {_urls.redact(url)!r}"
            )
        startup = []
        for node in nodes:
            where = _urls.split(f"redis://{node}", "cache")
            node_at: Any = ClusterNode
            startup.append(node_at(where.hostname or "localhost", where.port or 6379))
        try:
            client = RedisCluster(
                startup_nodes=startup,
                username=parts.username,
                password=parts.password,
                ssl=parts.scheme.lower().startswith("rediss"),
                socket_connect_timeout=5,
                socket_timeout=5,
            )
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            detail = _urls.scrub(str(exc), parts.password)
            raise BackendUnavailable(
                f"cannot reach the cache at {_urls.redact(url)}: {detail}"
            ) from exc
        return cls(client, url=url, owns_client=True)

    def __init__(self, client: Any, *, url: str | None = None, owns_client: bool = False):
        super().__init__(client, url=url, owns_client=owns_client)
        self.roles = {"Client": _Commands(client)}

    @staticmethod
    def _describe(client: Any) -> tuple[str, str | None]:
        nodes = sorted(node.name for node in client.get_nodes())
        kwargs = client.get_default_node().redis_connection.connection_pool.connection_kwargs
        return f"redis+cluster://{','.join(nodes)}", kwargs.get("password")

    # -- placement -------------------------------------------------------------------

    def owner(self, key: str) -> str:
        """The primary that holds ``key`` now (from the client's map of the cluster)."""
        return str(self._client.get_node_from_key(key).name)

    def owners(self) -> list[str]:
        """The cluster's primaries, in a stable order."""
        return sorted(node.name for node in self._client.get_primaries())

    # -- what differs from one server ------------------------------------------------

    def incr_many(self, deltas: Mapping[str, int]) -> None:
        """One script per slot (a script's keys must share one)."""
        groups: dict[int, dict[str, int]] = {}
        for key, delta in deltas.items():
            groups.setdefault(self._client.keyslot(key), {})[key] = delta
        for group in groups.values():
            run(RedisCore._incr_many(self, group), self.roles)

    def incr(self, key: str, delta: int) -> int | None:
        """``RedisCache.incr``, returning once a replica has the increment (see the module
        docstring)."""
        value = self._replicated(
            "incrementing", key, lambda pipe: pipe.evalsha(_INCR.sha, 1, key, delta)
        )
        return None if value is None else int(value)

    def _replicated(self, action: str, key: str, command: Callable[[Any], None]) -> Any:
        """Send ``command`` and ``WAIT 1`` in one pipeline on the connection of ``key``'s
        primary; its result. Follows the cluster to the key's new primary (a failover, a
        migrated slot) for up to ``_FAILOVER`` seconds."""
        redis = self._redis
        deadline = time.monotonic() + _FAILOVER
        pause = 0.05
        while True:
            node = self._client.get_node_from_key(key)
            pipe = self._client.get_redis_connection(node).pipeline(transaction=False)
            command(pipe)
            pipe.wait(1, _WAIT_MS)
            try:
                return pipe.execute()[0]
            except redis.exceptions.NoScriptError:
                self._client.script_load(_INCR.source)
                continue
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
                detail = _urls.scrub(str(exc), self._password)
                moving = str(exc).split(" ", 1)[0] in _MOVING
                if isinstance(exc, redis.ResponseError) and not moving:
                    raise BackendError(f"cache {self.url} failed while {action}: {detail}") from exc
                if time.monotonic() > deadline:
                    raise BackendUnavailable(
                        f"cannot reach the cache at {self.url}: {detail}"
                    ) from exc
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
            with contextlib.suppress(redis.RedisError, redis.exceptions.RedisClusterException):
                self._client.nodes_manager.initialize()  # the cluster's map, read again
