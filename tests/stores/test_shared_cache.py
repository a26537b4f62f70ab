"""One cache, several stores: a staging and a production app, or two services, sharing a
Redis or memcached database with the same table prefix never read each other's values.

A kit's cache keys live under its store's identity, made once and persisted in the
store, so it is the same in every process and after restarts.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import shardkit
from backends import NEVER, PREFIX


@pytest.fixture
def two_stores(tmp_path: Path) -> list[str]:
    return [f"sqlite:///{tmp_path / 'staging.db'}", f"sqlite:///{tmp_path / 'production.db'}"]


@pytest.fixture
def kits(shared_cache_url: str, two_stores: list[str]) -> Iterator[list[shardkit.Kit]]:
    """A kit on each of two stores, with the same prefix and the same cache."""
    opened = [shardkit.connect(url, shared_cache_url, prefix=PREFIX) for url in two_stores]
    yield opened
    for kit in opened:
        kit.close()


def test_a_stores_identity_is_its_own_and_lasts(
    kits: list[shardkit.Kit], two_stores: list[str]
) -> None:
    staging, production = kits
    assert staging.namespace != production.namespace
    assert staging.namespace == f"shardkit:{staging.store.identity()}:"
    # The same store, opened again and in another process, has the same identity.
    with shardkit.connect(two_stores[0], "memory://", prefix=PREFIX) as again:
        assert again.namespace == staging.namespace
    code = (
        "import shardkit, sys; print(shardkit.connect(sys.argv[1], prefix=sys.argv[2]).namespace)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, two_stores[0], PREFIX],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == staging.namespace
    # Another prefix in the same database is another store.
    with shardkit.connect(two_stores[0], "memory://", prefix=f"{PREFIX}b_") as other:
        assert other.namespace != staging.namespace


def test_every_kind_keeps_to_its_store(kits: list[shardkit.Kit]) -> None:
    staging, production = kits
    name = f"test:shared:{uuid.uuid4().hex}"
    for kit, by in ((staging, 5), (production, 7)):
        kit.sharded(f"{name}:s", shards=4).incr(by)
        kit.buffered(f"{name}:b", interval=NEVER).incr(by)
        monotonic = kit.monotonic(f"{name}:m", shards=4)
        for _ in range(by):
            monotonic.incr()
    for kit, by in ((staging, 5), (production, 7)):
        sharded = kit.sharded(f"{name}:s")
        assert sharded.value() == sharded.value(fresh=True) == by  # the cached read as well
        assert kit.values([f"{name}:s"]) == {f"{name}:s": by}
        assert kit.buffered(f"{name}:b", interval=NEVER).value() == by
        assert kit.monotonic(f"{name}:m").value() == by
    for kit, by in ((staging, 5), (production, 7)):
        kit.sharded(f"{name}:s").incr(1)  # adjusts this store's cached value only
        assert kit.sharded(f"{name}:s").value() == by + 1
        assert kit.flush_all() == {f"{name}:b": by}
        assert kit.buffered(f"{name}:b", interval=NEVER).parts() == shardkit.Parts(by, 0)


def test_ids_never_repeat_within_a_store(
    kits: list[shardkit.Kit], two_stores: list[str], shared_cache_url: str
) -> None:
    staging, production = kits
    name = f"test:shared:ids:{uuid.uuid4().hex}"
    with shardkit.connect(two_stores[0], shared_cache_url, prefix=PREFIX) as staging_too:
        handed: dict[str, list[int]] = {"staging": [], "production": []}
        for _ in range(30):  # the stores' allocators take turns, block after block
            handed["staging"] += staging.ids(name, block=7, sub_block=1).take(3)
            handed["production"] += production.ids(name, block=7, sub_block=1).take(3)
            handed["staging"] += staging_too.ids(name, block=7, sub_block=1).take(2)
    for ids in handed.values():
        assert len(set(ids)) == len(ids)
    # One store's kits share its blocks through the cache: its ids run without holes
    # (none kept a sub-block's rest in hand).
    assert sorted(handed["staging"]) == list(range(1, 151))
    assert sorted(handed["production"]) == list(range(1, 91))
