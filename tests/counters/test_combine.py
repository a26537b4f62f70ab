"""Combining: concurrent writes from threads of one process carried by one backend call."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

import shardkit
from backends import NEVER, Target, wait_for
from received import increments_received, row_writes
from shardkit._sync.combine import Combiner
from shardkit.counters.buffered import Sides
from shardkit.errors import BackendError, CounterOverflow
from shardkit.validation import INT64_MAX

DEADLINE = 60.0  # seconds: how long a held batch waits for its test to open the gate


def _sides(counter: shardkit.BufferedCounter) -> tuple[Combiner[int, None], ...]:
    """The combiners of the counter's increments and decrements."""
    bumps = counter.roles.bumps
    assert isinstance(bumps, Sides)
    return bumps.sides


def _queued(counter: shardkit.ShardedCounter) -> int:
    """How many writes wait in the counter's combiner for the next batch."""
    combiner = counter.roles.writes
    assert isinstance(combiner, Combiner)
    return combiner.waiting


class Gate:
    """A write function that records its batches and, while closed, holds each one until
    ``open()``; ``fail`` makes the next batch raise instead."""

    def __init__(self, write: Callable[[Sequence[Any]], Sequence[Any]] = lambda b: list(b)):
        self.batches: list[list[Any]] = []
        self.entered = threading.Semaphore(0)
        self._open = threading.Event()
        self._write = write
        self.fail: Exception | None = None

    def __call__(self, batch: Sequence[Any]) -> Sequence[Any]:
        self.batches.append(list(batch))
        self.entered.release()
        if not self._open.wait(DEADLINE):
            raise TimeoutError("the gate was never opened")
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        return self._write(batch)

    def open(self) -> None:
        self._open.set()


@pytest.fixture
def threads() -> Iterator[Callable[[Callable[[], object]], dict[str, Any]]]:
    """Start a thread running a call; its outcome lands in the returned dict."""
    started: list[threading.Thread] = []

    def start(call: Callable[[], object]) -> dict[str, Any]:
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = call()
            except Exception as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=run, daemon=True)  # never holds up the session
        thread.start()
        started.append(thread)
        return outcome

    yield start
    for thread in started:
        thread.join(30)
        assert not thread.is_alive()


def test_a_lone_caller_writes_its_own_batch_at_once() -> None:
    batches: list[list[int]] = []

    def write(batch: Sequence[int]) -> list[int]:
        batches.append(list(batch))
        return [item * 10 for item in batch]

    combiner = Combiner(write)
    assert [combiner(1), combiner(2)] == [10, 20]
    assert batches == [[1], [2]]


def test_callers_arriving_during_a_write_share_the_next_one(threads: Any) -> None:
    gate = Gate(lambda batch: [item * 10 for item in batch])
    combiner = Combiner(gate)
    first = threads(lambda: combiner(1))
    gate.entered.acquire()  # the first caller is writing its batch
    rest = [threads(lambda i=i: combiner(i)) for i in (2, 3, 4)]
    wait_for(lambda: combiner.waiting == 3, "three callers queued")
    assert gate.batches == [[1]]
    gate.open()
    for outcome in (first, *rest):
        wait_for(lambda o=outcome: bool(o), "every caller to return")
    assert gate.batches == [[1], [2, 3, 4]]
    assert [first["result"]] + [o["result"] for o in rest] == [10, 20, 30, 40]


def test_a_failed_batch_raises_for_each_of_its_callers_and_the_next_batch_goes_on(
    threads: Any,
) -> None:
    failure = BackendError("the store went away")

    def write(batch: Sequence[str]) -> list[str]:
        if "a" not in batch:
            raise failure
        return list(batch)

    gate = Gate(write)
    combiner = Combiner(gate)
    first = threads(lambda: combiner("a"))
    gate.entered.acquire()
    doomed = [threads(lambda i=i: combiner(i)) for i in ("b", "c")]
    wait_for(lambda: combiner.waiting == 2, "two callers queued")
    gate.open()
    for outcome in (first, *doomed):
        wait_for(lambda o=outcome: bool(o), "every caller to return")
    assert first == {"result": "a"}
    assert [outcome["error"] for outcome in doomed] == [failure, failure]
    assert combiner("a") == "a"  # nothing is left stuck


