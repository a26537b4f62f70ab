"""``Batches``, the state of combining without locks or I/O: who leads which batch."""

from __future__ import annotations

from shardkit._combine import Batches


def test_the_first_caller_leads_and_takes_everyone_queued_meanwhile() -> None:
    batches: Batches[str] = Batches()
    assert (batches.busy, batches.waiting) == (False, 0)
    assert batches.join("a") is True  # nobody writing: it leads at once
    assert (batches.busy, batches.waiting) == (True, 1)
    assert batches.join("b") is False
    assert batches.join("c") is False
    assert batches.waiting == 3
    assert batches.take() == ["a", "b", "c"]
    assert (batches.busy, batches.waiting) == (True, 0)


def test_finishing_hands_the_next_batch_to_the_first_waiter() -> None:
    batches: Batches[str] = Batches()
    batches.join("a")
    batches.take()
    assert batches.join("b") is False
    assert batches.join("c") is False
    assert batches.finish() == "b"  # the next leader; the batch stays busy for it
    assert batches.busy is True
    assert batches.take() == ["b", "c"]
    assert batches.finish() is None
    assert (batches.busy, batches.waiting) == (False, 0)
    assert batches.join("d") is True


def test_a_claim_succeeds_only_when_no_batch_is_being_written() -> None:
    batches: Batches[str] = Batches()
    assert batches.claim() is True
    assert batches.busy is True
    assert batches.claim() is False
    assert batches.finish() is None
    assert batches.claim() is True


def test_leaving_takes_out_that_very_waiter_once() -> None:
    batches: Batches[list[int]] = Batches()
    first, second, third = [1], [1], [1]  # equal, not the same
    for waiter in (first, second, third):
        batches.join(waiter)
    assert batches.leave(second) is True
    assert batches.waiting == 2
    assert batches.leave(second) is False  # already out
    assert batches.leave([1]) is False  # an equal one was never queued
    taken = batches.take()
    assert len(taken) == 2
    assert taken[0] is first
    assert taken[1] is third
    assert batches.leave(first) is False  # taken: too late to leave
