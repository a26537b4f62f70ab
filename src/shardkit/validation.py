"""Checks applied to every public input before anything is written."""

from __future__ import annotations

import decimal
import math
import re
from collections.abc import Iterable

from shardkit.errors import (
    ConfigurationError,
    InvalidDelta,
    InvalidName,
    InvalidShardCount,
    ValidationError,
)

MAX_NAME_LENGTH = 200
# Unicode's control characters (category Cc) and surrogates (Cs), which no name may hold.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
MAX_BLOCK = 2**40
MAX_TAKE = 1_000_000  # ids one ``take`` hands out
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# Durations a cache keeps a key for (flush intervals make deduplication windows, and
# cache_ttl is a TTL) stay within memcached's limit, past which it reads an absolute time.
MAX_TTL = 30 * 24 * 3600
# The shortest flush interval: interval numbers (time / interval) stay exact floats.
MIN_INTERVAL = 0.001
MAX_RETENTION = 100 * 365 * 24 * 3600
ADJUST_DELAY = 0.1
"""Seconds a kit's sharded writes' cache adjustments gather by default (see ``Adjuster``):
how stale ``value()`` may be in other processes, traded against a background send per
process every so often."""


_UNITS = ((365 * 86400, "year"), (86400, "day"), (3600, "hour"), (60, "minute"))


def duration(seconds: float) -> str:
    """``seconds`` written for a person: ``0.001 s``, ``60 s (1 minute)``,
    ``2,592,000 s (30 days)``; never in exponent notation."""
    if seconds == int(seconds):
        text = f"{int(seconds):,} s"
    else:
        text = f"{decimal.Decimal(repr(float(seconds))).normalize():f} s"
    for size, unit in _UNITS:
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return f"{text} ({count:,} {unit}{'s' if count != 1 else ''})"
    return text


def _seconds(value: object, what: str, low: float, high: float, *, zero: bool = False) -> float:
    """``value`` as a float if it is a finite number of seconds (not a bool) in
    ``low..high`` (``0 < value`` when ``low`` is 0 unless ``zero``)."""
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    seconds = math.nan
    if number:  # compared before it is converted: an int too large for a float is out of range
        seconds = math.inf if value > high else -math.inf if value < low else float(value)  # type: ignore[operator,arg-type]
    if not (low <= seconds <= high and (seconds > 0 or zero)):
        above = f"≥ {duration(low)}" if low or zero else "> 0"
        raise ValidationError(
            f"{what} must be a number of seconds {above} and ≤ {duration(high)}, not {value!r}"
        )
    return seconds


