"""The per-queue depth bound and a tenant's share of a queue, on stand-in readers (no services
needed)."""

from __future__ import annotations

import asyncio

import pytest

from broker.errors import Unavailable
from broker.tasks.backpressure import QueueBound, TooManyQueued


async def _no_depth(queues: list[str]) -> dict[str, int]:
    return dict.fromkeys(queues, 0)


def test_given_more_queue_names_than_max_tracked_expect_the_bound_to_hold_no_more() -> None:
    bound = QueueBound(_no_depth, max_depth=10, refresh_s=0, max_tracked=8)

    async def main() -> None:
        for i in range(200):
            await bound.check(f"fresh.q{i}")

    asyncio.run(main())
    assert bound.tracked <= 8


class Depths:
    """A stand-in broker whose queue holds ``depth`` messages; counts the reads."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.reads = 0

    async def __call__(self, queues: list[str]) -> dict[str, int]:
        self.reads += 1
        return dict.fromkeys(queues, self.depth)


def test_given_a_depth_past_refresh_but_not_stale_expect_it_used_while_a_fresh_one_is_read() -> (
    None
):
    broker = Depths(0)
    bound = QueueBound(broker, max_depth=3, refresh_s=0.05, stale_s=60)

    async def main() -> None:
        await bound.check("q")  # read first: nothing known
        broker.depth = 5
        await asyncio.sleep(0.1)
        await bound.check("q")  # past refresh_s: answered from the last depth (0), not refused
        assert broker.reads == 1  # the fresh read is beside this submit, not before it
        await asyncio.sleep(0)  # and lands at the loop's next turn
        assert broker.reads == 2
        try:
            await bound.check("q")  # now it knows the 5
        except Unavailable as exc:
            assert exc.code == "overloaded"
        else:
            raise AssertionError("a full queue let through")

    asyncio.run(main())


def test_given_a_depth_past_stale_or_stale_off_expect_it_read_before_the_answer() -> None:
    for stale_s in (0.05, 0.0):
        broker = Depths(0)
        bound = QueueBound(broker, max_depth=3, refresh_s=0.01, stale_s=stale_s)

        async def main(bound: QueueBound = bound, broker: Depths = broker) -> None:
            await bound.check("q")
            broker.depth = 5
            await asyncio.sleep(0.1)
            try:
                await bound.check("q")
            except Unavailable as exc:
                assert exc.code == "overloaded"
            else:
                raise AssertionError("an old depth let a full queue through")
            assert broker.reads == 2

        asyncio.run(main())


def test_given_a_depth_read_beside_a_request_expect_close_to_wait_for_it() -> None:
    async def main() -> None:
        release = asyncio.Event()
        release.set()
        reads: list[str] = []

        async def slow(queues: list[str]) -> dict[str, int]:
            await release.wait()
            reads.extend(queues)
            return dict.fromkeys(queues, 0)

        bound = QueueBound(slow, max_depth=3, refresh_s=0.01, stale_s=60)
        await bound.check("q")  # read first
        release.clear()
        await asyncio.sleep(0.05)
        await bound.check("q")  # answered from the old depth; the next read waits
        closing = asyncio.create_task(bound.close())
        await asyncio.sleep(0.05)
        assert not closing.done()
        release.set()
        await closing
        assert reads == ["q", "q"]

    asyncio.run(main())


class Queued:
    """A stand-in count of each tenant's waiting tasks; counts the reads."""

    def __init__(self, **waiting: int) -> None:
        self.waiting = waiting
        self.reads: list[str] = []

    async def __call__(self, tenant: str, queue: str, limit: int) -> int:
        self.reads.append(tenant)
        return min(limit, self.waiting.get(tenant, 0))


def test_given_a_queue_below_its_share_expect_no_tenant_counted() -> None:
    counts = Queued(a=100)
    bound = QueueBound(Depths(4), max_depth=100, queued=counts, max_share=0.5)

    async def main() -> None:
        for _ in range(20):
            await bound.check("q", "a")

    asyncio.run(main())
    assert counts.reads == []


def test_given_a_queue_past_its_share_expect_the_tenant_holding_it_refused_and_others_not() -> None:
    counts = Queued(a=5, b=0)
    bound = QueueBound(Depths(5), max_depth=10, queued=counts, max_share=0.5)
    assert bound.share == 5

    async def main() -> None:
        with pytest.raises(TooManyQueued) as refused:
            await bound.check("q", "a")
        assert refused.value.code == "too_many_queued"
        assert refused.value.details["retry_after_s"] >= 1
        await bound.check("q", "b")

    asyncio.run(main())


