"""Key spaces: ranges of keys, their JSON form and ids, and the arithmetic of splitting.

Pure functions, no I/O. A key is an ``int``, ``str``, ``bytes``, ``UUID`` or a tuple of
those (a composite key, compared as a row value). A ``KeyRange`` holds the keys ``k`` with
``lo <= k < hi`` (``None``: unbounded on that side).

Which keys fall in a range is decided by the database, in its own order: a collation may
order strings differently from Python, and hold distinct strings equal. Splitting at
points given in that order (``KeyRange.split``) always partitions a range exactly. The
interpolation functions here work in Python's order, so the mapper only aims with their
points: the database finds the real keys at them, which are the split points.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from shardkit.errors import UnsupportedKey

Scalar = int | str | bytes | UUID
Key = Scalar | tuple[Scalar, ...]
_INT_LIMIT = 2**256  # wider than any database's integer or NUMERIC key


def encode_key(key: Key | None) -> Any:
    """The JSON-able form of ``key``: ints and strings as themselves, bytes as
    ``{"b": base64}``, UUIDs as ``{"u": hex}``, tuples as lists."""
    if key is None or isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool) and -_INT_LIMIT < key < _INT_LIMIT:
        return key
    if isinstance(key, bytes):
        return {"b": base64.b64encode(key).decode()}
    if isinstance(key, UUID):
        return {"u": key.hex}
    if isinstance(key, tuple):
        return [encode_key(part) for part in key]
    raise UnsupportedKey(f"keys of type {type(key).__name__} cannot be mapped: {key!r}")


def decode_key(value: Any) -> Key | None:
    """The inverse of ``encode_key``."""
    if isinstance(value, list):
        return tuple(decode_key(part) for part in value)  # type: ignore[misc]
    if isinstance(value, dict):
        if "b" in value:
            return base64.b64decode(value["b"])
        return UUID(hex=value["u"])
    return value  # type: ignore[no-any-return]


_COMPACT = json.JSONEncoder(separators=(",", ":"))  # json.dumps's, made once


def dump_key(key: Key | None) -> str | None:
    """``key`` as JSON text, or None for an unbounded side."""
    return None if key is None else _COMPACT.encode(encode_key(key))


def load_key(text: str | None) -> Key | None:
    return None if text is None else decode_key(json.loads(text))


@dataclass(frozen=True)
class KeyRange:
    """The keys ``k`` with ``lo <= k < hi``; ``None`` leaves that side unbounded."""

    lo: Key | None = None
    hi: Key | None = None

    def id(self, job: str) -> str:
        """A deterministic id of this range within ``job``: the same bounds always give
        the same id, so a range recorded twice is one row."""
        text = f"{job}\0{dump_key(self.lo)}\0{dump_key(self.hi)}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def split(self, points: Sequence[Key]) -> list[KeyRange]:
        """Cut this range at ``points`` (non-decreasing in the database's order, inside the
        range): ``[lo, p1), [p1, p2), …, [pn, hi)``. Every key of the range is in exactly one
        of them, whatever the order; equal neighbouring points are dropped (points equal
        only under a collation, 'a' and 'A', leave an empty range between them)."""
        bounds: list[Key | None] = [self.lo]
        for point in points:
            if point != bounds[-1]:
                bounds.append(point)
        bounds.append(self.hi)
        return [KeyRange(lo, hi) for lo, hi in itertools.pairwise(bounds)]

    def past(self, after: Key | None) -> KeyRange:
        """This range for reading past ``after`` (one of its keys; None: from its start):
        without its lower bound then, which every key above ``after`` is above. (A
        database keeps the tighter of two bounds on one column, not of two row values,
        and would walk a composite key's index from ``lo``.)"""
        return self if after is None else KeyRange(None, self.hi)

    def contains(self, key: Key) -> bool:
        """Whether ``key`` is in this range in Python's order (the database's for ints,
        bytes and UUIDs)."""
        return (self.lo is None or self.lo <= key) and (self.hi is None or key < self.hi)  # type: ignore[operator]


def interpolate(lo: Key, hi: Key, parts: int, alphabet: str = "") -> list[Key]:
    """Up to ``parts - 1`` keys strictly between ``lo`` and ``hi``, increasing and about
    evenly spaced in the key space (bisection for ``parts = 2``), in Python's order. Fewer,
    or none, when the space between is too small. ``lo`` and ``hi`` are of one type,
    ``lo < hi``.

    For strings, code points are the digits (surrogates skipped, so every point encodes
    as UTF-8), or, given an ``alphabet`` (increasing characters, at least two) that
    holds every character of ``lo`` and ``hi``, the characters' ranks in it: keys of a
    narrow alphabet (hex, digits) are spaced as they are spread, not over code points
    they never use. For composite keys, the first component where ``lo`` and ``hi``
    differ is interpolated and the rest of ``lo`` kept.
    """
    if parts < 2:
        return []
    if isinstance(lo, tuple) and isinstance(hi, tuple):
        return _interpolate_tuples(lo, hi, parts)
    if isinstance(lo, bool) or isinstance(hi, bool):
        raise UnsupportedKey("booleans are not keys")
    if isinstance(lo, int) and isinstance(hi, int):
        return _spread(lo, hi, parts)  # type: ignore[return-value]
    if isinstance(lo, UUID) and isinstance(hi, UUID):
        return [UUID(int=value) for value in _spread(lo.int, hi.int, parts)]
    if isinstance(lo, bytes) and isinstance(hi, bytes):
        return [bytes(digits) for digits in _between_digits(list(lo), list(hi), 256, parts)]
    if isinstance(lo, str) and isinstance(hi, str):
        if len(alphabet) > 1 and set(alphabet).issuperset(lo + hi):
            rank = {char: i for i, char in enumerate(alphabet)}
            found = _between_digits(
                [rank[c] for c in lo], [rank[c] for c in hi], len(alphabet), parts
            )
            return ["".join(alphabet[d] for d in digits) for digits in found]
        found = _between_digits(
            [_digit(c) for c in lo], [_digit(c) for c in hi], _CODE_POINTS, parts
        )
        return ["".join(_char(d) for d in digits) for digits in found]
    raise UnsupportedKey(f"cannot interpolate between {lo!r} and {hi!r}")


def midpoint(lo: Key, hi: Key) -> Key | None:
    """A key strictly between ``lo`` and ``hi`` near the middle, or None if none exists."""
    points = interpolate(lo, hi, 2)
    return points[0] if points else None


def ahead(first: Key, last: Key, end: Key) -> float | None:
    """How many times the stretch of key space from ``first`` to ``last`` fits between
    ``last`` and ``end``, in Python's order (``first < last <= end``, of one type): how
    many pages like one that ran from ``first`` to ``last`` are left up to ``end``, if
    the keys past it are as dense as in it. None when the keys have no arithmetic, or
    the stretch is empty. At most ``_MAX_AHEAD``."""
    positions = _positions([first, last, end])
    if positions is None:
        return None
    start, at, stop = positions
    if at <= start:
        return None
    if stop - at >= (at - start) * _MAX_AHEAD:
        return _MAX_AHEAD
    return max(stop - at, 0) / (at - start)


_MAX_AHEAD = float(2**40)  # rows planned from it stay well inside 64 bits


def _positions(keys: Sequence[Key]) -> list[int] | None:
    """``keys`` as integers of one scale, in Python's order (for strings and bytes, as
    digit strings padded to one length); composite keys by their first part that differs
    among them. None if they are not all of one type that has arithmetic."""
    tuples = [key for key in keys if isinstance(key, tuple)]
    if tuples:
        if len(tuples) < len(keys):
            return None
        differing = next((part for part in zip(*tuples, strict=False) if len(set(part)) > 1), None)
        return None if differing is None else _positions(differing)
    kinds = {type(key) for key in keys}
    if len(kinds) != 1:
        return None
    found: list[list[int]]
    if kinds == {int}:
        return [key for key in keys if isinstance(key, int)]
    if kinds == {UUID}:
        return [key.int for key in keys if isinstance(key, UUID)]
    if kinds == {bytes}:
        found = [list(key) for key in keys if isinstance(key, bytes)]
    elif kinds == {str}:
        found = [[ord(c) for c in key] for key in keys if isinstance(key, str)]
    else:  # bools, floats, …: no arithmetic
        return None
    # Digits over the alphabet the keys use, not every code point: keys of a few
    # characters (hex, digits, words) are as dense as their alphabet, and a position's
    # weight is that alphabet's size. Digit 0 pads the shorter keys.
    alphabet = {digit: rank for rank, digit in enumerate(sorted(set().union(*found)), 1)}
    width = max(len(digits) for digits in found)
    base = len(alphabet) + 1
    return [_number([alphabet[d] for d in digits], width, base) for digits in found]


def _spread(lo: int, hi: int, parts: int) -> list[int]:
    points: list[int] = []
    for i in range(1, parts):
        point = lo + (hi - lo) * i // parts
        if lo < point < hi and (not points or point > points[-1]):
            points.append(point)
    return points


_SURROGATES = range(0xD800, 0xE000)
_CODE_POINTS = 0x110000 - len(_SURROGATES)


def _digit(char: str) -> int:
    point = ord(char)
    return point - len(_SURROGATES) if point >= _SURROGATES.stop else point


def _char(digit: int) -> str:
    return chr(digit + len(_SURROGATES) if digit >= _SURROGATES.start else digit)


def _between_digits(lo: list[int], hi: list[int], base: int, parts: int) -> list[list[int]]:
    """Digit strings strictly between ``lo`` and ``hi`` (lexicographic order, as bytes and
    code points compare). Both are read as fractions padded with zeros to one length,
    one digit longer than needed, so there is room between them."""
    width = max(len(lo), len(hi)) + 1
    low = _number(lo, width, base)
    high = _number(hi, width, base)
    # A value above the padded ``lo`` is > lo; one below the padded ``hi`` (of the same
    # width) differs from it within hi's digits, so it is < hi.
    found = _spread(low, high, parts)
    return [_trim(_digits(value, width, base), lo) for value in found]


def _number(digits: list[int], width: int, base: int) -> int:
    value = 0
    for i in range(width):
        value = value * base + (digits[i] if i < len(digits) else 0)
    return value


def _digits(value: int, width: int, base: int) -> list[int]:
    digits = [0] * width
    for i in range(width - 1, -1, -1):
        value, digits[i] = divmod(value, base)
    return digits


def _trim(digits: list[int], lo: list[int]) -> list[int]:
    """Drop trailing zero digits where the shorter string still sorts after ``lo``."""
    while len(digits) > len(lo) and digits[-1] == 0 and digits[:-1] > lo:
        digits = digits[:-1]
    return digits


def _interpolate_tuples(lo: tuple[Scalar, ...], hi: tuple[Scalar, ...], parts: int) -> list[Key]:
    if len(lo) != len(hi):
        raise UnsupportedKey(f"composite keys of different lengths: {lo!r}, {hi!r}")
    for i, (a, b) in enumerate(zip(lo, hi, strict=True)):
        if a != b:
            inner = interpolate(a, b, parts)
            return [(*lo[:i], point, *lo[i + 1 :]) for point in inner]  # type: ignore[arg-type]
    return []


__all__ = [
    "Key",
    "KeyRange",
    "UnsupportedKey",
    "ahead",
    "decode_key",
    "dump_key",
    "encode_key",
    "interpolate",
    "load_key",
    "midpoint",
]