def check_name(name: object, what: str = "counter name") -> str:
    """Return ``name`` if it is a usable counter name or idempotency key.

    A name is a non-empty ``str`` of at most 200 characters with no control characters
    (nor lone surrogates, which no database can store).
    """
    if not isinstance(name, str):
        raise InvalidName(f"{what} must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidName(f"{what} must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidName(f"{what} is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}")
    found = _CONTROL.search(name)
    if found is not None:
        raise InvalidName(f"{what} {name!r} contains the control character {found[0]!r}")
    return name


def check_names(names: object) -> list[str]:
    """Return ``names`` as a list if it is an iterable of counter names (a single ``str``
    is not: ``values("votes")`` would read ``v``, ``o``, …)."""
    if isinstance(names, str | bytes) or not isinstance(names, Iterable):
        raise InvalidName(f"names must be an iterable of counter names, not {type(names).__name__}")
    return [check_name(name) for name in names]


def check_delta(delta: object) -> int:
    """Return ``delta`` if it is an int (not a bool) within signed 64-bit."""
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise InvalidDelta(f"delta must be an int, not {type(delta).__name__}")
    if not INT64_MIN <= delta <= INT64_MAX:
        raise InvalidDelta(f"delta {delta} is outside signed 64-bit")
    return delta


def sums_fit(deltas: Iterable[int]) -> bool:
    """Whether every sum of some of ``deltas`` lies within signed 64-bit: a combined
    write of any of them cannot overflow its own parameter."""
    up = down = 0
    for delta in deltas:
        if delta > 0:
            up += delta
        else:
            down += delta
    return up <= INT64_MAX and down >= INT64_MIN


def check_shards(shards: object, maximum: int) -> int:
    """Return ``shards`` if it is an int in ``1..maximum``."""
    if isinstance(shards, bool) or not isinstance(shards, int):
        raise InvalidShardCount(f"shard count must be an int, not {type(shards).__name__}")
    if not 1 <= shards <= maximum:
        raise InvalidShardCount(f"shard count {shards} is outside 1..{maximum}")
    return shards


def check_interval(interval: object) -> float:
    """Return ``interval`` as a float if it is a number of seconds (not a bool) in
    0.001 … 30 days."""
    return _seconds(interval, "interval", MIN_INTERVAL, MAX_TTL)


def check_exists_ttl(ttl: object) -> float:
    """Return ``ttl`` as a float if it is a number of seconds (not a bool) in 0 … 30 days."""
    return _seconds(ttl, "exists_ttl", 0.0, MAX_TTL, zero=True)


MAX_STRIPES = 256


def check_stripes(stripes: object) -> int:
    """Return ``stripes`` if it is an int in 1 … 256 (not a bool): the cache keys one
    buffered counter's increments are spread over."""
    if isinstance(stripes, bool) or not isinstance(stripes, int) or not 1 <= stripes <= MAX_STRIPES:
        raise ValidationError(f"stripes must be an int in 1..{MAX_STRIPES}, not {stripes!r}")
    return stripes


def check_chance(chance: object) -> float:
    """Return ``chance`` as a float if it is a probability in [0, 1] (not a bool)."""
    if isinstance(chance, bool) or not isinstance(chance, (int, float)) or not 0 <= chance <= 1:
        raise ValidationError(f"chance_to_write must be a number in [0, 1], not {chance!r}")
    return float(chance)


def check_age(age: object) -> float:
    """Return ``age`` (seconds) if it is a finite number in 0 … 100 years."""
    return _seconds(age, "age", 0.0, MAX_RETENTION, zero=True)


def check_count(count: object) -> int:
    """Return ``count`` if it is an int in 1 … 1,000,000 (not a bool): ids taken at once."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_TAKE:
        raise ValidationError(f"count must be an int in 1..1000000, not {count!r}")
    return count


def check_block(block: object, what: str = "block") -> int:
    """Return ``block`` if it is an int in 1 … 2**40 (not a bool): ids reserved, or
    taken from a block, at a time (``what`` names it in the error)."""
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
        raise ValidationError(f"{what} must be an int in 1..2**40, not {block!r}")
    return block


_JOB_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def check_job_id(job: object) -> str:
    """Return ``job`` if it is a usable job id: 1-64 letters, digits and ``_.:-``."""
    if not isinstance(job, str) or not _JOB_ID.fullmatch(job):
        raise ValidationError(f"a job id is 1-64 letters, digits or _.:- characters: {job!r}")
    return job


def check_mapping(page_size: object, fanout: object, retries: object) -> None:
    """Validate a job's options: 1 ≤ page_size ≤ 100,000, 1 ≤ fanout ≤ 64, 0 ≤ retries ≤ 1000."""
    for what, value, low, high in (
        ("page_size", page_size, 1, 100_000),
        ("fanout", fanout, 1, 64),
        ("retries", retries, 0, 1000),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValidationError(f"{what} must be an int in [{low}, {high}], not {value!r}")


def check_kit_options(
    prefix: object,
    cache_ttl: object,
    max_shards: object,
    key_retention: object,
    adjust_delay: object = ADJUST_DELAY,
) -> None:
    """Validate a kit's options: ``prefix`` an identifier of at most 40 characters (it
    begins table names), ``cache_ttl`` in (0, 30 days], ``max_shards`` ≥ 1,
    ``key_retention`` in [0, 100 years], ``adjust_delay`` in [0, 60] (finite numbers of
    seconds)."""
    if not isinstance(prefix, str) or not prefix.isidentifier() or len(prefix) > 40:
        raise ConfigurationError(f"table prefix must be an identifier, ≤ 40 characters: {prefix!r}")
    try:
        _seconds(cache_ttl, "cache_ttl", 0, MAX_TTL)
        _seconds(key_retention, "key_retention", 0, MAX_RETENTION, zero=True)
        _seconds(adjust_delay, "adjust_delay", 0, 60, zero=True)
    except ValidationError as exc:
        raise ConfigurationError(str(exc)) from None
    if isinstance(max_shards, bool) or not isinstance(max_shards, int) or max_shards < 1:
        raise ConfigurationError(f"max_shards must be an int ≥ 1, not {max_shards!r}")