def test_many_threads_get_exactly_their_own_results() -> None:
    combiner: Combiner[int, int] = Combiner(lambda batch: [item + 1 for item in batch])
    results: list[list[int]] = [[] for _ in range(8)]

    def work(index: int) -> None:
        for n in range(500):
            results[index].append(combiner(index * 1000 + n))

    workers = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for index, got in enumerate(results):
        assert got == [index * 1000 + n + 1 for n in range(500)]


class Interrupted(BaseException):
    """What the test's signal handler raises, as SIGINT's raises KeyboardInterrupt."""


def test_a_caller_interrupted_while_queued_takes_its_item_out(threads: Any) -> None:
    gate = Gate()
    combiner: Combiner[int, int] = Combiner(gate)
    first = threads(lambda: combiner(1))
    gate.entered.acquire()  # the first caller is writing its batch
    main = threading.get_ident()

    def interrupt_once_queued() -> None:
        wait_for(lambda: combiner.waiting == 1, "this thread to queue")
        signal.pthread_kill(main, signal.SIGUSR1)

    def interrupted(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupted)
    try:
        threads(interrupt_once_queued)
        with pytest.raises(Interrupted):
            combiner(2)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert combiner.waiting == 0  # taken out of the queue
    gate.open()
    wait_for(lambda: bool(first), "the first caller to return")
    assert first == {"result": 1}
    assert combiner(3) == 3
    assert gate.batches == [[1], [3]]  # 2 was never written


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_a_write_combines_afresh(threads: Any) -> None:
    gate = Gate()
    combiner = Combiner(gate)
    first = threads(lambda: combiner(1))
    gate.entered.acquire()  # the parent is mid-batch when it forks
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's batch is not its own to wait for
        try:
            direct: Combiner[int, int] = Combiner(lambda batch: list(batch))
            os.write(write, b"ok" if combiner.waiting == 0 and direct(7) == 7 else b"no")
            combiner._write = lambda batch: list(batch)  # its gate would wait forever
            os.write(write, b"ok" if combiner(5) == 5 else b"no")
        finally:
            os._exit(0)
    os.close(write)
    try:
        os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as said:
            assert said.read() == b"okok"  # to the end: the child wrote twice
    finally:
        gate.open()
    wait_for(lambda: bool(first), "the parent's caller to return")
    assert first == {"result": 1}


# -- the counters' combined writes, on every store ---------------------------------------


def _gate_store(kit: shardkit.Kit, monkeypatch: pytest.MonkeyPatch) -> Gate:
    """Hold the store's shard writes at a gate (the real writes made once it opens)."""
    store: Any = kit.store
    real = store.add_many
    gate = Gate()

    def add_many(name: str, shard: int, writes: Sequence[Any]) -> list[bool]:
        gate(list(writes))
        return list(real(name, shard, writes))

    monkeypatch.setattr(store, "add_many", add_many)
    return gate


def _shard_writes(kit: shardkit.Kit, name: str) -> Any:
    """The upserts of ``name``'s shard rows that the database runs in the block."""
    store: Any = kit.store
    return row_writes(store.engine, store.shards_table.name, name)


