"""Hostile input, generated: every public call of every counter kind, the mapper's options
and ``connect()``'s options and URLs do what the documented contract says of their
arguments, and no password of a URL shows in an error, a log line or a repr.

The contract is written out here on its own (``refused_*``, from ``docs/reference``, the
public docstrings and ``shardkit.errors``), not taken from ``shardkit.validation``, and
it holds both ways: an argument it refuses makes the call raise that error (its class
exactly, its message saying what the example tests of ``test_validation.py`` read there)
and change nothing; a call whose arguments it accepts is done (refused only with a
``CounterOverflow`` it foresees). Every generator mixes the values on both sides of each
bound (one below, at, one above; the float next to it) with huge ints, bools, odd floats
and values of no number type; names mix the length limit's edges, control characters and
surrogates with the characters next to them."""

from __future__ import annotations

import logging
import math
import re
import threading
import unicodedata
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import shardkit
from backends import PREFIX, drop_tables, numbered_table, shard_values
from shardkit.errors import (
    ConfigurationError,
    CounterNotFound,
    CounterOverflow,
    InvalidDelta,
    InvalidName,
    InvalidShardCount,
    KeysUnsupported,
    ShardkitError,
    ValidationError,
)

_T = TypeVar("_T")

fuzz = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


# -- the documented contract, written out ---------------------------------------------------

MAX_NAME = 200
MAX_SHARDS = 1000  # connect()'s default max_shards
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_BUFFERED_DELTA = 2**40  # one call of a buffered counter's incr
MAX_BLOCK = 2**40
MAX_TAKE = 1_000_000
DAYS_30 = 30 * 24 * 3600  # memcached's longest TTL
YEARS_100 = 100 * 365 * 24 * 3600


@dataclass(frozen=True)
class Refused:
    """A refusal the contract states: ``error`` exactly (not a subclass), its message
    matching ``says`` (a regular expression)."""

    error: type[ShardkitError]
    says: str = ""

    def matches(self, exc: ShardkitError) -> bool:
        return type(exc) is self.error and re.search(self.says, str(exc)) is not None


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def refused_name(name: object, what: str = "counter name") -> Refused | None:
    """A counter name or idempotency key is a ``str`` of 1 … 200 characters, none of them
    a control character (Unicode's Cc) or a lone surrogate (Cs): else ``InvalidName``,
    whose message names an idempotency key as one, and states the limit to a name that is
    only too long."""
    clean = isinstance(name, str) and all(unicodedata.category(c) not in ("Cc", "Cs") for c in name)
    long = isinstance(name, str) and len(name) > MAX_NAME
    if clean and 1 <= len(name) <= MAX_NAME:  # type: ignore[arg-type]
        return None
    says = f"limit is {MAX_NAME}" if clean and long else ""
    return Refused(InvalidName, f"{what}.*{says}" if what == "idempotency key" else says)


def refused_names(names: object) -> list[Refused | None]:
    """Many names are given as an iterable of names, never one ``str`` (or ``bytes``)."""
    if isinstance(names, str | bytes) or not isinstance(names, Iterable):
        return [Refused(InvalidName, "iterable of counter names")]
    return [refused_name(name) for name in names]


def refused_delta(delta: object, low: int = INT64_MIN, high: int = INT64_MAX) -> Refused | None:
    """A delta is an int, not a bool, in ``low`` … ``high`` (signed 64-bit unless the
    kind says less): else ``InvalidDelta``."""
    return None if _int(delta) and low <= delta <= high else Refused(InvalidDelta)  # type: ignore[operator]


def refused_shards(shards: object, maximum: int = MAX_SHARDS) -> Refused | None:
    """A shard count is an int in 1 … the kit's ``max_shards``: else
    ``InvalidShardCount``, whose message states the range to an int outside it."""
    if not _int(shards):
        return Refused(InvalidShardCount)
    return None if 1 <= shards <= maximum else Refused(InvalidShardCount, rf"1\.\.{maximum}")  # type: ignore[operator]


def refused_int(value: object, what: str, low: int, high: int) -> Refused | None:
    """An int, not a bool, in ``low`` … ``high``: else a ``ValidationError`` naming it."""
    return None if _int(value) and low <= value <= high else Refused(ValidationError, what)  # type: ignore[operator]


