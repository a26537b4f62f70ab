"""The local executor, and the deduplication marks every executor keeps in the cache."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import pytest

from backends import wait_for
from shardkit.cache import Cache, MemoryCache
from shardkit.errors import ConfigurationError
from shardkit.executor import LocalExecutor, Marks


class Recorder:
    """Tasks that record their calls and signal each one."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any], float]] = []
        self.called = threading.Semaphore(0)

    def task(self, name: str) -> Any:
        def run(args: Mapping[str, Any]) -> None:
            self.calls.append((name, dict(args), time.monotonic()))
            self.called.release()

        return run

    def wait(self, count: int, timeout: float = 10.0) -> None:
        for _ in range(count):
            assert self.called.acquire(timeout=timeout), "a task never ran"


@pytest.fixture
def namespace() -> str:
    return f"shardkit-test:{uuid.uuid4().hex}:"


def bound(cache: Cache, namespace: str, recorder: Recorder) -> LocalExecutor:
    executor = LocalExecutor(workers=2)
    executor.bind(
        {"a": recorder.task("a"), "b": recorder.task("b")},
        Marks(cache, lambda name: f"{namespace}task:{name}"),
    )
    return executor


def test_tasks_run_with_their_arguments_after_their_delay(cache: Cache, namespace: str) -> None:
    recorder = Recorder()
    executor = bound(cache, namespace, recorder)
    submitted = time.monotonic()
    assert executor.submit("b", {"n": 2}, delay=0.3)
    assert executor.submit("a", {"n": 1})
    recorder.wait(2)
    executor.close()
    (first, args_a, _), (second, args_b, ran_b) = recorder.calls
    assert (first, args_a, second, args_b) == ("a", {"n": 1}, "b", {"n": 2})
    assert ran_b - submitted >= 0.3


def test_idle_counts_the_workers_waiting_with_nothing_queued() -> None:
    executor = LocalExecutor(workers=2)
    release = threading.Event()
    started = threading.Semaphore(0)

    def hold(args: Mapping[str, Any]) -> None:
        started.release()
        assert release.wait(10)

    executor.bind({"hold": hold}, Marks(MemoryCache(), lambda name: name))
    try:
        assert executor.idle == 0  # no thread yet: none waits
        executor.submit("hold", {})
        assert started.acquire(timeout=10)
        wait_for(lambda: executor.idle == 1, "the other worker to wait")
        executor.submit("hold", {})
        assert started.acquire(timeout=10)
        assert executor.idle == 0  # both hold a task
        executor.submit("hold", {})  # queued: no worker is free for it
        assert executor.idle == 0
    finally:
        release.set()
        executor.close()


def test_a_deduplicated_name_runs_once_per_window(cache: Cache, namespace: str) -> None:
    recorder = Recorder()
    one, two = bound(cache, namespace, recorder), bound(cache, namespace, recorder)
    assert one.submit("a", {}, dedupe="job", window=60)
    assert not one.submit("a", {}, dedupe="job", window=60)
    # Executors sharing the cache share the marks (the memory cache: one process).
    assert not two.submit("a", {}, dedupe="job", window=60)
    assert one.submit("a", {}, dedupe="another", window=60)
    recorder.wait(2)
    one.close()
    two.close()
    assert len(recorder.calls) == 2


def test_a_mark_expires_after_its_window(cache: Cache, namespace: str) -> None:
    executor = bound(cache, namespace, Recorder())
    assert executor.submit("a", {}, dedupe="job", window=1)
    wait_for(
        lambda: executor.submit("a", {}, dedupe="job", window=1),
        "the mark to expire after its window of 1 s",
        60,
    )
    executor.close()


def test_close_runs_delayed_tasks_at_once_and_refuses_more(cache: Cache, namespace: str) -> None:
    recorder = Recorder()
    executor = bound(cache, namespace, recorder)
    executor.submit("a", {"n": 1}, delay=3600)
    executor.submit("b", {"n": 2}, delay=3600)
    executor.close()
    assert [(name, args) for name, args, _ in recorder.calls] == [("a", {"n": 1}), ("b", {"n": 2})]
    with pytest.raises(ConfigurationError):
        executor.submit("a", {})


