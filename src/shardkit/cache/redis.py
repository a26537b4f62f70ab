"""The Redis cache (redis-py), by URL or as a live ``redis.Redis`` client."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from shardkit import _urls
from shardkit._fork import reset_in_child
from shardkit._program import Blocking, Call, Program, Roles, call, role, rule
from shardkit._redis import ADDS, INCR, INCR_MANY, INCR_ONCE, Script, redis_module
from shardkit._sync.sent_once import SentOnce
from shardkit.cache.base import read_number
from shardkit.errors import BackendError, BackendUnavailable, ConfigurationError


@role("client")
class Client(Protocol):
    """The role of the redis-py client (``redis.Redis`` or ``redis.asyncio.Redis``) in
    the cache's programs: the commands they send."""

    def get(self, name: str) -> Any: ...
    def mget(self, keys: list[str]) -> Any: ...
    def set(self, name: str, value: int, *, nx: bool, px: int | None) -> Any: ...
    def incrby(self, name: str, amount: int) -> Any: ...
    def delete(self, name: str) -> Any: ...
    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any: ...
    def script_load(self, script: str) -> Any: ...


@dataclass(frozen=True, slots=True)
class RedisRoles(Roles):
    """What a Redis cache's programs run on."""

    client: Client


class Held:
    """``Lending`` of a sync client's connections: a connection taken from the pool
    stays with the sender, which sends its next increments on it. Skipping the client's
    per-command machinery (retries, observability hooks, a checkout from the pool)
    about halves the client's CPU a command, on the hot path of a buffered counter.

    A held connection that has data waiting or was closed by the server (a restart) is
    reconnected before it is used, as the pool does for its own. Thread-safe: each
    connection serves one command at a time. A forked child holds none of its parent's.
    """

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._reset()
        reset_in_child(self, Held._reset)

    def _reset(self) -> None:
        self._held: collections.deque[Any] = collections.deque()

    def take(self) -> Any:
        try:
            conn = self._held.pop()
        except IndexError:
            return self._pool.get_connection()  # connected, and checked by the pool
        try:
            if conn.can_read():  # a reply nobody read, or closed by the server
                conn.disconnect()  # the next send connects again
        except Exception:
            conn.disconnect()
        return conn

    def give(self, conn: Any, sound: bool) -> None:
        if not sound:
            conn.disconnect()
        self._held.append(conn)

    def close(self) -> None:
        while self._held:
            self._pool.release(self._held.pop())


class RedisCore:
    """What the sync and async Redis caches share: ``Cache``'s methods, as programs run
    on ``RedisRoles``, as each form sets them."""

    shared = True
    roles: RedisRoles

    def __init__(self, client: Any, *, url: str | None = None, owns_client: bool = False):
        self._client = client
        self._owns_client = owns_client
        self._redis = redis_module()
        if url:
            self.url, self._password = _urls.redact(url), urlsplit(url).password
        else:
            self.url, self._password = self._describe(client)

    @staticmethod
    def _describe(client: Any) -> tuple[str, str | None]:
        """A live client's URL (without its password) and its password."""
        kwargs = client.connection_pool.connection_kwargs
        where = f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
        return f"redis://{where}/{kwargs.get('db', 0)}", kwargs.get("password")

    def _command(self, action: str, step: Iterable[Call[Any]]) -> Program[Any]:
        """Carry out ``step``, its Redis errors turned into ``BackendError``s."""
        try:
            return (yield from step)
        except self._failures as exc:
            raise self._failure(action, exc) from exc

    @property
    def _failures(self) -> tuple[type[Exception], ...]:
        """What the client raises when a command fails (``_failure``'s to turn)."""
        return (self._redis.RedisError, self._redis.exceptions.RedisClusterException)

    def _failure(self, action: str, exc: Exception) -> BackendError:
        """The client's error ``exc`` (one of ``_failures``) while ``action``, as ours:
        ``BackendUnavailable`` where the cache could not be reached, else ``BackendError``."""
        detail = _urls.scrub(str(exc), self._password)
        unreachable = (
            self._redis.ConnectionError,
            self._redis.TimeoutError,  # no reply in time: a server gone silent
            self._redis.exceptions.RedisClusterException,  # a cluster of which no node answers
            self._redis.exceptions.ClusterDownError,  # a node cut off from most primaries
        )
        if isinstance(exc, unreachable):
            return BackendUnavailable(f"cannot reach the cache at {self.url}: {detail}")
        return BackendError(f"cache {self.url} failed while {action}: {detail}")

    def _script(self, script: Script, keys: list[str], args: list[int]) -> Program[Any]:
        words = [*keys, *args]
        try:
            return (yield from call(Client.evalsha, script.sha, len(keys), *words))
        except self._redis.exceptions.NoScriptError:  # a new (or flushed) server
            yield from call(Client.script_load, script.source)
            return (yield from call(Client.evalsha, script.sha, len(keys), *words))

    @rule
    def get(self, key: str) -> Program[int | None]:
        value = yield from self._command("reading", call(Client.get, key))
        return None if value is None else read_number(self.url, value)

    @rule
    def get_many(self, keys: Iterable[str]) -> Program[dict[str, int]]:
        wanted = list(keys)
        if not wanted:
            return {}
        values = yield from self._command("reading", call(Client.mget, wanted))
        return {
            key: read_number(self.url, value)
            for key, value in zip(wanted, values, strict=True)
            if value is not None
        }

    @rule
    def add(self, key: str, value: int, ttl: float | None) -> Program[bool]:
        millis = _millis(ttl) or None
        added = yield from self._command("adding", call(Client.set, key, value, nx=True, px=millis))
        return bool(added)

    @rule
    def add_many(self, values: Mapping[str, int], ttl: float | None) -> Program[None]:
        if values:
            script = self._script(ADDS, list(values), [_millis(ttl), *values.values()])
            yield from self._command("adding", script)

    @rule
    def incr(self, key: str, delta: int) -> Program[int | None]:
        value = yield from self._command("incrementing", self._script(INCR, [key], [delta]))
        return None if value is None else int(value)

    @rule
    def incr_many(self, deltas: Mapping[str, int]) -> Program[None]:
        if deltas:
            script = self._script(INCR_MANY, list(deltas), list(deltas.values()))
            yield from self._command("incrementing", script)

    @rule
    def bump(self, key: str, delta: int) -> Program[int]:
        return int((yield from self._command("incrementing", call(Client.incrby, key, delta))))

    @rule
    def incr_once(
        self, sums: Sequence[str], writes: Sequence[tuple[str, int, int]], ttl: float
    ) -> Program[tuple[list[int], list[bool]] | None]:
        """One script (``Recording.incr_once``), sent once."""
        script = self._script(INCR_ONCE, *once_words(sums, writes, ttl))
        reply = yield from self._command("incrementing", script)
        return once_reply(self.url, reply, len(sums))

    @rule
    def delete(self, key: str) -> Program[None]:
        yield from self._command("deleting", call(Client.delete, key))