def refused_number(
    value: object, what: str, low: float, high: float, *, zero: bool = True
) -> Refused | None:
    """A number (an int or a float, not a bool) in ``low`` … ``high``, and above 0 unless
    ``zero``: else a ``ValidationError`` naming it."""
    if _number(value) and low <= value <= high and (zero or value > 0):  # type: ignore[operator]
        return None
    return Refused(ValidationError, what)


def refused_job(job: object) -> Refused | None:
    """A job id is 1 … 64 ASCII letters, digits and ``_.:-``, or None (a new one)."""
    if job is None or (isinstance(job, str) and re.fullmatch(r"[\w.:-]{1,64}", job, re.A)):
        return None
    return Refused(ValidationError, "job id")


# A kit's durations: (low, high, whether 0 is taken, how the message states the limits).
KIT_DURATIONS = {
    "cache_ttl": (0, DAYS_30, False, r"≤ 2,592,000 s \(30 days\)"),
    "key_retention": (0, YEARS_100, True, r"≥ 0 s and ≤ 3,153,600,000 s \(100 years\)"),
    "adjust_delay": (0, 60, True, r"≤ 60 s \(1 minute\)"),
}


def refused_kit_option(option: str, value: object) -> Refused | None:
    """A kit's options: ``prefix`` an identifier of at most 40 characters, ``max_shards``
    an int ≥ 1, each duration finite seconds in its range (``KIT_DURATIONS``); else a
    ``ConfigurationError`` naming the option (a duration's stating its limits, whole
    numbers with units)."""
    if option == "prefix":
        good = isinstance(value, str) and value.isidentifier() and len(value) <= 40
        says = "prefix"
    elif option == "max_shards":
        good = _int(value) and value >= 1  # type: ignore[operator]
        says = "max_shards"
    else:
        low, high, zero, limits = KIT_DURATIONS[option]
        good = refused_number(value, option, low, high, zero=zero) is None
        says = f"{option}.*{limits}"
    return None if good else Refused(ConfigurationError, says)


def outcome(
    call: Callable[[], _T], *verdicts: Refused | None, may: Refused | None = None
) -> tuple[bool, _T | None]:
    """Run ``call`` and hold it to the contract: ``verdicts`` judge its arguments (None:
    good). If one refuses, the call must raise one of those refusals (the contract does
    not order its checks); if none, it must be done, or raise ``may`` (what the test
    cannot foresee: a shard row's overflow). (True, its result), or (False, None) when
    refused; anything else fails the test: an accepted call the contract refuses, a
    refused one it accepts, another error (a ``TypeError``, a ``BackendError``: the
    services are up)."""
    refusals = [verdict for verdict in verdicts if verdict is not None]
    try:
        result = call()
    except ShardkitError as exc:
        allowed = refusals or ([] if may is None else [may])
        if not any(refused.matches(exc) for refused in allowed):
            pytest.fail(f"refused with {exc!r}; the contract says {refusals or 'done'}")
        return False, None
    if refusals:
        pytest.fail(f"done ({result!r}), though the contract refuses it: {refusals}")
    return True, result


def opened(kit: shardkit.Kit, open_: Callable[[], _T], *verdicts: Refused | None) -> _T | None:
    """What ``open_()`` opens, as ``outcome`` holds it to the contract, or None when it
    is refused: then no counter was made or changed."""
    counters = kit.counters() if any(verdicts) else None
    _, counter = outcome(open_, *verdicts)
    if counter is None:
        assert kit.counters() == counters
    return counter


# -- generated arguments ----------------------------------------------------------------
# The generators lean to the edges: half of the numbers lie next to a bound, half of the
# names are made to break a rule; the contract judges every value all the same.
# Each test calls with every drawn value alone beside good arguments (``PROBE``, the
# defaults), and with the drawn values together.

WRONG_TYPES = st.sampled_from([None, "1", b"1", [], object(), 1j])
# Past every bound: beyond signed 64-bit and beyond a float; floats no count is.
HUGE = [INT64_MAX, INT64_MAX + 1, INT64_MIN, INT64_MIN - 1, 2**64, 10**400, -(10**400)]
ODD_FLOATS = [math.inf, -math.inf, math.nan, -0.0, 5e-324, -5e-324, 1e300, -1e300]


