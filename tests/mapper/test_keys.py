"""Key ranges, key JSON forms, range ids and interpolation (shardkit.mapper.keys)."""

from __future__ import annotations

import datetime as dt
import json
import re
from decimal import Decimal
from itertools import pairwise
from uuid import UUID

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardkit.errors import ValidationError
from shardkit.mapper.keys import (
    KeyRange,
    UnsupportedKey,
    ahead,
    decode_key,
    dump_key,
    encode_key,
    interpolate,
    load_key,
    midpoint,
)

# Strings: no surrogates, astral code points and the edges of the surrogate gap included.
CHARS = st.one_of(
    st.characters(codec="utf-8"),
    st.characters(min_codepoint=0x10000),
    st.sampled_from(["\x00", "\ud7ff", "\ue000", "\U0010ffff"]),
)
INTS = st.one_of(st.integers(-1000, 1000), st.integers(-(2**255) + 1, 2**255 - 1))
KEYS = {
    "int": INTS,
    "str": st.text(CHARS, max_size=6),
    "bytes": st.binary(max_size=6),
    "uuid": st.uuids(),
    # Few first components, so they are often equal and the second one decides.
    "tuple": st.tuples(st.integers(-3, 3), st.text(CHARS, max_size=4)),
}
ANY_KEY = st.one_of(st.none(), *KEYS.values())
KINDS = pytest.mark.parametrize("kind", list(KEYS))
FAST = settings(max_examples=150, deadline=None)


def ordered_pair(keys: st.SearchStrategy) -> st.SearchStrategy:
    """Two keys ``lo < hi``."""
    return st.tuples(keys, keys).filter(lambda p: p[0] != p[1]).map(sorted).map(tuple)


def utf8_encodable(key: object) -> bool:
    if isinstance(key, tuple):
        return all(utf8_encodable(part) for part in key)
    if isinstance(key, str):
        key.encode("utf-8")  # raises on a surrogate
    return True


def same_shape(a: object, b: object) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same_shape(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b)


def assert_partition(parent: KeyRange, children: list[KeyRange], probes: list) -> None:
    assert children[0].lo == parent.lo
    assert children[-1].hi == parent.hi
    for left, right in pairwise(children):
        assert left.hi == right.lo
    for child in children:
        assert child.lo is None or child.hi is None or child.lo < child.hi
    for key in probes:
        holders = sum(child.contains(key) for child in children)
        assert holders == (1 if parent.contains(key) else 0), key


# --- interpolate / midpoint -------------------------------------------------------------


@KINDS
@FAST
@given(data=st.data(), parts=st.integers(0, 40))
def test_interpolate_gives_increasing_points_strictly_inside(kind, data, parts):
    lo, hi = data.draw(ordered_pair(KEYS[kind]))
    points = interpolate(lo, hi, parts)
    assert len(points) <= max(parts - 1, 0)
    assert all(same_shape(point, lo) for point in points)
    assert all(utf8_encodable(point) for point in points)
    assert all(lo < point < hi for point in points)
    assert all(a < b for a, b in pairwise(points))


HEX = "0123456789abcdef"


@FAST
@given(
    keys=st.lists(st.text(HEX, max_size=12), min_size=2, max_size=2, unique=True),
    parts=st.integers(0, 40),
)
def test_interpolate_over_an_alphabet_stays_in_it_and_strictly_inside(keys, parts):
    lo, hi = sorted(keys)
    points = interpolate(lo, hi, parts, HEX)
    assert len(points) <= max(parts - 1, 0)
    assert all(set(point) <= set(HEX) for point in points)
    assert all(lo < point < hi for point in points)
    assert all(a < b for a, b in pairwise(points))


def test_interpolate_over_an_alphabet_spaces_by_its_ranks():
    """Hex keys are spread over 16 characters, not over the code points between '0' and
    'f' (39 of which are no hex digit): over the alphabet, halfway is where it is."""
    assert interpolate("10", "20", 2, HEX) == ["18"]
    assert interpolate("10", "20", 2) != ["18"]
    assert interpolate("1g", "20", 2, HEX) == interpolate("1g", "20", 2)  # not all in it