def test_concurrent_sharded_writes_share_one_statement(
    kit: shardkit.Kit, name: str, threads: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    votes = kit.sharded(name, shards=1)
    votes.incr(0)  # its shard row exists
    gate = _gate_store(kit, monkeypatch)
    with _shard_writes(kit, name) as upserts:
        first = threads(lambda: votes.incr(5))
        gate.entered.acquire()
        rest = [
            threads(lambda: votes.incr(1)),
            threads(lambda: votes.incr(2, key="k1")),
            threads(lambda: votes.incr(3, key="k1")),  # a repeat within the batch
            threads(lambda: votes.decr(4)),
        ]
        wait_for(lambda: _queued(votes) == 4, "4 queued")
        gate.open()
        for outcome in (first, *rest):
            wait_for(lambda o=outcome: bool(o), "every caller to return")
        # Written one by one, the four applied writes would be four upserts.
        assert upserts() == 2
    assert [len(batch) for batch in gate.batches] == [1, 4]
    results = [outcome["result"] for outcome in rest]
    assert sorted(results) == [False, True, True, True]  # one of the two k1 writes applied
    applied_k1 = 2 if rest[1]["result"] else 3
    assert votes.value(fresh=True) == 5 + 1 + applied_k1 - 4
    assert votes.value() == 5 + 1 + applied_k1 - 4
    assert votes.incr(9, key="k1") is False  # recorded once, for good


def test_a_failed_combined_statement_fails_all_its_callers_and_applies_none(
    kit: shardkit.Kit, name: str, threads: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    votes = kit.sharded(name, shards=1)
    votes.incr(INT64_MAX - 10)
    gate = _gate_store(kit, monkeypatch)
    first = threads(lambda: votes.incr(4))
    gate.entered.acquire()
    # The second statement adds 3 + 3 + 3 to the first's 4: past the shard's 10 of room,
    # where one by one only the last would have failed. All three fail; none applies.
    rest = [threads(lambda: votes.incr(3)) for _ in range(3)]
    wait_for(lambda: _queued(votes) == 3, "queued")
    gate.open()
    for outcome in (first, *rest):
        wait_for(lambda o=outcome: bool(o), "every caller to return")
    assert first == {"result": True}
    assert all(isinstance(outcome.get("error"), CounterOverflow) for outcome in rest)
    assert votes.value(fresh=True) == INT64_MAX - 6  # the first only


def test_deltas_that_could_sum_past_64_bits_are_written_one_by_one(
    kit: shardkit.Kit, name: str, threads: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    votes = kit.sharded(name, shards=1)
    votes.incr(-(2**62))
    gate = _gate_store(kit, monkeypatch)
    with _shard_writes(kit, name) as upserts:
        first = threads(lambda: votes.incr(1))
        gate.entered.acquire()
        rest = [threads(lambda: votes.incr(2**62)) for _ in range(2)]  # 2**63 together
        wait_for(lambda: _queued(votes) == 2, "queued")
        gate.open()
        for outcome in (first, *rest):
            wait_for(lambda o=outcome: bool(o), "every caller to return")
        assert upserts() == 3
    assert all(outcome == {"result": True} for outcome in (first, *rest))
    assert [len(batch) for batch in gate.batches] == [1, 1, 1]
    assert votes.value(fresh=True) == 2**62 + 1


def test_a_write_made_one_by_one_that_overflows_fails_its_caller_alone(
    kit: shardkit.Kit, name: str, threads: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of two queued writes made one by one (together they could pass 64 bits), the one
    that finds no room raises CounterOverflow to its caller; the other applies."""
    votes = kit.sharded(name, shards=1)
    votes.incr(INT64_MAX - 2**62 - 1)
    gate = _gate_store(kit, monkeypatch)
    first = threads(lambda: votes.incr(1))
    gate.entered.acquire()
    rest = [threads(lambda: votes.incr(2**62)) for _ in range(2)]  # room for one
    wait_for(lambda: _queued(votes) == 2, "queued")
    gate.open()
    for outcome in (first, *rest):
        wait_for(lambda o=outcome: bool(o), "every caller to return")
    assert first == {"result": True}
    applied = [outcome for outcome in rest if outcome == {"result": True}]
    failed = [outcome for outcome in rest if isinstance(outcome.get("error"), CounterOverflow)]
    assert (len(applied), len(failed)) == (1, 1)
    assert [len(batch) for batch in gate.batches] == [1, 1, 1]
    assert votes.value(fresh=True) == INT64_MAX


def test_concurrent_buffered_increments_share_one_cache_command(
    store_url: str, own_cache_url: str, name: str, threads: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Target(store_url, own_cache_url).connect() as kit:
        likes = kit.buffered(name, interval=NEVER)
        likes.incr()  # its generation exists: every bump below is one command
        cache: Any = kit.cache
        real = cache.bump
        gate = Gate()

        def bump(key: str, delta: int) -> int:
            gate([delta])
            return int(real(key, delta))

        monkeypatch.setattr(cache, "bump", bump)
        received = increments_received(own_cache_url) or (lambda: len(gate.batches))
        before = received()
        first = threads(lambda: likes.incr(2))
        gate.entered.acquire()
        rest = [threads(lambda d=d: likes.incr(d)) for d in (3, 4, 5)]
        wait_for(lambda: _sides(likes)[0].waiting == 3, "three increments queued")
        gate.open()
        for outcome in (first, *rest):
            wait_for(lambda o=outcome: bool(o), "every caller to return")
        assert received() - before == 2  # one by one, four (memory://: its calls)
        assert gate.batches == [[2], [12]]
        assert likes.value() == 1 + 2 + 12
        likes.flush()
        assert likes.parts().stored == 15
