"""Bad input gets a typed ShardkitError before anything is written."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

import shardkit
import shardkit.aio
from backends import PREFIX
from shardkit.cache import open_cache
from shardkit.errors import (
    BackendUnavailable,
    ConfigurationError,
    InvalidDelta,
    InvalidName,
    InvalidShardCount,
    MissingDriver,
    ShardkitError,
    ValidationError,
)
from shardkit.kit import build
from shardkit.store import open_store

BAD_NAMES = ["", "x" * 201, "a\x00b", "line\nbreak", "tab\t", "del\x7f", "\ud800", 42, None, b"n"]
BAD_DELTAS = [True, False, 1.0, 0.5, "1", None, 2**63, -(2**63) - 1, 10**30]


@pytest.fixture
def kit(sqlite_url: str) -> Iterator[shardkit.Kit]:
    with shardkit.connect(sqlite_url, prefix=PREFIX, max_shards=64) as the_kit:
        yield the_kit


def test_every_error_is_a_shardkit_error() -> None:
    for error in (InvalidName, InvalidDelta, InvalidShardCount, MissingDriver, BackendUnavailable):
        assert issubclass(error, ShardkitError)
    assert issubclass(InvalidName, ValidationError)
    assert issubclass(ValidationError, ValueError)


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_names_are_refused_and_nothing_is_created(kit: shardkit.Kit, bad: object) -> None:
    before = kit.counters()
    with pytest.raises(InvalidName):
        kit.sharded(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidName):
        kit.values(["fine", bad])  # type: ignore[list-item]
    assert kit.counters() == before


@pytest.mark.parametrize("bad", ["votes", b"votes", 42, None])
def test_many_counters_are_read_by_a_list_of_names(
    kit: shardkit.Kit, name: str, bad: object
) -> None:
    """One name where a list is wanted is refused (a str would read one counter per
    character); names no counter has read 0, as documented."""
    with pytest.raises(InvalidName, match="iterable of counter names"):
        kit.values(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidName, match="iterable of counter names"):
        kit.parts(bad)  # type: ignore[arg-type]
    kit.sharded(name).incr(3)
    assert kit.values([name, f"{name}:none"]) == {name: 3, f"{name}:none": 0}


def test_the_name_limit_is_stated(kit: shardkit.Kit) -> None:
    kit.sharded("x" * 200)
    with pytest.raises(InvalidName, match="limit is 200"):
        kit.sharded("x" * 201)


@pytest.mark.parametrize("bad", BAD_DELTAS)
def test_bad_deltas_are_refused_and_nothing_is_written(
    kit: shardkit.Kit, name: str, bad: object
) -> None:
    votes = kit.sharded(name)
    votes.incr(7)
    with pytest.raises(InvalidDelta):
        votes.incr(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidDelta):
        votes.decr(bad)  # type: ignore[arg-type]
    assert votes.value(fresh=True) == 7


def test_decrement_by_the_smallest_int64_is_refused(kit: shardkit.Kit, name: str) -> None:
    votes = kit.sharded(name)
    with pytest.raises(InvalidDelta):
        votes.decr(-(2**63))  # its negation does not fit
    assert votes.value(fresh=True) == 0


@pytest.mark.parametrize("bad", [bad for bad in BAD_NAMES if bad is not None])
def test_bad_idempotency_keys_are_refused(kit: shardkit.Kit, name: str, bad: object) -> None:
    votes = kit.sharded(name)
    with pytest.raises(InvalidName, match="idempotency key"):
        votes.incr(1, key=bad)  # type: ignore[arg-type]
    assert votes.value(fresh=True) == 0


@pytest.mark.parametrize("bad", [0, -1, 65, 1000, True, 2.0, "4"])
def test_bad_shard_counts_are_refused(kit: shardkit.Kit, name: str, bad: object) -> None:
    with pytest.raises(InvalidShardCount):
        kit.sharded(name, shards=bad)  # type: ignore[arg-type]
    assert kit.store.counter(name) is None
    votes = kit.sharded(name, shards=4)
    with pytest.raises(InvalidShardCount):
        votes.grow(bad)  # type: ignore[arg-type]
    assert votes.shards == 4


def test_the_shard_maximum_is_configurable(kit: shardkit.Kit, name: str) -> None:
    assert kit.sharded(name, shards=64).shards == 64
    with pytest.raises(InvalidShardCount, match=r"1\.\.64"):
        kit.sharded(name, shards=65)


@pytest.mark.parametrize(
    ("store", "cache"),
    [
        ("oracle://scott:tiger@db/x", None),
        ("nonsense", None),
        ("sqlite://", None),
        ("sqlite:///:memory:", None),
        (None, "mongodb://db/x"),
        (None, "memcached://h:1/path"),
        (None, object()),
    ],
)
def test_unknown_or_unusable_urls_are_configuration_errors(
    sqlite_url: str, store: str | None, cache: object
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        shardkit.connect(store or sqlite_url, cache)  # type: ignore[arg-type]
    assert "tiger" not in str(raised.value)


@pytest.mark.parametrize("prefix", ["", "bad-prefix", "x; drop table", "p" * 41])
def test_bad_table_prefixes_are_refused(sqlite_url: str, prefix: str) -> None:
    with pytest.raises(ConfigurationError):
        shardkit.connect(sqlite_url, prefix=prefix)


def test_an_unknown_option_is_refused_by_every_way_of_opening_a_kit(sqlite_url: str) -> None:
    """The options are defined once (``KitOptions``): a misspelt one is named, and nothing
    is opened, by ``connect``, ``build`` and ``shardkit.aio.connect`` alike."""
    message = "unknown option 'cache_tll'; the options are prefix, cache_ttl, max_shards"
    with pytest.raises(ConfigurationError, match=message):
        shardkit.connect(sqlite_url, cache_tll=5)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match=message):
        shardkit.aio.connect(sqlite_url, cache_tll=5)  # type: ignore[call-arg]
    store, cache = open_store(sqlite_url, prefix=PREFIX), open_cache("memory://")
    try:
        with pytest.raises(ConfigurationError, match=message):
            build(store, cache, cache_tll=5)  # type: ignore[call-arg]
    finally:
        store.close()


@pytest.mark.parametrize(
    ("store", "cache", "shown"),
    [
        (
            "postgresql://app:s3cret@127.0.0.1:1/db",
            None,
            "postgresql+psycopg://app:***@127.0.0.1:1/db",
        ),
        ("mysql://app:s3cret@127.0.0.1:1/db", None, "mysql+pymysql://app:***@127.0.0.1:1/db"),
        (None, "redis://:s3cret@127.0.0.1:1/0", "redis://:***@127.0.0.1:1/0"),
        (None, "memcached://127.0.0.1:1", "memcached://127.0.0.1:1"),
    ],
)
def test_unreachable_servers_name_the_url_without_its_password(
    sqlite_url: str, store: str | None, cache: str | None, shown: str
) -> None:
    with pytest.raises(BackendUnavailable) as raised:
        shardkit.connect(store or sqlite_url, cache)
    message = str(raised.value)
    assert shown in message
    assert "s3cret" not in message
    assert "s3cret" not in repr(raised.value.__cause__) or raised.value.__cause__ is None


@pytest.mark.parametrize(
    ("module", "store", "cache", "extra"),
    [
        ("psycopg", "postgresql://127.0.0.1/db", None, "shardkit[postgres]"),
        ("pymysql", "mysql://127.0.0.1/db", None, "shardkit[mysql]"),
        ("redis", None, "redis://127.0.0.1/0", "shardkit[redis]"),
        ("pymemcache", None, "memcached://127.0.0.1:11211", "shardkit[memcached]"),
    ],
)
def test_a_missing_driver_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
    sqlite_url: str,
    module: str,
    store: str | None,
    cache: str | None,
    extra: str,
) -> None:
    for loaded in [m for m in sys.modules if m == module or m.startswith(f"{module}.")]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    with pytest.raises(MissingDriver, match=extra.replace("[", r"\[")):
        shardkit.connect(store or sqlite_url, cache)


@pytest.mark.parametrize(
    ("options", "limit"),
    [
        ({"cache_ttl": 10**9}, "≤ 2,592,000 s (30 days)"),
        ({"key_retention": -1}, "≥ 0 s and ≤ 3,153,600,000 s (100 years)"),
        ({"key_retention": -(10**400)}, "≥ 0 s and ≤ 3,153,600,000 s (100 years)"),
        ({"adjust_delay": 61}, "≤ 60 s (1 minute)"),
    ],
)
def test_limits_in_messages_are_whole_numbers_with_units(
    sqlite_url: str, options: dict[str, Any], limit: str
) -> None:
    with pytest.raises(shardkit.ConfigurationError) as raised:
        shardkit.connect(sqlite_url, prefix=PREFIX, **options)
    assert limit in str(raised.value)
    assert "e+" not in str(raised.value)
