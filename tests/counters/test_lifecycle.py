"""Deleting and resetting counters, of every kind, over every store and cache: what a
delete removes is gone in every process, and an object that still holds the old
incarnation moves to the new one without bringing anything of the old back."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

import shardkit
from backends import NEVER, PREFIX, Target, run_together
from shardkit.counters.generations import Parts
from shardkit.counters.generations import sum_keys as buffered_keys
from shardkit.errors import CounterNotFound, ValidationError
from shardkit.store.sql import SqlStore


def rows_of(kit: shardkit.Kit, name: str) -> dict[str, int]:
    """How many rows each table of the store holds for ``name``."""
    store = kit.store
    assert isinstance(store, SqlStore)
    tables = (store.counters_table, store.shards_table, store.keys_table)
    tables += (store.flushed_table, store.maxima_table)
    with store.engine.connect() as conn:
        return {
            table.name.removeprefix(PREFIX): int(
                conn.execute(
                    sa.select(sa.func.count()).select_from(table).where(table.c.name == name)
                ).scalar_one()
            )
            for table in tables
        }


NONE = {"counters": 0, "shards": 0, "keys": 0, "flushed": 0, "maxima": 0}


def test_a_reset_sharded_counter_starts_empty_and_forgets_its_keys(
    kit: shardkit.Kit, name: str
) -> None:
    votes = kit.sharded(name, shards=4)
    assert votes.incr(5, key="k")
    assert votes.value() == 5  # cached now
    before = kit.store.counter(name)
    was = kit.reset(name)
    after = kit.store.counter(name)
    assert before is not None
    assert after is not None
    assert was == before
    assert (after.kind, after.shards) == ("sharded", 4)
    assert after.incarnation != before.incarnation
    assert kit.values([name]) == {name: 0}  # the cached 5 went with it
    assert votes.value(fresh=True) == 0
    assert votes.incr(1, key="k")  # its idempotency key went too: applied again
    assert kit.sharded(name).value(fresh=True) == 1
    assert kit.store.counter(name) == after


def test_a_reset_buffered_counter_drops_what_was_stored_and_pending(
    kit: shardkit.Kit, name: str
) -> None:
    hits = kit.buffered(name, interval=NEVER)
    hits.incr(3)
    hits.flush()
    hits.incr(4)
    assert hits.parts() == Parts(stored=3, pending=4)
    kit.reset(name)
    assert hits.parts() == Parts(0, 0)
    assert kit.flush_all() == {}  # the 4 pending are nowhere to be flushed
    hits.incr(2)
    assert kit.buffered(name, interval=NEVER).parts() == Parts(stored=0, pending=2)
    assert hits.flush() == 2
    assert kit.values([name]) == {name: 2}


def test_a_deleted_monotonic_counter_is_read_as_missing_not_made_again(
    kit: shardkit.Kit, name: str
) -> None:
    sequence = kit.monotonic(name, chance_to_write=1.0)
    sequence.incr(3)
    kit.delete(name)
    with pytest.raises(CounterNotFound, match="it was deleted"):
        sequence.value()  # a read: the name is left without a counter
    assert kit.store.counter(name) is None
    assert sequence.incr() == 1  # a write makes it again, as opening would
    assert kit.store.counter(name) is not None


def test_a_reset_monotonic_counter_counts_from_one_again(kit: shardkit.Kit, name: str) -> None:
    sequence = kit.monotonic(name, chance_to_write=1.0)
    for _ in range(10):
        sequence.incr()
    kit.reset(name)
    assert sequence.incr() == 1
    assert kit.monotonic(name, chance_to_write=1.0).value() == 1
    assert sequence.persisted() == 1  # the old incarnation's maxima are not read


def test_an_allocator_is_not_reset_and_its_successor_starts_above_it(
    kit: shardkit.Kit, name: str
) -> None:
    ids = kit.ids(name, block=10)
    old = ids.take(3)
    mark = ids.reserved()
    with pytest.raises(ValidationError, match="id allocator"):
        kit.reset(name)
    assert ids.reserved() == mark  # the refused reset changed nothing
    assert ids.take(1) == [max(old) + 1]
    kit.delete(name)
    with pytest.raises(CounterNotFound):
        kit.get(name)
    new = kit.ids(name, block=10).take(3)
    assert min(new) > mark
    later = ids.take(3)  # the old object moves to the new allocator
    taken = [*old, max(old) + 1, *new, *later]
    assert len(set(taken)) == len(taken)
    assert min(later) > mark


@pytest.mark.parametrize("kind", ["sharded", "buffered", "monotonic", "ids"])
@pytest.mark.pairs
def test_a_deleted_counter_leaves_no_row_and_no_cache_key(
    kit: shardkit.Kit, name: str, kind: str
) -> None:
    keys: list[str]
    if kind == "sharded":
        kit.sharded(name).incr(2, key="once")
        kit.values([name])  # cached
        keys = [kit.settings.cache_key(name, "sharded:value")]
    elif kind == "buffered":
        hits = kit.buffered(name, interval=NEVER)
        hits.incr(3)
        hits.flush()
        hits.incr(1)
        generations = kit.store.generations([name])[name]
        keys = [*hits._pointer_keys]
        keys += [key for g in generations for key in buffered_keys(kit.settings, name, g)]
    elif kind == "monotonic":
        sequence = kit.monotonic(name, chance_to_write=1.0)
        sequence.incr(4)
        keys = [sequence._value_key]
    else:
        ids = kit.ids(name, block=10)
        ids.next()
        keys = [ids._pointer_key, ids._key_of(ids.reserved())]
    assert any(kit.cache.get(key) is not None for key in keys)
    assert rows_of(kit, name) != NONE
    was = kit.delete(name)
    assert (was.name, was.kind) == (name, kind)
    assert rows_of(kit, name) == NONE
    assert [kit.cache.get(key) for key in keys] == [None] * len(keys)
    assert name not in [info.name for info in kit.counters()]
    with pytest.raises(CounterNotFound, match="no counter named"):
        kit.get(name)
    with pytest.raises(CounterNotFound, match="no counter named"):
        kit.delete(name)
    with pytest.raises(CounterNotFound, match="no counter named"):
        kit.reset(name)


def test_a_counter_held_in_another_process_moves_to_the_new_incarnation(
    store_url: str, shared_cache_url: str, name: str
) -> None:
    """Another kit on the same store and cache stands for another process: its objects
    of the old incarnations find, at their next call, that the shared cache no longer
    holds their keys, and move on; none shows or adds to the old value."""
    target = Target(store_url, shared_cache_url)
    with target.connect() as here, target.connect() as there:
        votes = there.sharded(f"{name}:s")
        votes.incr(5)
        hits = there.buffered(f"{name}:b", interval=NEVER)
        hits.incr(7)
        sequence = there.monotonic(f"{name}:m", chance_to_write=1.0)
        sequence.incr(9)
        for suffix in "sbm":
            here.reset(f"{name}:{suffix}")
        hits.incr(1)
        assert here.buffered(f"{name}:b", interval=NEVER).parts() == Parts(0, 1)
        assert sequence.incr() == 1
        assert here.monotonic(f"{name}:m", chance_to_write=1.0).value() == 1
        votes.incr(2)  # written by name: in the new incarnation
        assert here.sharded(f"{name}:s").value(fresh=True) == 2
        assert here.flush_all() == {f"{name}:b": 1}


@pytest.mark.parametrize("kind", ["sharded", "buffered", "monotonic", "ids"])
def test_get_finds_what_another_process_did_to_a_counter_it_holds(
    store_url: str, name: str, kind: str
) -> None:
    """Two kits on one store, each with a cache of its own (two processes): a counter
    one holds open and the other deletes is not found by ``get``, which creates
    nothing; made again as another kind, ``get`` returns that kind; reset, ``get``
    returns the held object, moved to the empty incarnation."""
    with (
        shardkit.connect(store_url, "memory://", prefix=PREFIX) as here,
        shardkit.connect(store_url, "memory://", prefix=PREFIX) as there,
    ):
        opened = getattr(there, kind)(name)
        assert there.get(name) is opened  # held: the same object
        here.delete(name)
        with pytest.raises(CounterNotFound, match="no counter named"):
            there.get(name)
        assert there.held(name) is None
        assert rows_of(there, name) == NONE  # looking created nothing
        other = "monotonic" if kind == "sharded" else "sharded"
        getattr(here, other)(name)
        assert there.get(name).kind == other
        before = here.store.counter(name)
        here.reset(name)
        now = here.store.counter(name)
        assert before is not None
        assert now is not None
        assert before.incarnation != now.incarnation
        held = there.get(name)
        assert (held is there.held(name), held.info) == (True, now)


def test_with_a_cache_of_its_own_a_process_moves_when_it_looks(store_url: str, name: str) -> None:
    """With a private cache nothing reaches another process but the store: it looks at
    the counter's configuration once ``cache_ttl`` seconds have passed since it last
    did (here 1 ms)."""
    with shardkit.connect(store_url, "memory://", prefix=PREFIX) as here:
        with shardkit.connect(store_url, "memory://", prefix=PREFIX, cache_ttl=0.001) as there:
            hits = there.buffered(f"{name}:b", interval=NEVER)
            hits.incr(7)
            sequence = there.monotonic(f"{name}:m", chance_to_write=1.0)
            sequence.incr(9)
            here.delete(f"{name}:b")
            here.reset(f"{name}:m")
            time.sleep(0.002)  # cache_ttl has passed: the next call looks
            hits.incr(1)
            assert hits.parts() == Parts(0, 1)
            assert hits.flush() == 1
            assert sequence.incr() == 1
        assert here.get(f"{name}:b").value() == 1  # created anew by the object that wrote


def test_with_a_cache_of_its_own_a_process_sees_a_delete_once_it_looks(
    store_url: str, name: str
) -> None:
    """The limit of a private cache (``docs/deploying.md``): another process's delete
    reaches this one through the store only. Until its objects look again
    (``cache_ttl`` after they last did: an hour here, so never within the test), a
    sharded counter's cached value and a monotonic counter's value are the deleted
    incarnation's, and the monotonic one goes on from it; fresh reads and ``get`` read
    the store, and see the delete at once."""
    sharded, monotonic = f"{name}:s", f"{name}:m"
    with (
        shardkit.connect(store_url, "memory://", prefix=PREFIX) as here,
        shardkit.connect(store_url, "memory://", prefix=PREFIX, cache_ttl=3600) as there,
    ):
        votes = there.sharded(sharded)
        votes.incr(5)
        assert votes.value() == 5  # cached
        sequence = there.monotonic(monotonic, chance_to_write=1.0)
        assert sequence.incr(9) == 9
        here.delete(sharded)
        here.delete(monotonic)
        assert (votes.value(), there.values([sharded])) == (5, {sharded: 5})
        assert sequence.value() == 9
        assert sequence.incr() == 10
        assert (votes.value(fresh=True), there.values([sharded], fresh=True)) == (0, {sharded: 0})
        with pytest.raises(CounterNotFound):
            there.get(sharded)
        assert here.store.counter(sharded) is None


@pytest.mark.pairs
def test_writes_racing_a_reset_count_if_and_only_if_they_may_follow_it(
    shared_kit: shardkit.Kit, name: str
) -> None:
    """Eight threads write while another resets: every write that started after the
    reset returned counts, and none that returned before the reset started."""
    votes = shared_kit.sharded(name, shards=4)
    votes.incr()
    started, done = threading.Event(), threading.Event()
    after = [0] * 8
    before = [0] * 8
    total = [0] * 8

    def write(index: int) -> None:
        for count in range(200):
            if index == 0 and count == 50:
                started.set()
                shared_kit.reset(name)
                done.set()
                continue
            follows = done.is_set()
            shared_kit.sharded(name, shards=4).incr()
            total[index] += 1
            after[index] += follows
            before[index] += not started.is_set()

    run_together(8, write)
    value = shared_kit.sharded(name).value(fresh=True)
    assert sum(after) <= value <= sum(total) - sum(before)
    assert sum(after) >= 149  # the resetting thread's own writes after it
    assert sum(before) >= 50  # and before it


@pytest.mark.pairs
def test_ids_taken_while_the_allocator_is_deleted_are_all_distinct(
    shared_kit: shardkit.Kit, name: str
) -> None:
    taken: list[list[int]] = [[] for _ in range(6)]

    def take(index: int) -> None:
        for count in range(300):
            if index == 0 and count == 100:
                shared_kit.delete(name)
            taken[index].append(shared_kit.ids(name, block=20).next())

    run_together(6, take)
    every = [each for ids in taken for each in ids]
    assert len(every) == len(set(every)) == 1800
