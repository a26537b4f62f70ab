"""``Sizing``: the windows of a process's writes and when a counter grows, on a clock of
the test's own. Pure: no store, no cache."""

from __future__ import annotations

import threading

import pytest

from shardkit.counters.sizing import BUSY, CONTENDED, SETTLE, WINDOW, Sizing, Window


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_a_window_is_contended_when_busy_and_waiting() -> None:
    assert Window(BUSY, CONTENDED, 1).contended
    assert not Window(BUSY - 1, 1.0, 1).contended
    assert not Window(BUSY, CONTENDED - 0.01, 1).contended


def test_a_window_closes_after_a_second_with_its_writes_waiting_and_writers(clock: Clock) -> None:
    sizing = Sizing(maximum=8, clock=clock)
    clock.now = WINDOW / 2
    assert sizing.timed(0.1, "a") is None
    clock.now = WINDOW
    window = sizing.timed(0.3, "b")
    assert window is not None
    # Beyond the fastest write (0.1 s): 0 and 0.2 s, of 0.4 s.
    assert window == Window(2, pytest.approx(0.5), 2)
    clock.now = 2 * WINDOW - 0.01  # the next window began when this one closed
    assert sizing.timed(0.2) is None
    clock.now = 2 * WINDOW
    # The fastest is the window before's (0.1 s): 0.1 s of each 0.2 s is waiting.
    assert sizing.timed(0.2) == Window(2, pytest.approx(0.5), 1)
    clock.now = 3 * WINDOW
    # The window before's fastest (0.2 s) and this one's (0.3 s): 0.1 s of 0.3 s waits.
    assert sizing.timed(0.3, "a") == Window(1, pytest.approx(1 / 3), 1)


def test_writes_that_took_no_time_wait_for_nothing(clock: Clock) -> None:
    sizing = Sizing(maximum=8, clock=clock)
    clock.now = WINDOW
    assert sizing.timed(0.0) == Window(1, 0.0, 1)


def test_a_window_being_closed_by_another_thread_is_left_to_it(clock: Clock) -> None:
    sizing = Sizing(maximum=8, clock=clock)
    clock.now = WINDOW
    closing = sizing._closing
    assert closing.acquire(blocking=False)
    outcome: list[Window | None] = []
    thread = threading.Thread(target=lambda: outcome.append(sizing.timed(0.1)))
    thread.start()
    thread.join(30)
    closing.release()
    assert outcome == [None]  # it returned at once, the window still open
    assert sizing.timed(0.1) == Window(2, 0.0, 1)


def contended() -> Window:
    return Window(BUSY, CONTENDED, 1)


@pytest.mark.parametrize(
    ("writers", "shards", "grown"),
    [(2, 1, 2), (3, 1, 4), (4, 1, 4), (5, 4, 8), (9, 4, 8), (4, 3, 4)],
)
def test_a_counter_grows_to_its_writers_rounded_up_to_a_power_of_two_at_most_the_maximum(
    clock: Clock, writers: int, shards: int, grown: int
) -> None:
    assert Sizing(maximum=8, clock=clock).grow_to(contended(), writers, shards) == grown


def test_nothing_grows_without_contention_or_past_its_writers_or_its_maximum(
    clock: Clock,
) -> None:
    sizing = Sizing(maximum=8, clock=clock)
    assert sizing.grow_to(Window(BUSY, CONTENDED - 0.01, 4), 4, 1) is None
    assert sizing.grow_to(contended(), 4, 4) is None
    assert sizing.grow_to(contended(), 16, 8) is None
    assert sizing.grow_to(contended(), 2, 1) == 2  # none of those began settling


def test_after_a_growth_the_process_settles_before_deciding_again(clock: Clock) -> None:
    sizing = Sizing(maximum=64, clock=clock)
    clock.now = 5.0
    assert sizing.grow_to(contended(), 2, 1) == 2
    clock.now = 5.0 + SETTLE - 0.01
    assert sizing.grow_to(contended(), 4, 2) is None
    clock.now = 5.0 + SETTLE
    assert sizing.grow_to(contended(), 4, 2) == 4


def test_windows_are_counted_from_when_the_measure_began(clock: Clock) -> None:
    clock.now = 100.0
    sizing = Sizing(maximum=8, clock=clock)
    clock.now = 100.0 + WINDOW / 2
    assert sizing.timed(0.1) is None
    clock.now = 100.0 + WINDOW
    assert sizing.timed(0.1) == Window(2, 0.0, 1)


def test_a_window_another_thread_closed_meanwhile_is_not_closed_again(clock: Clock) -> None:
    """Between a write's look at the clock and its taking the closing lock, another
    thread may close the window: the write then leaves the new window open."""
    sizing = Sizing(maximum=8, clock=clock)

    class Overtaken:
        """The closing lock, taken once another thread has closed the window."""

        def acquire(self, blocking: bool) -> bool:
            sizing._start = clock.now  # where that thread's close began the next window
            return True

        def release(self) -> None:
            pass

    sizing._closing = Overtaken()  # type: ignore[assignment]
    clock.now = WINDOW
    assert sizing.timed(0.1) is None
