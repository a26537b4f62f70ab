"""FailureLog: an outage of one kind of call is logged in a few lines that count every
failure, on a clock the test moves."""

from __future__ import annotations

import logging
import re

import pytest

from shardkit._failures import FailureLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def failures(clock: Clock) -> FailureLog:
    return FailureLog(logging.getLogger("shardkit.test"), every=10.0, quiet=1.0, clock=clock)


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [record.getMessage() for record in caplog.records]
    caplog.clear()
    return lines


def _held(line: str) -> int:
    found = re.search(r"\(and (\d+) more not logged\)", line)
    return int(found[1]) if found else 0


def test_an_outage_logs_its_first_failure_one_line_per_interval_and_its_end(
    failures: FailureLog, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "shardkit.test")
    failures.failed("reading", "cache %s failed: %s", "redis://x", "refused")
    assert _lines(caplog) == ["cache redis://x failed: refused"]
    for _ in range(999):  # 25 s of failures, 40 a second
        clock.now += 0.025
        failures.failed("reading", "cache %s failed: %s", "redis://x", "refused")
    periodic = _lines(caplog)
    assert len(periodic) == 2  # at 10 s and 20 s
    assert all(line.startswith("cache redis://x failed: refused (and ") for line in periodic)

    failures.worked("reading")  # too soon after the last failure: still the outage
    assert _lines(caplog) == []
    clock.now += 1.0
    failures.worked("reading")
    failures.worked("reading")
    (end,) = _lines(caplog)
    total, late = re.fullmatch(
        r"reading works again: (\d+) failures in 25\.0 s \((\d+) not logged until now\)",
        end,
    ).groups()  # type: ignore[union-attr]
    assert int(total) == 1000
    assert 1 + len(periodic) + sum(map(_held, periodic)) + int(late) == 1000


def test_failures_between_successes_stay_one_outage(
    failures: FailureLog, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A call that fails one time in ten, under load: the successes in between do not end
    the outage, so it is not logged anew every time."""
    caplog.set_level(logging.WARNING, "shardkit.test")
    for call in range(2000):  # 20 s
        clock.now += 0.01
        if call % 10 == 0:
            failures.failed("adjusting", "failed while adjusting")
        else:
            failures.worked("adjusting")
    assert len(_lines(caplog)) == 2  # the first failure, and one 10 s later


def test_kinds_are_apart_and_a_kind_that_never_failed_logs_nothing(
    failures: FailureLog, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "shardkit.test")
    failures.worked("reading")
    failures.failed("reading", "reading failed")
    failures.failed("adjusting", "adjusting failed")
    clock.now += 5.0
    failures.worked("adjusting")
    assert _lines(caplog) == [
        "reading failed",
        "adjusting failed",
        "adjusting works again: 1 failures in 0.0 s (0 not logged until now)",
    ]
    failures.failed("reading", "reading failed")  # 5 s after the first: held
    assert _lines(caplog) == []
