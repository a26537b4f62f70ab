"""The memcached cache (pymemcache), by URL (``memcached://host:port[,host:port…]``) or as a
live pymemcache client."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from typing import Any

from shardkit import _urls
from shardkit._fork import reset_in_child
from shardkit.cache.base import read_number
from shardkit.errors import BackendError, BackendUnavailable, ConfigurationError, MissingDriver

# memcached counters are unsigned 64-bit and a decrement stops at 0, so signed values are
# stored shifted by 2**63: every signed 64-bit value maps to one unsigned value, in order.
_BIAS = 2**63
_MAX_TTL = 30 * 24 * 3600  # memcached reads a longer expiry as an absolute time
_REFUSAL = "non-numeric value"
_REWRITES = 5


def _encode_key(key: str) -> str:
    """memcached keys are at most 250 bytes of printable ASCII without spaces."""
    if key.isascii() and key.isprintable() and " " not in key and len(key) <= 200:
        return key
    return "shardkit:sha256:" + hashlib.sha256(key.encode()).hexdigest()


class MemcachedCache:
    """memcached as the shared cache. Every call is one round trip and atomic on the
    server (``add``, ``incr``/``decr``, ``get_multi``). Thread-safe (a pooled client);
    a forked child opens its own sockets (a live client handed in is closed in the child,
    and reconnects on its next use there, the application's own calls included)."""

    shared = True

    def __init__(self, client: Any, *, url: str = "memcached://", servers: list[str] | None = None):
        # Imported once, not on every call: given a pymemcache client, pymemcache is there.
        from pymemcache.exceptions import (
            MemcacheClientError,
            MemcacheError,
            MemcacheUnexpectedCloseError,
        )

        self._failed: type[Exception] = MemcacheError
        self._refused: type[Exception] = MemcacheClientError
        self._closed: type[Exception] = MemcacheUnexpectedCloseError  # the server went away
        self._client = client
        self._servers = servers
        self.url = _urls.redact(url)
        reset_in_child(self, MemcachedCache._after_fork)

    @classmethod
    def from_url(cls, url: str) -> MemcachedCache:
        """A cache on the servers of ``memcached://host:port[,host:port…]`` (no user or
        password: memcached's text protocol has none)."""
        parts = _urls.split(url, "cache", ports=False)  # each server's is checked below
        servers = [s for s in parts.netloc.split(",") if s]
        if not servers or parts.path not in ("", "/") or parts.query or "@" in parts.netloc:
            raise ConfigurationError(
                f"a memcached URL is memcached://host:port[,host:port…], not {_urls.redact(url)!r}"
            )
        for server in servers:
            _urls.split(f"memcached://{server}", "cache")
        return cls(_pooled_client(servers), url=url, servers=servers)

    def _after_fork(self) -> None:
        if self._servers is not None:
            # The parent's sockets are dropped unused; closing them would not hurt the
            # parent (memcached has no session), but nothing may be sent on them.
            self._client = _pooled_client(self._servers)
        else:
            # A live client: closing closes the child's descriptors of the parent's
            # sockets and sends nothing on them; the client opens its own on next use.
            self._client.close()

    def _call(self, action: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except (OSError, self._closed) as exc:
            detail = str(exc) or "the server closed the connection"
            raise BackendUnavailable(f"cannot reach the cache at {self.url}: {detail}") from exc
        except self._failed as exc:
            raise BackendError(f"cache {self.url} failed while {action}: {exc}") from exc

    def get(self, key: str) -> int | None:
        value = self._call("reading", self._client.get, _encode_key(key))
        return None if value is None else read_number(self.url, value) - _BIAS

    def get_many(self, keys: Iterable[str]) -> dict[str, int]:
        encoded = {_encode_key(key): key for key in keys}
        if not encoded:
            return {}
        values = self._call("reading", self._client.get_many, list(encoded))
        return {encoded[k]: read_number(self.url, v) - _BIAS for k, v in values.items()}

    def add(self, key: str, value: int, ttl: float | None) -> bool:
        expire = 0 if ttl is None else min(_MAX_TTL, max(1, math.ceil(ttl)))
        stored = str(value + _BIAS).encode()
        return bool(
            self._call("adding", self._client.add, _encode_key(key), stored, expire, noreply=False)
        )

    def add_many(self, values: Mapping[str, int], ttl: float | None) -> None:
        # memcached has no multi-key add: one round trip per key.
        for key, value in values.items():
            self.add(key, value, ttl)

    def incr(self, key: str, delta: int) -> int | None:
        """``incr``/``decr``. A key the server refuses to increment though it holds a number
        (memcached 1.6.18 now and then does so for a key, and keeps doing so) is rewritten
        instead: its value plus ``delta`` by compare-and-set, keeping its TTL. Atomic
        either way: a rewrite that loses a race reads the key again."""
        value: int | None = self._call("incrementing", self._incr, _encode_key(key), delta)
        return value

    def incr_many(self, deltas: Mapping[str, int]) -> None:
        # memcached has no multi-key increment: one round trip per key.
        for key, delta in deltas.items():
            self.incr(key, delta)

    def _incr(self, encoded: str, delta: int) -> int | None:
        method = self._client.incr if delta >= 0 else self._client.decr
        for _ in range(_REWRITES):
            try:
                value = method(encoded, abs(delta), noreply=False)
                if value is not None and 0 <= int(value) < delta:
                    # Wrapped past 2**64, so past signed 64-bit: undone (adding 2**64 -
                    # delta subtracts delta, whatever raced), and refused, as Redis does.
                    method(encoded, 2**64 - delta, noreply=False)
                    raise BackendError(f"cache {self.url}: an increment would overflow")
                return None if value is None else int(value) - _BIAS
            except self._refused as exc:
                if _REFUSAL not in str(exc):
                    raise
            stored, token = self._client.gets(encoded)
            if stored is None:
                return None
            expire = self._expire_of(encoded, token)
            if expire is None:
                continue  # written since it was read
            value = read_number(self.url, stored) + delta
            if value >= 2**64:
                raise BackendError(f"cache {self.url}: an increment would overflow")
            value = max(value, 0)  # as memcached's own decrement, which stops at 0
            if self._client.cas(encoded, str(value).encode(), token, expire, noreply=False):
                return value - _BIAS
        raise BackendError(f"cache {self.url} kept refusing to increment a key")

    def _expire_of(self, encoded: str, token: bytes) -> int | None:
        """The expiry that keeps the key's remaining TTL, or None if the key no longer
        has CAS ``token`` (memcached's meta get)."""
        client = self._client
        if not hasattr(client, "raw_command"):  # a HashClient: ask the key's server
            client = client._get_client(encoded)
        reply = client.raw_command(f"mg {encoded} t c").split()
        fields = {field[:1]: field[1:] for field in reply[1:]}
        if reply[:1] != [b"HD"] or fields.get(b"c") != token:
            return None
        ttl = int(fields[b"t"])
        return 0 if ttl < 0 else max(1, ttl)

    def bump(self, key: str, delta: int) -> int:
        # memcached's incr never creates a key: on a miss, add it; if another client added
        # it first, increment theirs.
        while (value := self.incr(key, delta)) is None:
            if self.add(key, delta, None):
                return delta
        return value

    def delete(self, key: str) -> None:
        self._call("deleting", self._client.delete, _encode_key(key), noreply=False)

    def close(self) -> None:
        if self._servers is not None:
            self._client.close()


def _pooled_client(servers: list[str]) -> Any:
    try:
        from pymemcache.client.base import PooledClient
        from pymemcache.client.hash import HashClient
    except ImportError as exc:
        raise MissingDriver(
            "the memcached cache needs its driver: pip install 'shardkit[memcached]'"
        ) from exc
    options: dict[str, Any] = {"connect_timeout": 5, "timeout": 5, "no_delay": True}
    if len(servers) == 1:
        return PooledClient(servers[0], **options)
    return HashClient(servers, use_pooling=True, **options)