def around(*bounds: float, whole: bool) -> list[float]:
    """Each bound and what lies next to it: the ints one apart (of an int bound) and,
    unless ``whole`` (where only ints are taken), the bound as a float and the floats
    next to it."""
    near: list[float] = []
    for bound in bounds:
        if isinstance(bound, int):
            near += [bound - 1, bound, bound + 1]
        if not whole:
            near += [
                math.nextafter(bound, -math.inf),
                float(bound),
                math.nextafter(bound, math.inf),
            ]
    return near


def numbers(*bounds: float, whole: bool = True) -> st.SearchStrategy[Any]:
    """Values for an argument bounded by ``bounds``: half of them next to a bound, the
    others bools, the bounds as floats, huge ints, odd floats, any int, any float, or no
    number at all."""
    edges = st.sampled_from(around(*bounds, whole=whole))
    others = st.one_of(
        st.booleans(),
        st.sampled_from([*map(float, bounds), *HUGE, *ODD_FLOATS]),
        st.integers(),
        st.floats(),
        WRONG_TYPES,
    )
    return st.booleans().flatmap(lambda edge: edges if edge else others)


def some(values: st.SearchStrategy[_T]) -> st.SearchStrategy[list[_T]]:
    """A few values: each is tried alone, the first with the others."""
    return st.lists(values, min_size=1, max_size=3)


GOOD_CHARS = st.characters(exclude_categories=["Cc", "Cs"])
# Control characters (Cc) and surrogates (Cs): the whitespace a name most often gets by
# mistake, the other ends of each range, any.
BAD_CHARS = st.one_of(
    st.sampled_from(["\t", "\n"]),
    st.sampled_from(["\r", "\x00", "\x1f", "\x7f", "\x80", "\x9f", "\ud800", "\udfff"]),
    st.characters(categories=["Cc", "Cs"]),
)
# The characters next to those: a name may hold them.
NEXT_TO_BAD = [" ", "~", "\xa0", "\u200b", "\u2028", "\ud7ff", "\ue000", "\ufeff"]
NAMES_FINE = st.one_of(
    st.sampled_from(["x" * MAX_NAME, "😀" * MAX_NAME, "é" * (MAX_NAME - 1), "a", *NEXT_TO_BAD]),
    st.text(GOOD_CHARS, min_size=MAX_NAME - 1, max_size=MAX_NAME),
    st.text(max_size=20),
)
NAMES_HOSTILE = st.one_of(
    st.tuples(st.text(GOOD_CHARS, max_size=4), BAD_CHARS, st.text(GOOD_CHARS, max_size=4)).map(
        "".join
    ),
    st.sampled_from(["", "x" * (MAX_NAME + 1), "😀" * (MAX_NAME + 1)]),
    st.text(GOOD_CHARS, min_size=MAX_NAME + 1, max_size=MAX_NAME + 2),
    st.sampled_from([42, None, b"name", 1.5, ["name"]]),
)
NAMES = st.booleans().flatmap(lambda fine: NAMES_FINE if fine else NAMES_HOSTILE)
KEYS = st.one_of(st.none(), NAMES)
DELTAS = st.one_of(
    numbers(0, 1, MAX_BUFFERED_DELTA, -MAX_BUFFERED_DELTA, INT64_MAX, INT64_MIN),
    st.integers(-5, 5),
)
SHARDS = numbers(1, MAX_SHARDS)
SHARDS_OR_DEFAULT = st.one_of(st.sampled_from([None, "auto"]), SHARDS)
PROBE = "fz:probe"  # a good name, for the calls that try one other argument


def judge_shards(shards: object, *, auto: bool) -> Refused | None:
    """None takes the default shards, and so does "auto" where the call takes it."""
    if shards is None or (auto and isinstance(shards, str) and shards == "auto"):
        return None
    return refused_shards(shards)