@FAST
@given(lo=INTS, gap=st.integers(0, 2**200), parts=st.integers(2, 50))
def test_interpolate_ints_with_room_gives_all_points_evenly_spaced(lo, gap, parts):
    hi = lo + parts + gap
    points = interpolate(lo, hi, parts)
    assert len(points) == parts - 1
    steps = [b - a for a, b in pairwise([lo, *points, hi])]
    assert max(steps) - min(steps) <= 1


@pytest.mark.parametrize(
    ("lo", "hi", "parts", "points"),
    [
        (0, 10, 2, [5]),
        (0, 10, 3, [3, 6]),
        (b"\x00", b"\x01", 3, [b"\x00\x55", b"\x00\xaa"]),  # one digit longer than the keys
        (b"\x01\x00", b"\x03", 2, [b"\x02\x00"]),  # as long as lo at least
        ("\ud7ff", "\ue001", 2, ["\ue000"]),  # the surrogates skipped
        ((1, "a"), (1, "c"), 2, [(1, "b")]),
        ("X", "XXX", 2, ["X,,"]),  # code points: no alphabet unless given
    ],
)
def test_interpolate_examples(lo, hi, parts, points):
    """The points themselves: evenly spaced, one digit finer than the keys, no shorter
    than ``lo``; the middle for a midpoint."""
    assert interpolate(lo, hi, parts) == points
    assert midpoint(lo, hi) == interpolate(lo, hi, 2)[0]


def test_an_alphabet_of_one_character_is_ignored():
    """A single character is no alphabet (no digit between): code points are used."""
    assert interpolate("a", "aaa", 2, "a") == interpolate("a", "aaa", 2) != []
    assert interpolate("0", "1", 2, "01") == ["01"]  # two characters are an alphabet


def has_room(lo, hi) -> bool:
    """Whether some key lies strictly between ``lo < hi`` (ints, UUIDs, bytes, str)."""
    if isinstance(lo, UUID):
        return hi.int - lo.int >= 2
    if isinstance(lo, int):
        return hi - lo >= 2
    return hi != lo + (b"\x00" if isinstance(lo, bytes) else "\x00")


@pytest.mark.parametrize("kind", ["int", "uuid", "bytes", "str"])
@FAST
@given(data=st.data())
def test_midpoint_exists_exactly_when_there_is_room(kind, data):
    lo, hi = data.draw(ordered_pair(KEYS[kind]))
    middle = midpoint(lo, hi)
    if has_room(lo, hi):
        assert middle is not None
        assert lo < middle < hi
    else:
        assert middle is None


@pytest.mark.parametrize(
    ("lo", "hi"),
    [
        (5, 6),
        (-(2**100), -(2**100) + 1),
        (UUID(int=7), UUID(int=8)),
        (b"", b"\x00"),
        (b"ab", b"ab\x00"),
        ("a", "a\x00"),
        ("\U0010ffff", "\U0010ffff\x00"),
        ((1, "a"), (1, "a\x00")),
    ],
)
def test_nothing_between_adjacent_keys(lo, hi):
    assert interpolate(lo, hi, 2) == []
    assert interpolate(lo, hi, 10) == []
    assert midpoint(lo, hi) is None


@pytest.mark.parametrize(
    ("lo", "hi"),
    [(b"\x00", b"\x01"), ("a", "b"), ("\ud7ff", "\ue000"), ("a", "a\x01"), (b"\xff", b"\xff\x01")],
)
@pytest.mark.parametrize("parts", [2, 3, 10])
def test_room_between_close_keys(lo, hi, parts):
    points = interpolate(lo, hi, parts)
    assert len(points) == parts - 1
    assert all(lo < point < hi for point in points)
    assert all(utf8_encodable(point) for point in points)