def test_unknown_tasks_and_unbound_dedupe_are_refused(cache: Cache, namespace: str) -> None:
    executor = bound(cache, namespace, Recorder())
    with pytest.raises(ConfigurationError, match="no task named 'c'"):
        executor.submit("c", {})
    executor.close()
    with pytest.raises(ConfigurationError):
        LocalExecutor(workers=0)


def test_a_failing_task_is_logged_and_the_executor_goes_on(
    cache: Cache, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    executor = LocalExecutor()

    def fail(args: Mapping[str, Any]) -> None:
        raise RuntimeError("boom")

    executor.bind(
        {"fail": fail, "a": recorder.task("a")},
        Marks(cache, lambda name: f"{namespace}task:{name}"),
    )
    with caplog.at_level(logging.ERROR, logger="shardkit"):
        executor.submit("fail", {})
        executor.submit("a", {})
        recorder.wait(1)
        executor.close()
    assert "background task fail{} failed" in caplog.text


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_with_an_empty_executor(namespace: str) -> None:
    from shardkit.cache import MemoryCache

    recorder = Recorder()
    executor = bound(MemoryCache(), namespace, recorder)
    executor.submit("a", {}, delay=3600)
    pid = os.fork()
    if pid == 0:  # the child: its close must not run the parent's delayed task
        executor.close()
        os._exit(len(recorder.calls))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    executor.close()
    assert len(recorder.calls) == 1


class Tree:
    """A task that submits ``fanout`` children down to ``depth``, recording the order
    in which tasks run and the most that ever waited to run."""

    def __init__(self, fanout: int, depth: int) -> None:
        self.fanout, self.depth = fanout, depth
        self.executor: LocalExecutor | None = None
        self.order: list[str] = []
        self.waiting = self.most_waiting = 0
        self.ran = threading.Semaphore(0)
        self._lock = threading.Lock()

    def nodes(self) -> int:
        return sum(self.fanout**level for level in range(self.depth + 1))

    def __call__(self, args: Mapping[str, Any]) -> None:
        path = args["path"]
        with self._lock:
            self.order.append(path)
            self.waiting -= 1
        if len(path) <= self.depth:
            assert self.executor is not None
            for child in range(self.fanout):
                with self._lock:
                    self.waiting += 1
                    self.most_waiting = max(self.most_waiting, self.waiting)
                self.executor.submit("node", {"path": f"{path}{child}"})
        self.ran.release()

    def run(self, executor: LocalExecutor, cache: Cache, namespace: str) -> None:
        self.executor = executor
        executor.bind({"node": self}, Marks(cache, lambda name: f"{namespace}task:{name}"))
        with self._lock:
            self.waiting += 1
        executor.submit("node", {"path": "r"})
        for _ in range(self.nodes()):
            assert self.ran.acquire(timeout=30), "a task never ran"
        executor.close()


def test_follow_up_tasks_run_newest_first_so_a_tree_is_walked_depth_first(
    cache: Cache, namespace: str
) -> None:
    tree = Tree(fanout=2, depth=2)
    tree.run(LocalExecutor(workers=1), cache, namespace)
    assert tree.order == ["r", "r1", "r11", "r10", "r0", "r01", "r00"]


def test_a_tree_of_tasks_keeps_few_waiting(cache: Cache, namespace: str) -> None:
    tree = Tree(fanout=4, depth=5)
    workers = 2
    tree.run(LocalExecutor(workers=workers), cache, namespace)
    assert sorted(tree.order) == sorted(set(tree.order))
    assert len(tree.order) == tree.nodes() == 1365
    # Depth first, about a fanout of siblings per level per worker wait; the workers'
    # interleaved submissions can add up to a level's worth (42 was seen, and the most
    # found by simulating random interleavings of 2 workers). Breadth first, the 1,024
    # leaves would all wait at once.
    assert tree.most_waiting <= workers * tree.fanout * (tree.depth + 1)


def test_tasks_from_outside_run_before_follow_ups(cache: Cache, namespace: str) -> None:
    recorder = Recorder()
    executor = LocalExecutor(workers=1)
    followed, go_on = threading.Event(), threading.Event()

    def first(args: Mapping[str, Any]) -> None:
        executor.submit("later", {"n": 1})
        executor.submit("later", {"n": 2})
        followed.set()
        assert go_on.wait(10)  # the only worker is busy while "outside" arrives
        recorder.task("first")(args)

    tasks = {"first": first, "later": recorder.task("later"), "outside": recorder.task("outside")}
    executor.bind(tasks, Marks(cache, lambda name: f"{namespace}task:{name}"))
    executor.submit("first", {})
    assert followed.wait(10)
    executor.submit("outside", {})
    go_on.set()
    recorder.wait(4)
    executor.close()
    assert [(name, args) for name, args, _ in recorder.calls] == [
        ("first", {}),
        ("outside", {}),
        ("later", {"n": 2}),
        ("later", {"n": 1}),
    ]


def test_a_stream_from_outside_does_not_hold_follow_ups_back(cache: Cache, namespace: str) -> None:
    """One worker; a feeder outside keeps tasks from outside waiting all the time (as
    flushes do when the store cannot keep up), until the follow-up has run: it runs
    after at most one of them (taken first, it would wait for ever)."""
    executor = LocalExecutor(workers=1)
    order: list[str] = []
    fed, refilled, stop = threading.Semaphore(0), threading.Semaphore(0), threading.Event()

    def outside(args: Mapping[str, Any]) -> None:
        order.append("outside")
        fed.release()
        while not (refilled.acquire(timeout=0.01) or stop.is_set()):
            pass  # ends once another is queued: from outside, one always waits

    def parent(args: Mapping[str, Any]) -> None:
        order.append("parent")
        executor.submit("child", {})

    tasks = {"outside": outside, "parent": parent, "child": lambda args: order.append("child")}
    executor.bind(tasks, Marks(cache, lambda name: f"{namespace}task:{name}"))

    def feed() -> None:  # keeps two tasks from outside waiting until told to stop
        for _ in range(2):
            executor.submit("outside", {})
        while not stop.is_set() and fed.acquire(timeout=30):
            executor.submit("outside", {})
            refilled.release()

    feeder = threading.Thread(target=feed)
    feeder.start()
    wait_for(lambda: order.count("outside") >= 3, "the stream to flow", 30)
    executor.submit("parent", {})
    wait_for(lambda: "child" in order, "the follow-up to run", 30)
    stop.set()
    feeder.join()
    executor.close()
    after = order[order.index("parent") + 1 : order.index("child")]
    assert after.count("outside") <= 1, order


def test_a_task_due_while_one_of_its_merge_key_waits_is_taken_into_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One worker held by a task: a hundred submissions of each of two merge keys leave
    one task of each waiting, which runs with the first one's arguments; once it has
    started, the next submission waits again (it is news to the running one)."""
    recorder = Recorder()
    holding, release = threading.Event(), threading.Event()

    def hold(args: Mapping[str, Any]) -> None:
        holding.set()
        release.wait(60)

    executor = LocalExecutor(workers=1)
    executor.bind(
        {"hold": hold, "flush": recorder.task("flush")},
        Marks(MemoryCache(), lambda name: f"mark:{name}"),
    )
    try:
        executor.submit("hold", {})
        assert holding.wait(60)
        with caplog.at_level(logging.WARNING, logger="shardkit"):
            for n in range(100):
                for key in ("a", "b"):
                    assert executor.submit("flush", {"key": key, "n": n}, merge=f"flush:{key}")
        assert executor.queued == 2
        assert len(caplog.records) == 1  # one line, not one per merged task
        assert "fall behind" in caplog.text
        release.set()
        recorder.wait(2)
        assert [args for _, args, _ in recorder.calls] == [
            {"key": "a", "n": 0},
            {"key": "b", "n": 0},
        ]
        executor.submit("flush", {"key": "a", "n": 100}, merge="flush:a")
        recorder.wait(1)
        assert recorder.calls[-1][1] == {"key": "a", "n": 100}
    finally:
        release.set()
        executor.close()
