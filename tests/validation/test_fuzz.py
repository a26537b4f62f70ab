"""Hostile input, generated: every public call of every counter kind, the mapper's options
and ``connect()`` URLs either do what they document or raise a ``ShardkitError`` (an
argument of the wrong type too: a ``ValidationError``, never a ``TypeError``), a refused
call changes nothing, and no password of a URL shows in an error, a log line or a repr.

The oracle works both ways: the documented contract, written out here on its own
(``valid_*``), says which inputs are valid, and a valid input must be accepted and
counted (refused only for what the contract allows: a value past signed 64-bit)."""

from __future__ import annotations

import logging
import math
import re
import threading
import unicodedata
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import shardkit
from backends import PREFIX, numbered_table
from shardkit.counters.buffered import MAX_DELTA
from shardkit.errors import BackendError, CounterOverflow, ShardkitError

_T = TypeVar("_T")

fuzz = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

# Values that are no number, or are numbers of a kind no call takes.
WRONG_TYPES = st.sampled_from([None, "1", b"1", 1.5, [], object()])
NAMES = st.one_of(
    st.just(""),
    st.text(min_size=1, max_size=12),
    st.text(min_size=195, max_size=205),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=20),
    st.sampled_from(["a\x00b", "tab\there", "\x7f", "line\n", "\ud800", "  ", "é", "😀" * 50]),
    st.integers(),
    st.none(),
)
EDGES = [0, 1, -1, 2**40, 2**40 + 1, -(2**40), -(2**40) - 1, 2**62, 2**63 - 1, -(2**63)]
EDGE_DELTAS = st.sampled_from(EDGES)
DELTAS = st.one_of(
    EDGE_DELTAS,
    st.sampled_from([*EDGES, 2**63, -(2**63) - 1, 2**64, True, False, math.inf, math.nan]),
    st.integers(-(2**64), 2**64),
    st.integers(-5, 5),
    st.floats(),
    WRONG_TYPES,
)
NUMBERS = st.one_of(  # shard counts, intervals, chances, block sizes, durations
    st.sampled_from([0, 1, 2, 3, 1000, 1001, -1, 2**40, 2**40 + 1, 10**400]),
    st.sampled_from([math.inf, -math.inf, math.nan, -0.0, 0.0, 1e-9, 0.001, 0.5, 1.0, 1e300]),
    st.integers(-10, 50),
    st.floats(),
    st.booleans(),
    WRONG_TYPES,
)


# -- the documented contract, written out ---------------------------------------------------

MAX_SHARDS = 1000  # connect()'s default max_shards
INT64 = range(-(2**63), 2**63)