@fuzz
@given(
    name=NAMES,
    shards=some(SHARDS_OR_DEFAULT),
    ops=st.lists(st.tuples(st.sampled_from([1, -1]), DELTAS, KEYS), min_size=1, max_size=8),
    grows=st.lists(SHARDS, max_size=3),
)
@example(  # one shard taken past signed 64-bit, either way
    name="fz:full",
    shards=[1],
    ops=[(1, INT64_MAX, None), (1, 1, None), (-1, -INT64_MAX, None), (-1, INT64_MAX, None)],
    grows=[2],
).via("a shard's overflow")
@pytest.mark.pairs
def test_sharded_counters(
    big: shardkit.Kit,
    name: Any,
    shards: list[Any],
    ops: list[tuple[int, Any, Any]],
    grows: list[Any],
) -> None:
    """``ops`` are (1: ``incr`` or -1: ``decr``, delta, idempotency key)."""
    opened(big, partial(big.sharded, name), refused_name(name))
    for alone in shards:
        opened(big, partial(big.sharded, PROBE, alone), judge_shards(alone, auto=True))
    counter = opened(
        big,
        partial(big.sharded, name, shards[0]),
        refused_name(name),
        judge_shards(shards[0], auto=True),
    )
    if counter is None:
        return
    for sign, delta, key in ops:
        before = counter.value(fresh=True)
        verdict = refused_delta(delta)
        if verdict is None:
            verdict = refused_delta(sign * delta)  # decr(-2**63): the negation must fit too
        overflow = verdict is None and any(
            not INT64_MIN <= row + sign * delta <= INT64_MAX
            for row in [*shard_values(big, "shards", name).values(), 0]
        )
        write = counter.incr if sign == 1 else counter.decr
        done, applied = outcome(
            partial(write, delta, key=key),
            verdict,
            None if key is None else refused_name(key, "idempotency key"),
            may=Refused(CounterOverflow) if overflow else None,
        )
        after = counter.value(fresh=True)
        if done and key is None:
            assert applied, (sign, delta)  # only a key applied before makes a call count nothing
        if done and applied:
            assert after == before + sign * delta, (sign, delta)
            assert after == counter.value()  # the cached value followed
        else:
            assert after == before, (sign, delta, key)
    for grow in grows:
        before = counter.shards
        done, _ = outcome(partial(counter.grow, grow), refused_shards(grow))
        assert counter.shards == (max(before, grow) if done else before), grow


INTERVALS = numbers(0.001, DAYS_30, whole=False)
STRIPES = st.one_of(st.none(), numbers(1, 256))


@fuzz
@given(
    name=NAMES,
    intervals=some(INTERVALS),
    stripes=some(STRIPES),
    ops=st.lists(st.tuples(st.sampled_from([1, -1]), DELTAS, KEYS), min_size=1, max_size=8),
    flush=st.sampled_from(["flush", "flush_all", None]),
)
@pytest.mark.pairs
def test_buffered_counters(
    big: shardkit.Kit,
    name: Any,
    intervals: list[Any],
    stripes: list[Any],
    ops: list[tuple[int, Any, Any]],
    flush: Any,
) -> None:
    """``ops`` are (1: ``incr`` or -1: ``decr``, delta, idempotency key); memcached
    refuses every key."""

    def judge_interval(interval: object) -> Refused | None:
        return refused_number(interval, "interval", 0.001, DAYS_30)

    def judge_stripes(count: object) -> Refused | None:
        return None if count is None else refused_int(count, "stripes", 1, 256)

    opened(big, partial(big.buffered, name), refused_name(name))
    for interval in intervals:
        opened(big, partial(big.buffered, PROBE, interval), judge_interval(interval))
    for count in stripes:
        opened(big, partial(big.buffered, PROBE, stripes=count), judge_stripes(count))
    counter = opened(
        big,
        partial(big.buffered, name, intervals[0], stripes[0]),
        refused_name(name),
        judge_interval(intervals[0]),
        judge_stripes(stripes[0]),
    )
    if counter is None:
        return
    unkeyed = Refused(KeysUnsupported, "cannot record an idempotency key")
    memcached = big.cache.url.startswith("memcached://")
    for sign, delta, key in ops:
        before = counter.value()
        write = counter.incr if sign == 1 else counter.decr
        done, applied = outcome(
            partial(write, delta, key=key),
            refused_delta(delta, -MAX_BUFFERED_DELTA, MAX_BUFFERED_DELTA),
            None if key is None else refused_name(key, "idempotency key"),
            unkeyed if key is not None and memcached else None,
        )
        if done and key is None:
            assert applied, (sign, delta)  # only a key counted before makes it count nothing
        counted = done and applied
        assert counter.value() == (before + sign * delta if counted else before), (sign, delta)
    value = counter.value()
    if flush == "flush":
        counter.flush()
    elif flush == "flush_all":
        big.flush_all()
    assert counter.value() == value
    if flush:
        assert counter.parts() == (value, 0)


