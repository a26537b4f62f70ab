"""The durable store interface: where counter shards, their configuration and idempotency
keys live. Every method is atomic; none reads then writes across calls."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from shardkit._program import role
from shardkit.errors import ValidationError


@dataclass(frozen=True)
class CounterInfo:
    """A counter's persisted configuration."""

    name: str
    kind: str
    shards: int
    incarnation: int
    """Which life of the name this is: drawn anew whenever a counter is created (first,
    again after a delete, or by a reset). Its cache keys and a monotonic counter's
    maxima are its own."""


@dataclass(frozen=True)
class Deleted:
    """What ``Store.delete`` removed: the counter's configuration, and the buffered
    generations it had (whose cache keys are left to remove)."""

    info: CounterInfo
    generations: list[int]


RETIRED = 0
"""The generation that accumulates a counter's retired generations (no cache keys)."""

IDS = "ids"
"""The kind of id allocators, whose marks outlive them."""


def check_reset(info: CounterInfo) -> None:
    """Raise ``ValidationError`` if the counter ``info`` describes may not be reset: an id
    allocator never is. Stores call it before they change anything, front ends before
    they ask."""
    if info.kind == IDS:
        raise ValidationError(
            f"{info.name!r} is an id allocator: a reset would hand its ids out again "
            "(delete it: one made again under the name goes on above them)"
        )


@dataclass(frozen=True)
class Flushed:
    """How much of one cache generation of a buffered counter the store has applied: the
    generation's cumulative increments (``up``) and decrements (``down``), both ≥ 0."""

    up: int = 0
    down: int = 0

    @property
    def net(self) -> int:
        return self.up - self.down


@role("store")
@runtime_checkable
class Store(Protocol):
    """Durable storage of counters.

    Implementations are thread-safe, and safe to keep across ``os.fork()``: a child never
    uses a connection opened by its parent.
    """

    url: str
    """The store's URL with any password redacted."""

    def create_schema(self) -> None:
        """Create the store's tables if missing. Idempotent, safe to race."""

    def has_schema(self) -> bool:
        """Whether every table of the store exists; looks, creates nothing."""

    def identity(self) -> str:
        """This store's name for itself: made once, at random, and persisted in it, so it
        is the same in every process and after restarts, and differs from every other
        store's (another database, or another table prefix in the same one). Kits put
        their cache keys under it, so stores sharing a cache never meet there."""

    def open_counter(self, name: str, kind: str, shards: int, *, grow: bool = True) -> CounterInfo:
        """Create counter ``name`` with ``shards`` shards, or, with ``grow``, raise an
        existing counter's shard count to ``shards``; never lower it.

        Atomic. Raises ``CounterKindMismatch`` if ``name`` is a counter of another kind.
        """

    def delete(self, name: str, *, reset: bool = False) -> Deleted | None:
        """Delete counter ``name`` and everything the store holds of it (shard rows,
        idempotency keys, flushed generations, maxima), in one transaction; with
        ``reset``, create it again, of the same kind and shards, as a new incarnation in
        that transaction. None if there is no such counter. An id allocator's mark is
        kept (``reserve``), and an allocator is never reset (``ValidationError``)."""

    def counter(self, name: str) -> CounterInfo | None:
        """The configuration of counter ``name``, or None if it does not exist."""

    def counters(self) -> list[CounterInfo]:
        """Every counter, ordered by name."""

    combinable: bool
    """Whether writes from different threads may be combined into one statement (False
    when each write belongs to its caller's own transaction)."""

    row_locks: bool
    """Whether writes to different rows of a table proceed side by side (each row its
    own lock), so that more shards take more concurrent writers: False where one lock
    serialises every write (SQLite)."""

    def add(self, name: str, shard: int, delta: int, key: str | None = None) -> bool:
        """Add ``delta`` to one shard row, creating the row if needed, in one atomic step.

        With ``key``, the key is recorded in the same transaction: a key already recorded
        for ``name`` makes the call a no-op that returns False. Returns True when applied.
        """

    def add_many(
        self, name: str, shard: int, writes: Sequence[tuple[int, str | None]]
    ) -> list[bool]:
        """``add`` of many ``(delta, key)`` writes to one shard row, atomically: all of
        them or none. Without keys, one statement adding their sum; with keys, one
        transaction in which a key recorded before, or earlier in ``writes``, leaves its
        write out (False). ``InvalidDelta``, writing nothing, if a sum of applied deltas
        could leave signed 64-bit."""

    def total(self, name: str) -> int:
        """Exact value of ``name`` in the store: the sum of its shard rows and the net of its
        flushed generations, or an id allocator's mark (0 if it has none of them)."""

    def totals(self, names: Iterable[str]) -> dict[str, int]:
        """``total`` of many counters in one query; an unknown name maps to 0."""

    def add_generation(self, name: str, generation: int) -> None:
        """Record cache generation ``generation`` of buffered counter ``name``, with nothing
        applied yet. Idempotent: recording it again changes nothing."""

    def generations(self, names: Iterable[str]) -> dict[str, dict[int, Flushed]]:
        """What is applied of every recorded generation of the named counters, in one query
        (a name without generations is absent from the result)."""

    def recorded_at(self, name: str, generations: Iterable[int]) -> dict[int, float]:
        """When each of ``generations`` of buffered counter ``name`` was recorded (epoch
        seconds), in one query; a generation not recorded is absent from the result."""

    def advance(self, name: str, generation: int, seen: Flushed, to: Flushed) -> bool:
        """Compare-and-set one generation's applied sums: from ``seen`` to ``to``, only if
        they still are ``seen``. One atomic statement; returns whether it set them."""

    def retire(self, name: str, generation: int, applied: Flushed) -> bool:
        """Fold a generation nobody will flush again into generation ``RETIRED``: delete its
        record, if it still is ``applied``, and add its sums to ``RETIRED``'s, in one
        transaction (the value is unchanged). Returns whether it did."""

    def raise_max(self, counter: CounterInfo, shard: int, value: int) -> None:
        """Set shard ``shard`` of (this incarnation of) monotonic counter ``counter`` to
        ``value`` if that is higher than what it holds (creating the row if needed), in
        one atomic statement."""

    def maxima(self, names: Iterable[str]) -> dict[str, int]:
        """The highest value persisted over each counter's shards by its current
        incarnation, in one query (0 for a counter without any)."""

    def reserve(self, name: str, count: int) -> int:
        """Raise the high-water mark of id allocator ``name`` by ``count`` and return the
        new mark (the block ``mark - count + 1 … mark`` is the caller's). Atomic and
        durable before it returns; marks only grow, and outlive the allocator: one made
        again under the name goes on from its forerunner's mark."""

    def purge_keys(self, older_than: float) -> int:
        """Delete idempotency keys recorded before the epoch time ``older_than``; return how
        many were deleted. A purged key no longer protects against a repeated write."""

    def close(self) -> None:
        """Release the store's connections (those it opened; a live engine is left alone)."""
