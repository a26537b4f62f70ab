"""The Redis cache (redis-py), by URL or as a live ``redis.Redis`` client."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from shardkit import _urls
from shardkit.cache.base import read_number
from shardkit.errors import BackendError, BackendUnavailable, ConfigurationError, MissingDriver

# INCRBY creates a missing key; a counter's cached value must not be created by a write
# (it would hold the delta alone), so the increment is conditional, in one atomic script.
# The new value is returned as GET's string: Lua numbers are doubles, exact only to 2**53.
_INCR_IF_EXISTS = """
if redis.call('exists', KEYS[1]) == 1 then
  redis.call('incrby', KEYS[1], ARGV[1])
  return redis.call('get', KEYS[1])
end
return false
"""
# The same for many keys, their deltas in ARGV; nothing returned.
_INCR_MANY_IF_EXIST = """
for i, key in ipairs(KEYS) do
  if redis.call('exists', key) == 1 then
    redis.call('incrby', key, ARGV[i])
  end
end
"""


def _redis_module() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise MissingDriver(
            "the Redis cache needs its driver: pip install 'shardkit[redis]'"
        ) from exc
    return redis


class RedisCache:
    """Redis as the shared cache. Every call is one round trip; ``incr`` is a Lua script.

    Thread-safe and fork-safe (redis-py's connection pool reconnects in a child).
    """

    shared = True

    def __init__(self, client: Any, *, url: str | None = None, owns_client: bool = False):
        self._client = client
        self._owns_client = owns_client
        self._redis = _redis_module()
        kwargs = client.connection_pool.connection_kwargs
        self.url = (
            _urls.redact(url)
            if url
            else (
                f"redis://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
                f"/{kwargs.get('db', 0)}"
            )
        )
        self._password = urlsplit(url).password if url else kwargs.get("password")
        self._incr = client.register_script(_INCR_IF_EXISTS)
        self._incr_many = client.register_script(_INCR_MANY_IF_EXIST)

    @classmethod
    def from_url(cls, url: str) -> RedisCache:
        _urls.split(url, "cache")
        redis = _redis_module()
        try:
            client = redis.Redis.from_url(url, socket_connect_timeout=5)
        except (ValueError, TypeError) as exc:
            detail = _urls.scrub(str(exc), urlsplit(url).password)
            raise ConfigurationError(f"bad cache URL {_urls.redact(url)!r}: {detail}") from None
        return cls(client, url=url, owns_client=True)

    def _call(self, action: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except self._redis.ConnectionError as exc:
            detail = _urls.scrub(str(exc), self._password)
            raise BackendUnavailable(f"cannot reach the cache at {self.url}: {detail}") from exc
        except self._redis.RedisError as exc:
            detail = _urls.scrub(str(exc), self._password)
            raise BackendError(f"cache {self.url} failed while {action}: {detail}") from exc

    def get(self, key: str) -> int | None:
        value = self._call("reading", self._client.get, key)
        return None if value is None else read_number(self.url, value)

    def get_many(self, keys: Iterable[str]) -> dict[str, int]:
        wanted = list(keys)
        if not wanted:
            return {}
        values = self._call("reading", self._client.mget, wanted)
        return {
            key: read_number(self.url, value)
            for key, value in zip(wanted, values, strict=True)
            if value is not None
        }

    def add(self, key: str, value: int, ttl: float | None) -> bool:
        millis = None if ttl is None else max(1, math.ceil(ttl * 1000))
        return bool(self._call("adding", self._client.set, key, value, nx=True, px=millis))

    def incr(self, key: str, delta: int) -> int | None:
        value = self._call("incrementing", self._incr, keys=[key], args=[delta])
        return None if value is None else int(value)

    def incr_many(self, deltas: Mapping[str, int]) -> None:
        if deltas:
            self._call(
                "incrementing", self._incr_many, keys=list(deltas), args=list(deltas.values())
            )

    def bump(self, key: str, delta: int) -> int:
        return int(self._call("incrementing", self._client.incrby, key, delta))

    def delete(self, key: str) -> None:
        self._call("deleting", self._client.delete, key)

    def close(self) -> None:
        if self._owns_client:
            self._client.close()