@pytest.mark.parametrize(
    ("lo", "hi"),
    [
        (1, "a"),
        (b"a", "b"),
        (UUID(int=1), 2),
        (1, 2.5),
        (True, 5),
        (0, False),
        (1, (2,)),
        ((1,), (1, 2)),
        ((1, "a"), (1, 2)),
        ((1, "a"), ("a", 1)),
    ],
)
def test_interpolate_refuses_mismatched_or_unsupported_types(lo, hi):
    with pytest.raises(UnsupportedKey):
        interpolate(lo, hi, 4)


@pytest.mark.parametrize(
    ("lo", "hi", "message"),
    [
        (True, 5, "booleans are not keys"),
        (1, 2.5, "cannot interpolate between 1 and 2.5"),
        ((1, "a"), (1, "a", 2), r"composite keys of different lengths: \(1, 'a'\), \(1, 'a', 2\)"),
    ],
)
def test_interpolate_says_why_it_refuses(lo, hi, message):
    with pytest.raises(UnsupportedKey, match=f"^{message}$"):
        interpolate(lo, hi, 4)


# --- ahead ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "last", "end", "pages"),
    [
        (0, 10, 30, 2.0),
        (0, 10, 10, 0.0),
        (0, 10, 5, 0.0),  # the end behind the page: nothing left
        (0, 4, 5, 0.25),
        (UUID(int=0), UUID(int=10), UUID(int=30), 2.0),
        (b"a", b"b", b"d", 1.0),  # over the alphabet the keys use: 'c' is not in it
        ("a", "b", "d", 1.0),
        ("a", "ab", "b", 0.5),  # a, ab, b: positions 3, 5 and 6 over {a, b} and padding
        ((1, 0), (1, 10), (1, 30), 2.0),  # by the first part that differs
        ((1, "x"), (2, "x"), (4, "a"), 2.0),
        (0, 1, 2**40, 2.0**40 - 1),
        (0, 1, 2**40 + 1, 2.0**40),  # at most 2**40
        (0, 1, 2**60, 2.0**40),
        (10, 11, 2**40 + 12, 2.0**40),
        ((1, 0), (2, 0), (2, 10), 0.0),  # the first part differs, if only in two of them
    ],
)
def test_ahead_counts_the_pages_like_one_left_to_the_end(first, last, end, pages):
    assert ahead(first, last, end) == pages


@pytest.mark.parametrize(
    ("first", "last", "end"),
    [
        (10, 10, 30),  # an empty stretch
        (10, 5, 30),
        (1, "a", 3),  # not of one type
        ((1, 2), 3, 4),
        ((1, 2), (1, 2), (1, 2)),  # no part differs
        (True, True, True),  # no arithmetic
        (1.0, 2.0, 3.0),
    ],
)
def test_ahead_is_none_without_arithmetic_or_a_stretch(first, last, end):
    assert ahead(first, last, end) is None


# --- KeyRange.split / contains ----------------------------------------------------------


@KINDS
@FAST
@given(data=st.data())
def test_split_partitions_the_range(kind, data):
    keys = KEYS[kind]
    bounds = data.draw(st.lists(keys, min_size=2, max_size=2, unique=True).map(sorted))
    lo = data.draw(st.sampled_from([None, bounds[0]]))
    hi = data.draw(st.sampled_from([None, bounds[1]]))
    parent = KeyRange(lo, hi)
    drawn = data.draw(st.lists(keys, max_size=6))
    inside = [k for k in [*drawn, *bounds] if parent.contains(k)]
    # Duplicates on purpose: some points twice, and lo (when bounded) among them.
    points = sorted(inside + inside[: data.draw(st.integers(0, len(inside)))])
    children = parent.split(points)
    assert len(children) == len(set(points) - {lo}) + 1
    probes = [*data.draw(st.lists(keys, max_size=10)), *drawn, *bounds]
    assert_partition(parent, children, probes)


@KINDS
@FAST
@given(data=st.data(), parts=st.integers(1, 12))
def test_split_at_interpolated_points_partitions_the_range(kind, data, parts):
    keys = KEYS[kind]
    lo, hi = data.draw(ordered_pair(keys))
    parent = KeyRange(lo, hi)
    points = interpolate(lo, hi, parts)
    children = parent.split(points)
    assert len(children) == len(points) + 1
    assert_partition(parent, children, [*data.draw(st.lists(keys, max_size=10)), lo, hi, *points])


