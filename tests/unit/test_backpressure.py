"""The per-queue depth bound, on a stand-in depth reader (no services needed)."""

from __future__ import annotations

import asyncio

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
