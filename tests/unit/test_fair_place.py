"""Where a task's message goes when it is published again (a retry, a session's turn that came
due, a recovery): ``FairPlace`` on the workers, ``QueueBound.republish_behind`` on a cancel,
on stand-in readers (no services needed)."""

from __future__ import annotations

import asyncio

import pytest

from broker.tasks.backpressure import FairPlace, QueueBound


class Depth:
    """A stand-in broker whose queues hold ``depth`` messages; counts the reads."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.reads = 0

    def __call__(self, queue: str) -> int:
        self.reads += 1
        return self.depth


class Queued:
    """A stand-in database: each tenant's queued tasks (the republished one among them),
    counted up to the limit asked; records whose were read."""

    def __init__(self, **counts: int) -> None:
        self.counts = counts
        self.reads: list[str] = []

    def __call__(self, tenant: str, queue: str, limit: int) -> int:
        self.reads.append(tenant)
        return min(self.counts.get(tenant, 0), limit)


def test_given_a_tenant_holding_its_slice_besides_the_task_expect_it_behind_and_another_not() -> (
    None
):
    # the hog has 3 others waiting besides the one published again; calm has 2
    counts = Queued(hog=4, calm=3)
    place = FairPlace(Depth(10), counts, fair_slice=3)
    assert place.behind("q", "hog") is True
    assert place.behind("q", "calm") is False
    assert counts.reads == ["hog", "calm"]


def test_given_a_queue_below_its_slice_expect_it_in_front_and_nothing_counted() -> None:
    counts = Queued(hog=50)
    place = FairPlace(Depth(2), counts, fair_slice=3)
    assert place.behind("q", "hog") is False
    assert counts.reads == []


def test_given_a_burst_expect_one_read_each_and_its_own_messages_in_the_depth() -> None:
    broker, counts = Depth(1), Queued(hog=10)
    place = FairPlace(broker, counts, fair_slice=3, refresh_s=60)
    # the depth read was 1: the first two go in front, and then the queue holds the slice
    assert [place.behind("q", "hog") for _ in range(5)] == [False, False, True, True, True]
    assert broker.reads == 1
    assert counts.reads == ["hog"]


def test_given_figures_older_than_refresh_expect_them_read_again() -> None:
    broker, counts = Depth(5), Queued(hog=10)
    place = FairPlace(broker, counts, fair_slice=3, refresh_s=0)
    assert place.behind("q", "hog") and place.behind("q", "hog")
    assert broker.reads == 2
    assert counts.reads == ["hog", "hog"]


def test_given_no_slice_expect_nothing_read() -> None:
    broker, counts = Depth(100), Queued(hog=100)
    assert FairPlace(broker, counts, fair_slice=0).behind("q", "hog") is False
    assert (broker.reads, counts.reads) == (0, [])


def test_given_a_reader_that_fails_expect_the_message_in_front_not_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def away(tenant: str, queue: str, limit: int) -> int:
        raise ConnectionError("the database is away")

    assert FairPlace(Depth(10), away, fair_slice=3).behind("q", "hog") is False
    assert "the database is away" in caplog.text


def test_given_more_tenants_than_max_tracked_expect_no_more_figures_kept() -> None:
    place = FairPlace(Depth(10), Queued(), fair_slice=3, refresh_s=0, max_tracked=8)
    for i in range(200):
        place.behind(f"q{i % 3}", f"tenant-{i}")
    assert place.tracked <= 8


class AsyncDepths:
    def __init__(self, depth: int) -> None:
        self.depth = depth

    async def __call__(self, queues: list[str]) -> dict[str, int]:
        return dict.fromkeys(queues, self.depth)


class AsyncQueued:
    def __init__(self, **counts: int) -> None:
        self.counts = Queued(**counts)

    async def __call__(self, tenant: str, queue: str, limit: int) -> int:
        return self.counts(tenant, queue, limit)


def test_given_a_cancel_releasing_a_turn_in_a_full_queue_expect_a_place_not_a_refusal() -> None:
    # the queue is at its bound and the hog holds its share: a submit would be refused
    counts = AsyncQueued(hog=10, calm=3)
    bound = QueueBound(AsyncDepths(10), max_depth=10, queued=counts, max_share=0.5, fair_slice=3)

    async def main() -> tuple[bool, bool]:
        return await bound.republish_behind("q", "hog"), await bound.republish_behind("q", "calm")

    # the calm tenant's 3 waiting are its released turn and 2 others: below its slice
    assert asyncio.run(main()) == (True, False)
