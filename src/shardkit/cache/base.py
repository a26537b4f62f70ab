"""The shared cache interface: integer values under string keys, each call atomic.

Counters use it for cached reads (add-if-absent with a TTL on a miss, adjusted on write)
and for handing writers distinct shards. A cache may lose any key at any time (eviction,
restart); counters stay correct when it does, only slower or staler within their TTL.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from shardkit._program import role
from shardkit.errors import BackendError


@role("cache")
@runtime_checkable
class Cache(Protocol):
    """A shared cache of integers. Thread-safe; a child of ``os.fork()`` opens its own
    connections. Values fit in signed 64-bit."""

    url: str
    """The cache's URL with any password redacted."""

    shared: bool
    """Whether other processes see this cache's keys (False for the in-process cache)."""

    def get(self, key: str) -> int | None:
        """The value under ``key``, or None if absent."""

    def get_many(self, keys: Iterable[str]) -> dict[str, int]:
        """Values of the present keys among ``keys``, in one round trip."""

    def add(self, key: str, value: int, ttl: float | None) -> bool:
        """Set ``key`` to ``value`` for ``ttl`` seconds (None: until evicted) only if
        absent. Atomic: of concurrent adds exactly one wins. Returns whether this call
        set it."""

    def add_many(self, values: Mapping[str, int], ttl: float | None) -> None:
        """``add`` of many keys, each set only if absent, in one round trip where the
        cache can (Redis: one per slot of a cluster). A failure may leave some set."""

    def incr(self, key: str, delta: int) -> int | None:
        """Add ``delta`` (may be negative) to ``key`` if present and return the new value;
        an absent key is left absent and None returned. Atomic; keeps the key's TTL."""

    def incr_many(self, deltas: Mapping[str, int]) -> None:
        """``incr`` of many keys, in one round trip where the cache can (Redis); each key
        atomically. A failure may leave some of them incremented."""

    def bump(self, key: str, delta: int) -> int:
        """Add ``delta`` to ``key``, creating it at 0 (with no TTL) first if absent; return
        the new value. Atomic; one round trip when the key exists (Redis ``INCRBY``). For
        callers that can tell a key created by the call from its value."""

    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    def close(self) -> None:
        """Release connections this cache opened (a live client is left alone)."""


@role("recording")
@runtime_checkable
class Recording(Protocol):
    """A cache that can record idempotency keys, each in one atomic step with the
    increment it guards (Redis, Redis Cluster, the in-process cache; not memcached,
    which has no atomic command over several keys)."""

    def incr_once(
        self, sums: Sequence[str], writes: Sequence[tuple[str, int, int]], ttl: float
    ) -> tuple[list[int], list[bool]] | None:
        """Apply ``writes``, each ``(record, index, delta)``: add ``delta`` to
        ``sums[index]`` and set the key ``record`` for ``ttl`` seconds, unless ``record``
        is present (set before, or by an earlier write of ``writes``: that write is left
        out). One atomic step, taken only if every key of ``sums`` is present: None
        otherwise, and nothing changed. Returns the values of ``sums`` after it, and
        whether each write applied. Every key must live on one server (on a cluster, in
        one hash slot)."""


@runtime_checkable
class Placed(Protocol):
    """A cache whose keys live on several servers, each on the one that owns the key's
    hash slot (Redis Cluster). Keys that one command reads or changes together must
    share a slot: a key's hash tag (its text between the first ``{`` and the next ``}``)
    decides it, and ``Options.cache_key`` writes one. Both methods answer from the
    client's map of the servers, without I/O."""

    def owner(self, key: str) -> str:
        """The server that holds ``key`` now."""

    def owners(self) -> list[str]:
        """Every server that holds keys, in a stable order."""


def read_number(url: str, stored: bytes | str) -> int:
    """A value read from the cache at ``url`` as an int. Anything else under a shardkit key
    (another program's value) is a ``BackendError``."""
    try:
        return int(stored)
    except ValueError:
        raise BackendError(f"cache {url} holds something other than a number") from None