CHANCES = numbers(0, 1, whole=False)


@fuzz
@given(
    name=NAMES,
    shards=some(SHARDS_OR_DEFAULT),
    chances=some(CHANCES),
    deltas=st.lists(DELTAS, max_size=6),
)
@pytest.mark.pairs
def test_monotonic_counters(
    big: shardkit.Kit, name: Any, shards: list[Any], chances: list[Any], deltas: list[Any]
) -> None:
    def judge_chance(chance: object) -> Refused | None:
        return refused_number(chance, "chance_to_write", 0, 1)

    opened(big, partial(big.monotonic, name), refused_name(name))
    for alone in shards:
        opened(big, partial(big.monotonic, PROBE, alone), judge_shards(alone, auto=False))
    for chance in chances:
        opened(big, partial(big.monotonic, PROBE, None, chance), judge_chance(chance))
    counter = opened(
        big,
        partial(big.monotonic, name, shards[0], chances[0]),
        refused_name(name),
        judge_shards(shards[0], auto=False),
        judge_chance(chances[0]),
    )
    if counter is None:
        return
    for delta in deltas:
        before = counter.value()
        verdict = refused_delta(delta, 1, INT64_MAX)  # it counts up only
        if verdict is None and before + delta > INT64_MAX:
            verdict = Refused(CounterOverflow)
        done, value = outcome(partial(counter.incr, delta), verdict)
        assert counter.value() == (before + delta if done else before), delta
        if done:
            assert value == before + delta
    assert counter.persisted() <= counter.value()


BLOCKS = numbers(1, MAX_BLOCK)
COUNTS = numbers(1, MAX_TAKE)


@fuzz
@given(name=NAMES, blocks=some(BLOCKS), counts=st.lists(COUNTS, max_size=4))
@pytest.mark.pairs
def test_id_allocators(big: shardkit.Kit, name: Any, blocks: list[Any], counts: list[Any]) -> None:
    def judge_block(block: object) -> Refused | None:
        return refused_int(block, "block", 1, MAX_BLOCK)

    opened(big, partial(big.ids, name), refused_name(name))
    for block in blocks:
        opened(big, partial(big.ids, PROBE, block), judge_block(block))
    allocator = opened(
        big, partial(big.ids, name, blocks[0]), refused_name(name), judge_block(blocks[0])
    )
    if allocator is None:
        return
    handed: list[int] = []
    for count in counts:
        verdict = refused_int(count, "count", 1, MAX_TAKE)
        if verdict is None and count > 50:
            continue  # a good count, only slow
        reserved = allocator.reserved()
        done, ids = outcome(partial(allocator.take, count), verdict)
        if done:
            assert ids is not None
            assert len(ids) == count
            handed += ids
        else:
            assert allocator.reserved() == reserved
    assert handed == sorted(set(handed))
    assert all(0 < i <= allocator.reserved() for i in handed)


@fuzz
@given(names=st.one_of(st.lists(NAMES, max_size=6), st.lists(NAMES, max_size=6).map(tuple), NAMES))
@pytest.mark.pairs
def test_reading_many_counters(big: shardkit.Kit, names: Any) -> None:
    """No counter exists: every name reads 0, and ``get`` finds none."""
    if isinstance(names, list | tuple):
        for name in names:
            outcome(partial(big.values, [name]), refused_name(name))
            outcome(partial(big.get, name), refused_name(name) or Refused(CounterNotFound))
    for read, nothing in ((big.values, 0), (big.parts, (0, 0))):
        done, found = outcome(partial(read, names), *refused_names(names))
        if done:
            assert found == dict.fromkeys(names, nothing)