def test_split_without_points_is_the_range_itself():
    assert KeyRange(1, 9).split([]) == [KeyRange(1, 9)]
    assert KeyRange().split([3, 3, 5]) == [KeyRange(None, 3), KeyRange(3, 5), KeyRange(5, None)]


def test_past_a_key_drops_the_lower_bound():
    assert KeyRange(1, 10).past(None) == KeyRange(1, 10)
    assert KeyRange(1, 10).past(5) == KeyRange(None, 10)


def test_contains_is_lo_inclusive_hi_exclusive():
    span = KeyRange(b"b", b"d")
    assert [span.contains(k) for k in (b"a", b"b", b"c", b"d")] == [False, True, True, False]
    assert KeyRange(None, 0).contains(-(10**50))
    assert KeyRange("x", None).contains("\U0010ffff")


# --- JSON forms ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["none", *KEYS])
@FAST
@given(data=st.data())
def test_key_forms_round_trip(kind, data):
    key = data.draw(st.none() if kind == "none" else KEYS[kind])
    encoded = encode_key(key)
    assert json.loads(json.dumps(encoded)) == encoded
    assert decode_key(encoded) == key
    assert same_shape(decode_key(encoded), key)
    text = dump_key(key)
    assert (text is None) == (key is None)
    if text is not None:
        assert json.loads(text) == encoded
    assert load_key(text) == key
    assert same_shape(load_key(text), key)


@pytest.mark.parametrize(
    "key",
    [
        *(True, False, 1.5, float("nan"), Decimal(1)),
        *(dt.date(2024, 1, 1), dt.datetime(2024, 1, 1), dt.timedelta(1)),
        *((1, True), (1, 2.0), [1, 2], {"b": ""}),
        *(2**256, -(2**256), 2**300),  # wider than any database key
    ],
)
def test_encode_key_refuses_unsupported_types(key):
    with pytest.raises(UnsupportedKey) as caught:
        encode_key(key)
    assert isinstance(caught.value, ValidationError)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (1.5, "keys of type float cannot be mapped: 1.5"),
        ((1, True), "keys of type bool cannot be mapped: True"),  # the part refused
    ],
)
def test_encode_key_names_what_it_refuses(key, message):
    with pytest.raises(UnsupportedKey) as caught:
        encode_key(key)
    assert str(caught.value) == message


# --- KeyRange.id --------------------------------------------------------------------------


@FAST
@given(job=st.text(max_size=4), lo=ANY_KEY, hi=ANY_KEY)
def test_range_id_is_deterministic_and_32_hex(job, lo, hi):
    ident = KeyRange(lo, hi).id(job)
    assert re.fullmatch("[0-9a-f]{32}", ident)
    assert KeyRange(load_key(dump_key(lo)), load_key(dump_key(hi))).id(job) == ident


@settings(max_examples=200, deadline=None)
@given(
    a=st.tuples(st.text(max_size=3), ANY_KEY, ANY_KEY),
    b=st.tuples(st.text(max_size=3), ANY_KEY, ANY_KEY),
)
def test_distinct_job_and_bounds_give_distinct_ids(a, b):
    assume(a != b)
    assert KeyRange(a[1], a[2]).id(a[0]) != KeyRange(b[1], b[2]).id(b[0])


def test_range_id_examples():
    base = KeyRange(1, 2).id("job")
    others = [
        KeyRange(1, 3).id("job"),
        KeyRange(2, 1).id("job"),
        KeyRange(None, 2).id("job"),
        KeyRange(1, None).id("job"),
        KeyRange("1", 2).id("job"),
        KeyRange((1,), 2).id("job"),
        KeyRange(1, 2).id("job2"),
        KeyRange(1, 2).id(""),
    ]
    assert KeyRange(1, 2).id("job") == base
    assert len({base, *others}) == len(others) + 1
    assert KeyRange(b"", None).id("j") != KeyRange("", None).id("j")
    assert KeyRange(UUID(int=1), None).id("j") != KeyRange(1, None).id("j")