def _int_in(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _seconds_in(value: object, low: float, high: float, *, zero: bool = False) -> bool:
    """A number of seconds (an int or a float, not a bool) in ``low`` … ``high``, above 0
    unless ``zero``."""
    if type(value) not in (int, float):
        return False
    number = float(value)  # type: ignore[arg-type]
    return low <= number <= high and (number > 0 or zero)


def valid_name(name: object) -> bool:
    """A counter name or idempotency key: a str of 1 … 200 characters, none of them a
    control character or a surrogate."""
    return (
        isinstance(name, str)
        and 1 <= len(name) <= 200
        and all(unicodedata.category(c) not in ("Cc", "Cs") for c in name)
    )


def valid_delta(delta: object) -> bool:
    return type(delta) is int and delta in INT64


def valid_shards(shards: object) -> bool:
    return shards is None or _int_in(shards, 1, MAX_SHARDS)


def valid_interval(interval: object) -> bool:
    return _seconds_in(interval, 0.001, 30 * 24 * 3600)


def valid_chance(chance: object) -> bool:
    return type(chance) in (int, float) and 0 <= chance <= 1  # type: ignore[operator]


def valid_job(job: object) -> bool:
    return job is None or (isinstance(job, str) and bool(re.fullmatch(r"[\w.:-]{1,64}", job, re.A)))


def attempt(call: Callable[[], _T], *, valid: bool = False) -> tuple[bool, _T | None]:
    """Run ``call``: (True, its result), or (False, None) when it raised a ShardkitError
    other than a BackendError (the services are up: no input may break them). A
    ``valid`` call may only be refused with ``CounterOverflow``. Anything else (a
    ``TypeError`` too) fails the test."""
    try:
        return True, call()
    except BackendError:
        raise
    except CounterOverflow:
        return False, None
    except ShardkitError as exc:
        if valid:
            pytest.fail(f"a call valid by the documented contract was refused: {exc!r}")
        return False, None


def _open(open_: Callable[[], _T], name: object, valid: bool) -> _T | None:
    """The counter ``open_()`` opens, or None when it refused (a bad name or option);
    ``valid`` options must open it (each test opens one kind only)."""
    opened, counter = attempt(open_, valid=valid)
    if opened:
        assert isinstance(name, str)
        assert name
    return counter


OPS = st.lists(st.tuples(st.sampled_from(["incr", "decr"]), DELTAS), min_size=1, max_size=8)
KEYS = st.one_of(st.none(), NAMES)


@fuzz
@given(name=NAMES, shards=st.one_of(st.none(), NUMBERS), ops=OPS, key=KEYS, grow=NUMBERS)
@example(  # one shard taken past signed 64-bit, either way
    name="fz:full",
    shards=1,
    ops=[("incr", 2**63 - 1), ("incr", 1), ("decr", -(2**63 - 1)), ("decr", 2**63 - 1)],
    key=None,
    grow=2,
).via("a shard's overflow")
def test_sharded_counters(
    big: shardkit.Kit, name: Any, shards: Any, ops: list[tuple[str, Any]], key: Any, grow: Any
) -> None:
    counter = _open(
        lambda: big.sharded(name, shards),
        name,
        valid_name(name) and valid_shards(shards),
    )
    if counter is None:
        return
    for op, delta in ops:
        before = counter.value(fresh=True)
        valid = valid_delta(delta) and (key is None or valid_name(key))
        done, applied = attempt(
            partial(getattr(counter, op), delta, key=key),
            valid=valid and (op == "incr" or delta != -(2**63)),  # -delta must fit too
        )
        after = counter.value(fresh=True)
        if done and key is None:
            assert applied, (op, delta)  # only a key applied before makes a call count nothing
        if not done or not applied:
            assert after == before, (op, delta, key)
        else:
            assert after == before + (delta if op == "incr" else -delta), (op, delta)
            assert after == counter.value()  # the cached value followed
    before_shards = counter.shards
    done, _ = attempt(partial(counter.grow, grow), valid=valid_shards(grow))
    assert counter.shards == (max(before_shards, grow) if done else before_shards)


@fuzz
@given(name=NAMES, interval=NUMBERS, ops=OPS, flush=st.sampled_from(["flush", "flush_all", None]))
def test_buffered_counters(
    big: shardkit.Kit, name: Any, interval: Any, ops: list[tuple[str, Any]], flush: Any
) -> None:
    counter = _open(
        lambda: big.buffered(name, interval),
        name,
        valid_name(name) and valid_interval(interval),
    )
    if counter is None:
        return
    for op, delta in ops:
        before = counter.value()
        done, _ = attempt(
            partial(getattr(counter, op), delta),
            valid=type(delta) is int and abs(delta) <= MAX_DELTA,  # its documented bound
        )
        after = counter.value()
        if done:
            assert abs(delta) <= MAX_DELTA
            assert after == before + (delta if op == "incr" else -delta), (op, delta)
        else:
            assert after == before, (op, delta)
    value = counter.value()
    if flush == "flush":
        counter.flush()
    elif flush == "flush_all":
        big.flush_all()
    assert counter.value() == value
    if flush:
        assert counter.parts() == (value, 0)


@fuzz
@given(
    name=NAMES,
    shards=st.one_of(st.none(), NUMBERS),
    chance=NUMBERS,
    deltas=st.lists(DELTAS, max_size=6),
)
def test_monotonic_counters(
    big: shardkit.Kit, name: Any, shards: Any, chance: Any, deltas: list[Any]
) -> None:
    counter = _open(
        lambda: big.monotonic(name, shards, chance),
        name,
        valid_name(name) and valid_shards(shards) and valid_chance(chance),
    )
    if counter is None:
        return
    for delta in deltas:
        before = counter.value()
        done, value = attempt(
            partial(counter.incr, delta),
            valid=valid_delta(delta) and delta >= 1,  # it counts up only
        )
        if done:
            assert value == before + delta == counter.value()
            assert delta >= 1
        else:
            assert counter.value() == before, delta
    assert counter.persisted() <= counter.value()


@fuzz
@given(name=NAMES, block=NUMBERS, counts=st.lists(NUMBERS, max_size=4))
def test_id_allocators(big: shardkit.Kit, name: Any, block: Any, counts: list[Any]) -> None:
    allocator = _open(
        lambda: big.ids(name, block),
        name,
        valid_name(name) and _int_in(block, 1, 2**40),
    )
    if allocator is None:
        return
    handed: list[int] = []
    for count in counts:
        if isinstance(count, int) and count > 50:
            continue  # a valid count, only slow
        reserved = allocator.reserved()
        done, ids = attempt(
            partial(allocator.take, count),
            valid=_int_in(count, 1, 1_000_000),
        )
        if done:
            assert ids is not None
            assert len(ids) == max(count, 0)
            handed += ids
        else:
            assert allocator.reserved() == reserved
    assert handed == sorted(set(handed))
    assert all(0 < i <= allocator.reserved() for i in handed)


@fuzz
@given(names=st.lists(NAMES, max_size=4), one=NAMES)
def test_reading_many_counters(big: shardkit.Kit, names: list[Any], one: Any) -> None:
    for read in (big.values, big.parts):
        done, found = attempt(partial(read, names), valid=all(map(valid_name, names)))
        if done:
            assert found is not None
            assert set(found) == set(names)
    done, counter = attempt(lambda: big.get(one))
    if done:
        assert counter is not None
        assert counter.name == one


ROWS = 7
JOB_IDS = st.one_of(
    st.none(),
    st.from_regex(r"[A-Za-z0-9_.:-]{1,40}", fullmatch=True),
    st.text(max_size=70),
    st.sampled_from(["", "a" * 65, "a b", "job\x00", "é", "../x"]),
    st.integers(),
)
MAPPER_OPTIONS = st.one_of(
    st.sampled_from([0, 1, 2, 64, 65, 1000, 1001, 100_000, 100_001, -1, 10**400]),
    st.integers(-3, 10),
    st.booleans(),
    WRONG_TYPES,
    st.floats(),
)


@pytest.fixture
def tiny_table(big: shardkit.Kit) -> Iterator[sa.Table]:
    with numbered_table(big.store.engine, "fz_rows", ROWS) as table:  # type: ignore[attr-defined]
        yield table


@fuzz
@given(page_size=MAPPER_OPTIONS, fanout=MAPPER_OPTIONS, retries=MAPPER_OPTIONS, job=JOB_IDS)
def test_mapper_options(
    big: shardkit.Kit,
    tiny_table: sa.Table,
    page_size: Any,
    fanout: Any,
    retries: Any,
    job: Any,
) -> None:
    if isinstance(job, str) and len(job) <= 40 and job.isascii() and job.isprintable():
        job = f"{job}-{uuid.uuid4().hex[:12]}"  # a valid id would resume an earlier job
    seen: list[int] = []
    lock = threading.Lock()

    def visit(batch: shardkit.Batch) -> None:
        with lock:
            seen.extend(row["id"] for row in batch.rows)

    jobs = len(big.jobs())
    done, started = attempt(
        lambda: big.map(
            tiny_table, visit, page_size=page_size, fanout=fanout, retries=retries, job=job
        ),
        valid=_int_in(page_size, 1, 100_000)
        and _int_in(fanout, 1, 64)
        and _int_in(retries, 0, 1000)
        and valid_job(job),
    )
    if not done:
        assert len(big.jobs()) == jobs
        return
    assert started is not None
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


@fuzz
@given(
    prefix=st.one_of(st.just(PREFIX), st.text(max_size=50), st.integers(), st.none()),
    cache_ttl=NUMBERS,
    max_shards=NUMBERS,
    key_retention=NUMBERS,
)
def test_kit_options(
    store_url: str, cache_url: str, prefix: Any, cache_ttl: Any, max_shards: Any, key_retention: Any
) -> None:
    if prefix != PREFIX and isinstance(prefix, str) and prefix.isidentifier():
        prefix = f"{prefix[:20]}{PREFIX}"  # tables nobody drops otherwise: leave them alone
        if prefix.isidentifier():
            prefix = "1" + prefix  # refused: an identifier would create tables here
    done, kit = attempt(
        lambda: shardkit.connect(
            store_url,
            cache_url,
            prefix=prefix,
            cache_ttl=cache_ttl,
            max_shards=max_shards,
            key_retention=key_retention,
        ),
        valid=prefix == PREFIX
        and _seconds_in(cache_ttl, 0, 30 * 24 * 3600)
        and _seconds_in(key_retention, 0, 100 * 365 * 24 * 3600, zero=True)
        and _int_in(max_shards, 1, 10**400),
    )
    if done:
        assert kit is not None
        kit.close()
        assert prefix == PREFIX
        assert cache_ttl > 0
        assert key_retention >= 0
        assert max_shards >= 1


def test_sqlite_paths_are_errors_not_crashes(tmp_path: Path) -> None:
    for url in (f"sqlite:///{tmp_path}/no/such/dir/x.db", f"sqlite:///{tmp_path}"):
        with pytest.raises(ShardkitError):
            shardkit.connect(url, "memory://", prefix=PREFIX)