def test_given_a_session_turn_expect_its_tenant_share_counted_in_a_quiet_queue() -> None:
    """A waiting turn holds no message, so the depth does not show a tenant's parked turns."""
    counts = Queued(a=5, b=4)
    bound = QueueBound(Depths(0), max_depth=10, queued=counts, max_share=0.5)

    async def main() -> None:
        await bound.check("q", "a")  # a plain task in a quiet queue: nothing counted
        assert counts.reads == []
        with pytest.raises(TooManyQueued):
            await bound.check("q", "a", turn=True)
        await bound.check("q", "b", turn=True)  # b's fifth
        assert counts.reads == ["a", "b"]

    asyncio.run(main())


def test_given_a_count_read_expect_this_process_admissions_added_until_the_next() -> None:
    counts = Queued(a=3)
    bound = QueueBound(Depths(5), max_depth=10, queued=counts, max_share=0.5, refresh_s=60)

    async def main() -> None:
        await bound.check("q", "a")  # 3 waiting: a fourth
        await bound.check("q", "a")  # and a fifth, counted here, not read again
        with pytest.raises(TooManyQueued):
            await bound.check("q", "a")

    asyncio.run(main())
    assert counts.reads == ["a"]


def test_given_a_burst_past_the_share_expect_one_count_read_for_it() -> None:
    counts = Queued(a=0)
    bound = QueueBound(Depths(5), max_depth=20, queued=counts, max_share=0.25, refresh_s=60)

    async def main() -> list[BaseException | None]:
        checks = [bound.check("q", "a") for _ in range(8)]
        return await asyncio.gather(*checks, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert counts.reads == ["a"]
    assert outcomes.count(False) == 5  # the share, then refusals
    assert all(isinstance(o, TooManyQueued) for o in outcomes if o is not False)


def test_given_more_tenants_than_max_tracked_expect_the_bound_to_hold_no_more() -> None:
    bound = QueueBound(
        Depths(5), max_depth=1000, queued=Queued(), max_share=0.005, refresh_s=0, max_tracked=8
    )

    async def main() -> None:
        for i in range(200):
            await bound.check("q", f"tenant-{i}")

    asyncio.run(main())
    assert bound.tracked <= 8 + 1  # the tenants' counts, and the queue's depth


def test_given_a_queue_holding_its_fair_slice_expect_a_tenant_holding_as_many_put_behind() -> None:
    counts = Queued(hog=3, calm=1)
    bound = QueueBound(Depths(3), max_depth=100, queued=counts, max_share=0.5, fair_slice=3)

    async def main() -> tuple[bool, bool]:
        return await bound.check("q", "hog"), await bound.check("q", "calm")

    assert asyncio.run(main()) == (True, False)
    assert counts.reads == ["hog", "calm"]


def test_given_admissions_since_the_last_read_expect_them_in_the_depth_until_the_next() -> None:
    broker = Depths(0)
    counts = Queued(hog=3)
    bound = QueueBound(broker, max_depth=5, queued=counts, fair_slice=3, refresh_s=60)

    async def main() -> list[bool]:
        behind = [await bound.check("q", "hog") for _ in range(5)]
        with pytest.raises(Unavailable):  # the five admitted here fill it, unread
            await bound.check("q", "hog")
        return behind

    # The fourth sees the three before it: counted, and put behind.
    assert asyncio.run(main()) == [False, False, False, True, True]
    assert broker.reads == 1
    assert counts.reads == ["hog"]


def test_given_a_queue_below_its_fair_slice_expect_nobody_behind_and_nothing_counted() -> None:
    counts = Queued(hog=50)
    bound = QueueBound(Depths(2), max_depth=100, queued=counts, max_share=0.5, fair_slice=3)

    async def main() -> bool:
        return await bound.check("q", "hog")

    assert asyncio.run(main()) is False
    assert counts.reads == []


def test_given_a_count_up_to_the_fair_slice_expect_it_read_again_for_the_share() -> None:
    counts = Queued(hog=60)
    broker = Depths(5)
    bound = QueueBound(
        broker, max_depth=100, queued=counts, max_share=0.5, fair_slice=3, refresh_s=60, stale_s=0
    )

    async def main() -> None:
        assert await bound.check("q", "hog")  # counted up to 3: enough to put it behind
        broker.depth = 50
        bound._depths.forget("q")  # the queue now holds its share
        with pytest.raises(TooManyQueued):
            await bound.check("q", "hog")  # 3 does not tell: counted again, up to 50

    asyncio.run(main())
    assert counts.reads == ["hog", "hog"]