class RedisCache(RedisCore, Blocking):
    """Redis as the shared cache. Every call is one round trip; ``incr`` is a Lua script.
    Increments are sent once, never retried (``SentOnce``, on ``Held`` connections).

    Thread-safe and fork-safe (redis-py's connection pool reconnects in a child).
    """

    def __init__(self, client: Any, *, url: str | None = None, owns_client: bool = False):
        super().__init__(client, url=url, owns_client=owns_client)
        self._sent_once = SentOnce(client, Held(client.connection_pool))
        self.roles = RedisRoles(self._sent_once)

    @classmethod
    def from_url(cls, url: str) -> RedisCache:
        return cls(_client(redis_module().Redis, url), url=url, owns_client=True)

    def bump(self, key: str, delta: int) -> int:
        """``RedisCore.bump``, its one command sent with no program run around it (the
        buffered counters' hot path)."""
        try:
            return int(self._sent_once.incrby(key, delta))
        except self._failures as exc:
            raise self._failure("incrementing", exc) from exc

    def close(self) -> None:
        self._sent_once.close()
        if self._owns_client:
            self._client.close()


# Seconds a connection may take to be made, and a reply to come, before the call fails
# (a server gone silent: its host cut off), on a Redis server or cluster alike.
TIMEOUT = 5


def _millis(ttl: float | None) -> int:
    """A TTL in whole milliseconds, at least 1; 0 for none."""
    return 0 if ttl is None else max(1, math.ceil(ttl * 1000))


def once_words(
    sums: Sequence[str], writes: Sequence[tuple[str, int, int]], ttl: float
) -> tuple[list[str], list[int]]:
    """The keys and arguments of the script ``INCR_ONCE`` for ``Recording.incr_once``."""
    args = [len(sums), _millis(ttl)]
    for _, index, delta in writes:
        args += [index + 1, delta]  # Lua counts from 1
    return [*sums, *(record for record, _, _ in writes)], args


def once_reply(url: str, reply: Any, count: int) -> tuple[list[int], list[bool]] | None:
    """What ``Recording.incr_once`` returns, from the reply of the script ``INCR_ONCE``
    over ``count`` sums."""
    if reply is None:
        return None
    return [read_number(url, value) for value in reply[:count]], [bool(f) for f in reply[count:]]


def _client(kind: Any, url: str, **options: Any) -> Any:
    """A client (or pool) of class ``kind`` (sync or asyncio) for a cache URL, its calls
    failing after ``TIMEOUT`` unless the URL's query sets ``socket_connect_timeout`` or
    ``socket_timeout`` (redis-py's: the query wins)."""
    _urls.split(url, "cache")
    try:
        return kind.from_url(url, socket_connect_timeout=TIMEOUT, socket_timeout=TIMEOUT, **options)
    except (ValueError, TypeError) as exc:
        detail = _urls.scrub(str(exc), urlsplit(url).password)
        raise ConfigurationError(f"bad cache URL {_urls.redact(url)!r}: {detail}") from None