ROWS = 7
JOB_IDS = st.one_of(
    st.none(),
    st.from_regex(r"[A-Za-z0-9_.:-]{1,64}", fullmatch=True),
    st.text(max_size=70),
    st.sampled_from(["", "a" * 64, "a" * 65, "a b", "job\x00", "é", "../x", "a\n"]),
    st.integers(),
)
MAPPER_LIMITS = {"page_size": (1, 100_000), "fanout": (1, 64), "retries": (0, 1000)}
MAPPER_OPTIONS = st.fixed_dictionaries(
    {option: numbers(*limits) for option, limits in MAPPER_LIMITS.items()}
)


def judge_mapping(option: str, value: object) -> Refused | None:
    return refused_int(value, option, *MAPPER_LIMITS[option])


@pytest.fixture
def tiny_table(big: shardkit.Kit) -> Iterator[sa.Table]:
    with numbered_table(big.store.engine, "fz_rows", ROWS) as table:  # type: ignore[attr-defined]
        yield table


@pytest.fixture
def done_job(big: shardkit.Kit, tiny_table: sa.Table) -> str:
    """A job that is complete: starting it again resumes it, at once."""
    job = f"fz-done-{uuid.uuid4().hex[:12]}"
    big.map(tiny_table, lambda batch: None, job=job).wait(timeout=120)
    return job


@fuzz
@given(
    options=MAPPER_OPTIONS,
    alone=st.lists(
        st.sampled_from(list(MAPPER_LIMITS)).flatmap(
            lambda option: st.tuples(st.just(option), numbers(*MAPPER_LIMITS[option]))
        ),
        max_size=3,
    ),
    job=JOB_IDS,
)
@pytest.mark.pairs
def test_mapper_options(
    big: shardkit.Kit,
    tiny_table: sa.Table,
    done_job: str,
    options: dict[str, Any],
    alone: list[tuple[str, Any]],
    job: Any,
) -> None:
    """Each option alone starts the complete ``done_job`` again, which changes nothing;
    together (or, when they are refused, the job id alone) they start a job of its own,
    which visits every row."""
    if isinstance(job, str) and refused_job(job) is None:
        unique = f"-{uuid.uuid4().hex[:12]}"  # a job id used before would resume that job
        job = job[: max(len(job) - len(unique), 1)] + unique  # as long, and as good
    seen: list[int] = []
    lock = threading.Lock()

    def visit(batch: shardkit.Batch) -> None:
        with lock:
            seen.extend(row["id"] for row in batch.rows)

    jobs = len(big.jobs())
    for option, value in [*options.items(), *alone]:
        outcome(
            partial(big.map, tiny_table, visit, job=done_job, **{option: value}),
            judge_mapping(option, value),
        )
    assert len(big.jobs()) == jobs
    _, started = outcome(
        partial(big.map, tiny_table, visit, job=job, **options),
        *(judge_mapping(option, value) for option, value in options.items()),
        refused_job(job),
    )
    if started is None and job is not None:  # the job id alone
        assert len(big.jobs()) == jobs
        _, started = outcome(partial(big.map, tiny_table, visit, job=job), refused_job(job))
    if started is None:
        assert len(big.jobs()) == jobs
        return
    status = started.wait(timeout=120)
    assert set(seen) == set(range(1, ROWS + 1))
    assert status.rows == ROWS


# -- connect() URLs ---------------------------------------------------------------------

PASSWORDS = st.text(
    alphabet=st.sampled_from("@:;%+ !$&'()*,=[]~é€\\\"<>{}|^`"), min_size=1, max_size=8
).map(lambda odd: f"Pw{odd}Zq9")
SCHEMES = st.sampled_from(
    [
        "postgresql",
        "postgresql+psycopg",
        "postgresql+nosuchdriver",
        "mysql+pymysql",
        "mysql",
        "sqlite",
        "redis",
        "rediss",
        "memcached",
        "memory",
        "nosuch",
        "",
        "http",
    ]
)
HOSTS = st.sampled_from(["127.0.0.1", "localhost", "[::1]", "", "bad host", "[::1", "h%zz"])
PORTS = st.sampled_from(["", ":1", ":0", ":65536", ":99999", ":-1", ":abc", ":", ":1.5", ":\uff12"])
USERS = st.sampled_from(["", "u", "postgres", "root", "us er", "ü"])


