"""Values that pass a first look and would break a later step: refused up front, or made
harmless by the design (see issue 14, point 1)."""

from __future__ import annotations

import math
from typing import Any

import pytest

import shardkit
from backends import NEVER, PREFIX
from shardkit import _urls
from shardkit.counters.buffered import _FULL, MAX_DELTA, BufferedCounter
from shardkit.counters.generations import BASE
from shardkit.errors import ConfigurationError, CounterOverflow, FlushFailed, InvalidDelta
from shardkit.store.base import Flushed


@pytest.mark.parametrize("delta", [MAX_DELTA + 1, -MAX_DELTA - 1, 2**62, 2**63 - 1])
@pytest.mark.pairs
def test_a_buffered_delta_past_its_limit_is_refused_and_counts_nothing(
    kit: shardkit.Kit, name: str, delta: int
) -> None:
    counter = kit.buffered(name, interval=NEVER)
    counter.incr(5)
    with pytest.raises(InvalidDelta):
        counter.incr(delta)
    counter.incr(MAX_DELTA)
    counter.decr(MAX_DELTA)
    assert counter.value() == 5
    assert counter.flush() == 5
    assert counter.parts() == (5, 0)


def _writing(counter: BufferedCounter) -> tuple[int, tuple[str, str]]:
    writing, _ = counter._writing  # one stripe, and the keyed lane
    assert writing is not None
    return writing


@pytest.mark.pairs
def test_a_full_generation_hands_over_to_a_new_one(big: shardkit.Kit, name: str) -> None:
    """Once a sum passes 2**61, the next increments go to another generation: no sum can
    reach what the cache (memcached wraps at it) or the store holds, and nothing is lost."""
    counter = big.buffered(name, interval=NEVER, stripes=1)
    counter.incr(1)
    first, (up, _) = _writing(counter)
    big.cache.bump(up, _FULL - 1)  # as if 2**61 - 1 more had been counted
    counter.incr(MAX_DELTA)  # past 2**61: counted, and the generation is left
    assert _writing(counter)[0] != first
    counter.incr(7)
    assert big.cache.get(up) == BASE + _FULL + MAX_DELTA
    assert counter.value() == _FULL + MAX_DELTA + 7
    assert counter.flush() == _FULL + MAX_DELTA + 7
    assert counter.value() == _FULL + MAX_DELTA + 7


@pytest.mark.pairs
def test_a_flush_past_signed_64_bit_fails_alone_and_keeps_the_pending_sums(
    big: shardkit.Kit, name: str
) -> None:
    full = big.buffered(name, interval=NEVER)
    other = big.buffered(name + ":other", interval=NEVER)
    for generation in (1, 2):  # records that put the stored value at 2**63 - 2
        big.store.add_generation(name, generation)
        assert big.store.advance(name, generation, Flushed(), Flushed(2**62 - 1, 0))
    full.incr(2)
    other.incr(3)
    with pytest.raises(CounterOverflow):
        full.flush()
    with pytest.raises(FlushFailed) as failed:
        big.flush_all()
    assert set(failed.value.failed) == {name}
    assert isinstance(failed.value.failed[name], CounterOverflow)
    assert failed.value.moved.get(name + ":other") == 3
    assert other.parts() == (3, 0)
    assert full.parts() == (2**63 - 2, 2)  # still pending, not lost
    full.decr(1)
    assert full.flush() == 1
    assert full.parts() == (2**63 - 1, 0)


def test_a_monotonic_counter_refuses_to_pass_signed_64_bit(big: shardkit.Kit, name: str) -> None:
    counter = big.monotonic(name, shards=1, chance_to_write=1.0)
    assert counter.incr(2**63 - 3) == 2**63 - 3
    with pytest.raises((CounterOverflow, shardkit.BackendError)):
        counter.incr(5)
    assert counter.incr(2) == 2**63 - 1


BAD_SECONDS = [math.inf, -math.inf, math.nan, -0.0, 0.0, 1e-300, 1e300, 10**400, 31 * 86400]


@pytest.mark.parametrize("interval", BAD_SECONDS)
@pytest.mark.pairs
def test_unusable_intervals_are_refused_before_anything_is_counted(
    kit: shardkit.Kit, name: str, interval: float
) -> None:
    with pytest.raises(shardkit.ValidationError):
        kit.buffered(name, interval=interval)
    assert name not in {info.name for info in kit.counters()}


@pytest.mark.parametrize("option", ["cache_ttl", "key_retention"])
@pytest.mark.parametrize("seconds", [math.inf, math.nan, -1.0, 10**400, 1e300])
def test_unusable_kit_durations_are_refused(sqlite_url: str, option: str, seconds: float) -> None:
    options: dict[str, Any] = {option: seconds}
    with pytest.raises(ConfigurationError):
        shardkit.connect(sqlite_url, "memory://", prefix=PREFIX, **options)


@pytest.mark.parametrize(
    ("store", "cache"),
    [
        ("postgresql://u:hunter2pw@127.0.0.1:abc/test", None),
        ("mysql+pymysql://u:hunter2pw@127.0.0.1:99999/test", None),
        ("postgresql://u:hunter2pw@[::1/test", None),
        (None, "redis://:hunter2pw@127.0.0.1:abc/0"),
        (None, "rediss://u:hunter2pw@[::1/0"),
        (None, "memcached://127.0.0.1:abc"),
        (None, "memcached://127.0.0.1:11211,127.0.0.1:70000"),
        (None, "memcached://u:hunter2pw@127.0.0.1:11211"),
    ],
)
def test_bad_urls_are_configuration_errors_without_the_password(
    sqlite_url: str, store: str | None, cache: str | None
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        shardkit.connect(store or sqlite_url, cache or "memory://", prefix=PREFIX)
    assert "hunter2pw" not in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "memcached://u:hunter2pw@h:1",
        "redis://:hunter2pw@h:1/0",
        "postgresql://u:hunter2pw@[::1/x",
        "mysql://u:hunter2pw@h/x?y=1",
        "rediss://u:p@ss:hunter2pw@h",
    ],
)
def test_redact_never_raises_and_hides_the_password(url: str) -> None:
    assert "hunter2pw" not in _urls.redact(url)


@pytest.mark.pairs
def test_a_sharded_counter_reads_exactly_past_signed_64_bit(big: shardkit.Kit, name: str) -> None:
    """Each shard stays within signed 64-bit (a write past it is refused, not counted);
    their sum may not, and reads exactly on every store (SQLite's sum() would fail)."""
    counter = big.sharded(name, shards=1)
    counter.incr(2**63 - 1)
    with pytest.raises(CounterOverflow):
        counter.incr(1)
    big.store.add(name, 1, 2**63 - 1)  # another shard, as another writer would
    assert counter.value(fresh=True) == big.values([name], fresh=True)[name] == 2**64 - 2
