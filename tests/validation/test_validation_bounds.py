"""The checks of ``shardkit.validation`` at their edges: each limit accepted, one past it
refused with the typed error and the message that says why. Pure: no store, no cache."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from shardkit.errors import (
    ConfigurationError,
    InvalidDelta,
    InvalidName,
    InvalidShardCount,
    ValidationError,
)
from shardkit.validation import (
    INT64_MAX,
    INT64_MIN,
    MAX_RETENTION,
    MAX_TTL,
    check_age,
    check_block,
    check_chance,
    check_count,
    check_delta,
    check_exists_ttl,
    check_interval,
    check_job_id,
    check_kit_options,
    check_mapping,
    check_name,
    check_names,
    check_shards,
    check_stripes,
    duration,
    sums_fit,
)

TTL = "2,592,000 s (30 days)"
RETENTION = "3,153,600,000 s (100 years)"
SECONDS = "must be a number of seconds"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.001, "0.001 s"),
        (1e-7, "0.0000001 s"),  # never in exponent notation
        (1.5, "1.5 s"),
        (1, "1 s"),
        (59, "59 s"),
        (60, "60 s (1 minute)"),
        (90, "90 s"),  # not a whole number of minutes
        (120.0, "120 s (2 minutes)"),
        (3600, "3,600 s (1 hour)"),
        (86400, "86,400 s (1 day)"),
        (MAX_TTL, TTL),
        (365 * 86400, "31,536,000 s (1 year)"),
        (MAX_RETENTION, RETENTION),
    ],
)
def test_durations_are_written_for_a_person(seconds: float, text: str) -> None:
    assert duration(seconds) == text


@pytest.mark.parametrize("name", ["x", "x" * 200, "a b", "~", "\xa0", "\ud7ff", "\ue000", "é"])
def test_usable_names_are_returned(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (42, "counter name must be a str, not int"),
        ("", "counter name must not be empty"),
        ("x" * 201, "counter name is 201 characters long; the limit is 200"),
        ("a\x00b", r"counter name 'a\x00b' contains the control character '\x00'"),
        ("\x1f", r"counter name '\x1f' contains the control character '\x1f'"),
        ("\x7f", r"counter name '\x7f' contains the control character '\x7f'"),
        ("\x9f", r"counter name '\x9f' contains the control character '\x9f'"),
        ("\ud800", r"counter name '\ud800' contains the control character '\ud800'"),
        ("\udfff", r"counter name '\udfff' contains the control character '\udfff'"),
    ],
)
def test_unusable_names_are_refused_saying_why(name: object, message: str) -> None:
    with pytest.raises(InvalidName) as raised:
        check_name(name)
    assert str(raised.value) == message


def test_a_name_check_names_what_it_checks() -> None:
    with pytest.raises(InvalidName, match=r"^idempotency key must not be empty$"):
        check_name("", "idempotency key")


def test_names_are_an_iterable_of_names_returned_as_a_list() -> None:
    assert check_names(("a", "b")) == ["a", "b"]
    assert check_names(name for name in "ab") == ["a", "b"]
    for bad, kind in (("votes", "str"), (b"votes", "bytes"), (5, "int")):
        with pytest.raises(InvalidName) as raised:
            check_names(bad)
        assert str(raised.value) == f"names must be an iterable of counter names, not {kind}"
    with pytest.raises(InvalidName, match="must not be empty"):
        check_names(["a", ""])


def test_deltas_are_ints_within_signed_64_bit() -> None:
    assert check_delta(INT64_MIN) == INT64_MIN
    assert check_delta(INT64_MAX) == INT64_MAX
    for bad, message in (
        (True, "delta must be an int, not bool"),
        (1.0, "delta must be an int, not float"),
        (INT64_MAX + 1, f"delta {INT64_MAX + 1} is outside signed 64-bit"),
        (INT64_MIN - 1, f"delta {INT64_MIN - 1} is outside signed 64-bit"),
    ):
        with pytest.raises(InvalidDelta) as raised:
            check_delta(bad)
        assert str(raised.value) == message


@pytest.mark.parametrize(
    ("deltas", "fit"),
    [
        ([], True),
        ([INT64_MAX], True),
        ([INT64_MAX, 1], False),
        ([INT64_MAX, 0], True),
        ([INT64_MIN], True),
        ([INT64_MIN, -1], False),
        ([INT64_MAX, INT64_MIN, 5, -5], False),  # each side alone: any subset may be written
        ([INT64_MAX, INT64_MIN], True),
    ],
)
def test_sums_fit_when_every_side_stays_within_64_bit(deltas: list[int], fit: bool) -> None:
    assert sums_fit(deltas) is fit


def test_shard_counts_are_ints_from_one_to_the_maximum() -> None:
    assert check_shards(1, 8) == 1
    assert check_shards(8, 8) == 8
    for bad, message in (
        (0, "shard count 0 is outside 1..8"),
        (9, "shard count 9 is outside 1..8"),
        (True, "shard count must be an int, not bool"),
        (2.0, "shard count must be an int, not float"),
    ):
        with pytest.raises(InvalidShardCount) as raised:
            check_shards(bad, 8)
        assert str(raised.value) == message


@pytest.mark.parametrize(
    ("check", "low", "high", "message"),
    [
        (check_interval, 0.001, MAX_TTL, f"interval {SECONDS} ≥ 0.001 s and ≤ {TTL}"),
        (check_exists_ttl, 0, MAX_TTL, f"exists_ttl {SECONDS} ≥ 0 s and ≤ {TTL}"),
        (check_age, 0, MAX_RETENTION, f"age {SECONDS} ≥ 0 s and ≤ {RETENTION}"),
    ],
)
def test_durations_are_accepted_from_their_least_to_their_most(
    check: Callable[[object], float], low: float, high: float, message: str
) -> None:
    for seconds in (low, high, (low + high) / 2):
        accepted = check(seconds)
        assert accepted == seconds
        assert type(accepted) is float
    below = low - 0.0001 if low else -0.0001
    for bad in (below, high + 1, 10**400, float("nan"), float("inf"), True, "1", None):
        with pytest.raises(ValidationError) as raised:
            check(bad)
        assert str(raised.value) == f"{message}, not {bad!r}"


def test_stripes_are_ints_from_1_to_256() -> None:
    assert [check_stripes(1), check_stripes(256)] == [1, 256]
    for bad in (0, 257, True, 1.0):
        with pytest.raises(ValidationError) as raised:
            check_stripes(bad)
        assert str(raised.value) == f"stripes must be an int in 1..256, not {bad!r}"


def test_chances_are_probabilities_returned_as_floats() -> None:
    for chance in (0, 0.5, 1):
        accepted = check_chance(chance)
        assert accepted == chance
        assert type(accepted) is float
    for bad in (-0.01, 1.01, True, "0.5"):
        with pytest.raises(ValidationError) as raised:
            check_chance(bad)
        assert str(raised.value) == f"chance_to_write must be a number in [0, 1], not {bad!r}"


@pytest.mark.parametrize(
    ("check", "most", "message"),
    [
        (check_count, 1_000_000, "count must be an int in 1..1000000, not {!r}"),
        (check_block, 2**40, "block must be an int in 1..2**40, not {!r}"),
        (
            lambda value: check_block(value, "sub_block"),
            2**40,
            "sub_block must be an int in 1..2**40, not {!r}",
        ),
    ],
)
def test_id_counts_and_blocks_are_ints_from_1_to_their_most(
    check: Callable[[object], int], most: int, message: str
) -> None:
    assert [check(1), check(most)] == [1, most]
    for bad in (0, most + 1, True, 1.0):
        with pytest.raises(ValidationError) as raised:
            check(bad)
        assert str(raised.value) == message.format(bad)


def test_job_ids_are_1_to_64_of_letters_digits_and_a_few_marks() -> None:
    for job in ("a", "Az09_.:-", "x" * 64):
        assert check_job_id(job) == job
    for bad in ("", "x" * 65, "a b", "a/b", "é", 5):
        with pytest.raises(ValidationError) as raised:
            check_job_id(bad)
        assert str(raised.value) == (
            f"a job id is 1-64 letters, digits or _.:- characters: {bad!r}"
        )


@pytest.mark.parametrize(
    ("what", "low", "high"),
    [("page_size", 1, 100_000), ("fanout", 1, 64), ("retries", 0, 1000)],
)
def test_mapping_options_are_ints_within_their_bounds(what: str, low: int, high: int) -> None:
    fine = {"page_size": 10, "fanout": 2, "retries": 0}
    for value in (low, high):
        check_mapping(**{**fine, what: value})
    for bad in (low - 1, high + 1, True, float(low)):
        with pytest.raises(ValidationError) as raised:
            check_mapping(**{**fine, what: bad})
        assert str(raised.value) == f"{what} must be an int in [{low}, {high}], not {bad!r}"


PREFIX = "table prefix must be an identifier, ≤ 40 characters"
KIT = {"prefix": "sk_", "cache_ttl": 60, "max_shards": 8, "key_retention": 0, "adjust_delay": 0}


@pytest.mark.parametrize(
    "options",
    [
        {"prefix": "p" * 40},
        {"cache_ttl": 0.001},
        {"cache_ttl": MAX_TTL},
        {"max_shards": 1},
        {"key_retention": MAX_RETENTION},
        {"adjust_delay": 60},
    ],
)
def test_kit_options_at_their_limits_are_accepted(options: dict[str, Any]) -> None:
    check_kit_options(**{**KIT, **options})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prefix": "p" * 41}, f"{PREFIX}: {'p' * 41!r}"),
        ({"prefix": "1p"}, f"{PREFIX}: '1p'"),
        ({"prefix": 5}, f"{PREFIX}: 5"),
        ({"cache_ttl": 0}, f"cache_ttl must be a number of seconds > 0 and ≤ {TTL}, not 0"),
        (
            {"cache_ttl": MAX_TTL + 1},
            f"cache_ttl must be a number of seconds > 0 and ≤ {TTL}, not {MAX_TTL + 1}",
        ),
        (
            {"key_retention": -1},
            f"key_retention must be a number of seconds ≥ 0 s and ≤ {RETENTION}, not -1",
        ),
        (
            {"adjust_delay": 60.5},
            "adjust_delay must be a number of seconds ≥ 0 s and ≤ 60 s (1 minute), not 60.5",
        ),
        ({"max_shards": 0}, "max_shards must be an int ≥ 1, not 0"),
        ({"max_shards": True}, "max_shards must be an int ≥ 1, not True"),
        ({"max_shards": 2.0}, "max_shards must be an int ≥ 1, not 2.0"),
    ],
)
def test_kit_options_past_their_limits_are_configuration_errors(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=f"^{re.escape(message)}$"):
        check_kit_options(**{**KIT, **options})