@st.composite
def urls(draw: st.DrawFn) -> tuple[str, str]:
    """A URL that reaches no server but its own (refused ports and broken URLs only: a
    driver talking to another service's port may wait for its timeout), and its
    password."""
    password = draw(PASSWORDS)
    written = draw(st.sampled_from([quote(password, safe=""), password]))
    user = draw(USERS)
    userinfo = draw(st.sampled_from([f"{user}:{written}@", f":{written}@"]))
    path = draw(st.sampled_from(["test", "0", "", "x?y=1"]))
    url = f"{draw(SCHEMES)}://{userinfo}{draw(HOSTS)}{draw(PORTS)}/{path}"
    return url, password


def _secret_free(text: str, password: str) -> None:
    for form in {password, quote(password, safe=""), quote(password)}:
        assert form not in text, text


@fuzz
@given(url=urls(), role=st.sampled_from(["store", "cache"]))
@pytest.mark.pairs
def test_connect_urls(
    store_url: str,
    cache_url: str,
    url: tuple[str, str],
    role: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    text, password = url
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="shardkit"):
        try:
            if role == "store":
                kit = shardkit.connect(text, cache_url, prefix=PREFIX)
            else:
                kit = shardkit.connect(store_url, text, prefix=PREFIX)
        except ShardkitError as exc:
            _secret_free(f"{exc} {exc!r} {exc.__cause__!r}", password)
        else:
            with kit:
                _secret_free(repr(kit), password)
    _secret_free(caplog.text, password)


# A prefix of this worker's own, 40 characters long, and one too long.
LONGEST_PREFIX = PREFIX.ljust(40, "x")
KIT_OPTIONS = st.fixed_dictionaries(
    {
        "prefix": st.one_of(
            st.sampled_from([PREFIX, LONGEST_PREFIX, LONGEST_PREFIX + "x", "", "1x", "a-b"]),
            st.text(max_size=50),
            st.integers(),
            st.none(),
        ),
        "max_shards": numbers(1),
        **{option: numbers(*limits[:2], whole=False) for option, limits in KIT_DURATIONS.items()},
    }
)


def connecting(store_url: str, cache_url: str, options: dict[str, Any]) -> None:
    """Connect with ``options`` as ``outcome`` holds it to the contract; close the kit
    it opens, dropping the tables of a prefix other than the session's."""
    _, kit = outcome(
        partial(shardkit.connect, store_url, cache_url, **options),
        *(refused_kit_option(option, value) for option, value in options.items()),
    )
    if kit is not None:
        kit.close()
        if options["prefix"] != PREFIX:
            drop_tables([store_url], options["prefix"])


@fuzz
@given(options=KIT_OPTIONS)
def test_kit_options(store_url: str, cache_url: str, options: dict[str, Any]) -> None:
    connecting(store_url, cache_url, _own_prefix(options))


@fuzz
@given(options=KIT_OPTIONS)
def test_each_kit_option(sqlite_url: str, options: dict[str, Any]) -> None:
    """Each option alone, beside the session's prefix (checked before a backend is
    opened: on the embedded ones)."""
    for option, value in _own_prefix(options).items():
        connecting(sqlite_url, "memory://", {"prefix": PREFIX, option: value})


def _own_prefix(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` whose good prefix, unless it is one of the session's, is made bad: it
    would make tables nobody drops."""
    prefix = options["prefix"]
    if prefix not in (PREFIX, LONGEST_PREFIX) and refused_kit_option("prefix", prefix) is None:
        prefix = f"1{prefix}"
    return {**options, "prefix": prefix}


def test_sqlite_paths_are_errors_not_crashes(tmp_path: Path) -> None:
    for url in (f"sqlite:///{tmp_path}/no/such/dir/x.db", f"sqlite:///{tmp_path}"):
        with pytest.raises(ShardkitError):
            shardkit.connect(url, "memory://", prefix=PREFIX)
