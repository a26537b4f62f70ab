"""Redis Cluster as the shared cache (redis-py's ``RedisCluster``, sync or asyncio), by
URL (``redis+cluster://host:port[,host:port…]``) or as a live client.

A key lives on the primary that owns its hash slot. Keys that one command reads or
changes together must share a slot: every key of one counter carries the counter's name
as a hash tag (``Options.cache_key``), a buffered counter's generation its own tag, so
that its stripes can be placed on different primaries (``owner``), but for its keyed
generation, whose sums share the counter's slot with the records of the keys. Reads of many keys
are one ``MGET`` per slot (redis-py's ``mget_nonatomic``), ``incr_many`` one script per
slot. MOVED and ASK redirections and a failover's new topology are followed by the
client.

A primary acknowledges a write before its replicas have it, so a failover can bring a
key back to an older value. For ``incr`` — what ids and monotonic values are handed out
from — that would hand a value out twice: ``incr`` therefore returns only once a replica
has the increment too (``WAIT``, in one pipeline with it on the primary's connection).
If no replica acknowledges within ``WAIT_MS`` and the primary's ``ROLE`` lists one (it
lags, or its primary is cut off from it) the value is not handed out: the increment is
made again, the value skipped, until one does or ``_FAILOVER`` has passed. A primary
whose ``ROLE`` lists no replica (its replica was promoted, or is down) is written to
without waiting, its ``ROLE`` asked in the same pipeline, until it lists one again:
with no replica, no failover can bring an older value back (both in
``shardkit.aio.pipes``, where ``Replicas`` is played).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Protocol
from urllib.parse import unquote

from shardkit import _urls
from shardkit._program import Blocking, Clock, Program, call, role, rule
from shardkit._redis import ADDS, INCR, INCR_MANY, INCR_ONCE, Unreplicated, redis_module
from shardkit._sync.pipes import NodePipes
from shardkit.cache.redis import (
    TIMEOUT,
    Client,
    Held,
    RedisCore,
    RedisRoles,
    _millis,
    once_reply,
    once_words,
)
from shardkit.errors import BackendError, BackendUnavailable, ConfigurationError

# How long an increment is retried while the cluster fails over (a replica is promoted
# once the others have missed its primary for cluster-node-timeout, and voted).
_FAILOVER = 15.0


class Startup(NamedTuple):
    """What a ``redis+cluster://`` URL gives: nodes to start from, and credentials."""

    nodes: list[tuple[str, int]]
    username: str | None
    password: str | None
    ssl: bool

    def client_options(self, node: Any, retry: Any) -> dict[str, Any]:
        """The keyword arguments of a ``RedisCluster`` (redis-py's, or its asyncio one,
        whose ``ClusterNode`` and ``Retry`` classes are ``node`` and ``retry``) that
        starts from these nodes and tries a command twice at most: one whose connection
        fails, or whose reply has not come in ``TIMEOUT``, is tried once more on the
        cluster's map read again (a failover the client has not seen yet), then raises
        (as does a CLUSTERDOWN answer twice). redis-py's cluster client would try it
        eleven times by default, each try waiting its ``TIMEOUT``: a call to a node cut
        off would wait out a partition of up to a minute where it should fail. MOVED,
        ASK and TRYAGAIN answers (nothing applied) are followed."""
        from redis.backoff import NoBackoff

        return {
            "startup_nodes": [node(host, port) for host, port in self.nodes],
            "username": self.username,
            "password": self.password,
            "ssl": self.ssl,
            "socket_connect_timeout": TIMEOUT,
            "socket_timeout": TIMEOUT,
            "retry": retry(NoBackoff(), 1),
        }


def parse(url: str) -> Startup:
    """``redis+cluster://[user:password@]host:port[,host:port…][/0]`` (``rediss+cluster``:
    TLS); a ``ConfigurationError`` naming the URL without its password otherwise."""
    parts = _urls.split(url, "cache", ports=False)
    hosts = [node for node in parts.netloc.rpartition("@")[2].split(",") if node]
    if not hosts or parts.path not in ("", "/", "/0") or parts.query:
        raise ConfigurationError(
            "a Redis Cluster URL is redis+cluster://[user:password@]host:port[,host:port…]"
            f", not {_urls.redact(url)!r}"
        )
    nodes = []
    for host in hosts:
        where = _urls.split(f"redis://{host}", "cache")
        nodes.append((where.hostname or "localhost", where.port or 6379))
    ssl = parts.scheme.lower().startswith("rediss")
    username, password = (unquote(v) if v else v for v in (parts.username, parts.password))
    return Startup(nodes, username, password, ssl)


