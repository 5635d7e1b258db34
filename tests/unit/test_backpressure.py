"""The per-queue depth bound, on a stand-in depth reader (no services needed)."""

from __future__ import annotations

import asyncio

import pytest

from broker.errors import Unavailable
from broker.tasks.backpressure import QueueBound


async def _no_depth(queues: list[str]) -> dict[str, int]:
    return dict.fromkeys(queues, 0)


def test_given_more_queue_names_than_max_tracked_expect_the_bound_to_hold_no_more() -> None:
    bound = QueueBound(_no_depth, max_depth=10, refresh_s=0, max_tracked=8)

    async def main() -> None:
        for i in range(200):
            await bound.check(f"fresh.q{i}")

    asyncio.run(main())
    assert bound.tracked <= 8


class Broker:
    """Depths on demand: each read waits until ``answer`` is set, and counts."""

    def __init__(self) -> None:
        self.depth = 0
        self.reads = 0
        self.fail = False
        self.answer = asyncio.Event()

    async def depths(self, queues: list[str]) -> dict[str, int]:
        self.reads += 1
        await self.answer.wait()
        if self.fail:
            raise ConnectionError("broker gone")
        return dict.fromkeys(queues, self.depth)


def test_a_stale_depth_answers_at_once_while_one_new_read_runs_in_the_background() -> None:
    broker = Broker()
    bound = QueueBound(broker.depths, max_depth=10, refresh_s=0)

    async def main() -> None:
        broker.answer.set()
        await bound.check("q")  # the first read is waited for
        assert broker.reads == 1
        broker.answer.clear()
        broker.depth = 50
        for _ in range(20):  # stale now: answered from what is known, one read started
            await asyncio.wait_for(bound.check("q"), 1)
        await asyncio.sleep(0)
        assert broker.reads == 2
        broker.answer.set()
        await asyncio.sleep(0.01)  # the background read lands
        with pytest.raises(Unavailable) as raised:  # the new depth, 50, is over the bound
            await bound.check("q")
        assert raised.value.code == "overloaded"

    asyncio.run(main())


def test_a_background_read_that_fails_makes_the_next_check_read_in_line() -> None:
    broker = Broker()
    bound = QueueBound(broker.depths, max_depth=10, refresh_s=0)

    async def main() -> None:
        broker.answer.set()
        await bound.check("q")
        broker.fail = True
        await bound.check("q")  # stale: answered, and a read that fails runs behind it
        await asyncio.sleep(0.01)
        with pytest.raises(ConnectionError):  # the failed read's depth is not trusted
            await bound.check("q")
        assert broker.reads == 3

    asyncio.run(main())