@role("replicas")
class Replicas(Protocol):
    """The role that increments a key on its primary and waits there for a replica (one
    pipeline on that primary's connection), and reads the cluster's map again."""

    def incr(self, key: str, delta: int) -> Any: ...
    def refresh(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class ClusterRoles(RedisRoles):
    """What a Redis Cluster cache's programs run on."""

    replicas: Replicas
    clock: Clock


class _Commands:
    """The role ``Client`` played by a ``RedisCluster``: its commands, with ``MGET`` of
    keys in many slots sent as one ``MGET`` per slot (each value is read atomically, the
    set of them is not), and the commands that add sent once to the primary of their
    (first) key by ``sender`` — the cluster client would send one whose connection
    failed again, to the same node or, having read the map again, to another."""

    def __init__(self, client: Any, sender: Callable[[str], Any]) -> None:
        self._client = client
        self._sender = sender

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def mget(self, keys: list[str]) -> Any:
        return self._client.mget_nonatomic(keys)

    def incrby(self, name: str, amount: int) -> Any:
        return self._sender(name).incrby(name, amount)

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        return self._sender(keys_and_args[0]).evalsha(sha, numkeys, *keys_and_args)


class ClusterCore(RedisCore):
    """What the sync and async cluster caches share: ``RedisCore``'s programs, with the
    increments that differ on a cluster, and where keys live (``Placed``)."""

    roles: ClusterRoles
    # Each form's: what sends a key's increments to its primary, on which clients of the
    # nodes; what sends the other commands; and what waits.
    _pipes_of: Callable[[Any, Any], Any]
    _nodes_of: Callable[[Any], Any]
    _commands_of: Callable[[Any, Callable[[str], Any]], Any]
    _clock: Clock

    def __init__(self, client: Any, *, url: str | None = None, owns_client: bool = False):
        super().__init__(client, url=url, owns_client=owns_client)
        self._pipes = self._pipes_of(client, self._nodes_of(client))
        commands = self._commands_of(client, self._pipes.sender)
        self.roles = ClusterRoles(commands, self._pipes, self._clock)

    @staticmethod
    def _describe(client: Any) -> tuple[str, str | None]:
        nodes = ",".join(sorted(node.name for node in client.get_nodes()))
        default = client.get_default_node()
        if default is None:  # an asyncio client not connected yet
            return f"redis+cluster://{nodes}", None
        kwargs = getattr(default, "connection_kwargs", None)  # an asyncio client's node
        if kwargs is None:
            kwargs = default.redis_connection.connection_pool.connection_kwargs
        return f"redis+cluster://{nodes}", kwargs.get("password")

    def owner(self, key: str) -> str:
        """The primary that holds ``key`` now (from the client's map of the cluster)."""
        try:
            return str(self._client.get_node_from_key(key).name)
        except self._redis.exceptions.RedisClusterException as exc:  # a slot nobody serves
            raise BackendUnavailable(f"cannot place a key in the cache at {self.url}") from exc

    def owners(self) -> list[str]:
        """The cluster's primaries, in a stable order."""
        return sorted(node.name for node in self._client.get_primaries())

    def _by_slot(self, values: Mapping[str, int]) -> list[dict[str, int]]:
        """``values`` in groups of keys that share a slot (as one script's must)."""
        groups: dict[int, dict[str, int]] = {}
        for key, value in values.items():
            groups.setdefault(self._client.keyslot(key), {})[key] = value
        return list(groups.values())

    @rule
    def incr_many(self, deltas: Mapping[str, int]) -> Program[None]:
        """One script per slot, each sent once (see ``_followed``)."""
        for group in self._by_slot(deltas):
            keys, args = list(group), list(group.values())
            yield from self._followed(partial(self._script, INCR_MANY, keys, args), once=True)

    @rule
    def add_many(self, values: Mapping[str, int], ttl: float | None) -> Program[None]:
        """One script per slot, followed to its primary (sent again, it sets nothing
        twice)."""
        for group in self._by_slot(values):
            args = [_millis(ttl), *group.values()]
            yield from self._followed(partial(self._script, ADDS, list(group), args), once=False)

    @rule
    def bump(self, key: str, delta: int) -> Program[int]:
        """``RedisCore._bump``, sent once (see ``_followed``)."""
        return int((yield from self._followed(lambda: call(Client.incrby, key, delta), once=True)))

    @rule
    def incr_once(
        self, sums: Sequence[str], writes: Sequence[tuple[str, int, int]], ttl: float
    ) -> Program[tuple[list[int], list[bool]] | None]:
        """``RedisCore.incr_once``, sent once to the primary of the keys' slot (see
        ``_followed``)."""
        script = partial(self._script, INCR_ONCE, *once_words(sums, writes, ttl))
        reply = yield from self._followed(script, once=True)
        return once_reply(self.url, reply, len(sums))

    @rule
    def incr(self, key: str, delta: int) -> Program[int | None]:
        """``RedisCore._incr``, returning once a replica has the increment (or its
        primary has none); made again where the connection failed or no replica
        acknowledged (see ``_followed``): what ``incr`` hands out may skip a value,
        never repeat one."""

        def increment() -> Program[Any]:
            try:
                return (yield from call(Replicas.incr, key, delta))
            except self._redis.exceptions.NoScriptError:  # a new primary: load it there
                yield from call(Client.script_load, INCR.source)
                return (yield from call(Replicas.incr, key, delta))

        value = yield from self._followed(increment, once=False)
        return None if value is None else int(value)

    def _followed(self, step: Callable[[], Iterable[Any]], *, once: bool) -> Program[Any]:
        """Carry ``step`` out, followed to its key's new primary (a failover, a migrated
        slot) for up to ``_FAILOVER`` seconds while the cluster answers that it is not
        there (nothing was applied) or no node of it answers. A connection that fails
        leaves the step in doubt (it may have been applied first): with ``once`` it
        raises then (sent again, an increment could count twice), the cluster's map read
        again for the next call."""
        redis = self._redis
        errors = redis.exceptions
        refused = (
            errors.AskError,  # MovedError too
            errors.TryAgainError,
            errors.ClusterDownError,
            errors.RedisClusterException,  # a slot nobody serves: nothing sent
            Unreplicated,  # applied, but not to be handed out: made again, skipped
        )
        failed = (redis.ConnectionError, redis.TimeoutError)
        deadline = time.monotonic() + _FAILOVER
        pause = 0.05
        while True:
            try:
                return (yield from step())
            except (*refused, *failed) as exc:
                in_doubt = once and isinstance(exc, failed)
                if in_doubt or time.monotonic() > deadline:
                    if in_doubt:
                        yield from call(Replicas.refresh)
                    detail = _urls.scrub(str(exc), self._password)
                    unreachable = f"cannot reach the cache at {self.url}: {detail}"
                    raise BackendUnavailable(unreachable) from exc
            except redis.RedisError as exc:
                detail = _urls.scrub(str(exc), self._password)
                failed_while = f"cache {self.url} failed while incrementing: {detail}"
                raise BackendError(failed_while) from exc
            yield from call(Clock.sleep, pause)
            pause = min(pause * 2, 1.0)
            yield from call(Replicas.refresh)


class Nodes:
    """``NodeClients`` of a sync ``RedisCluster``: each node's own client, from redis-py, its
    connections ``Held`` by the senders."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def ready(self) -> None:
        return None  # the client read the map when it was made

    def client(self, node: Any) -> Any:
        return self._client.get_redis_connection(node)

    def lending(self, client: Any) -> Held:
        return Held(client.connection_pool)

    def close(self) -> None:
        return None  # the cluster client's own


class RedisClusterCache(ClusterCore, Blocking):
    """Redis Cluster as the shared cache: ``RedisCache``'s contract on every primary of a
    cluster, plus ``owner``/``owners`` (where a key lives), which a buffered counter's
    stripes are placed by. Thread-safe and fork-safe (each node's pool reconnects in a
    child)."""

    @classmethod
    def from_url(cls, url: str) -> RedisClusterCache:
        """A cache on the cluster that any of the URL's nodes belongs to (database 0)."""
        redis = redis_module()
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        startup = parse(url)
        try:
            client = RedisCluster(**startup.client_options(ClusterNode, Retry))
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            detail = _urls.scrub(str(exc), startup.password)
            raise BackendUnavailable(
                f"cannot reach the cache at {_urls.redact(url)}: {detail}"
            ) from exc
        return cls(client, url=url, owns_client=True)

    _pipes_of, _nodes_of, _commands_of, _clock = NodePipes, Nodes, _Commands, time

    def close(self) -> None:
        self._pipes.close()
        if self._owns_client:
            self._client.close()
