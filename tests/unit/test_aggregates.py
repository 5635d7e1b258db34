"""``figures.Aggregates``: a tenant's figures and series one at a time, the same question
answered again within the TTL, the last answer of each kind kept per tenant. And
``TimedCache.computed``: one computation for the readers that ask together."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from broker.cache import TimedCache
from broker.registry.figures import Aggregates
from broker.tenancy.heavy import OneAtATime


def sync(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """An async test run on an event loop of its own."""
    return functools.wraps(test)(lambda: asyncio.run(test()))


class Computing:
    """A stand-in aggregate that counts its runs and how many run at once."""

    def __init__(self) -> None:
        self.runs = 0
        self.running = 0
        self.most = 0
        self.gate = asyncio.Event()

    async def __call__(self, answer: Any = "answer") -> Any:
        self.runs += 1
        self.running += 1
        self.most = max(self.most, self.running)
        await self.gate.wait()
        self.running -= 1
        return answer


@sync
async def test_one_tenants_aggregates_run_one_at_a_time_and_two_tenants_side_by_side() -> None:
    aggregates, work = Aggregates(ttl_s=60), Computing()
    asked = [
        asyncio.create_task(aggregates.get(tenant, "series", n, lambda n=n: work(n)))
        for tenant in ("a", "b")
        for n in range(5)
    ]
    await asyncio.sleep(0.01)
    assert work.running == 2  # one of each tenant's, the others wait
    work.gate.set()
    assert await asyncio.gather(*asked) == [0, 1, 2, 3, 4] * 2
    assert (work.runs, work.most) == (10, 2)
    assert aggregates.tenants_in_progress == 0  # nothing left behind


@sync
async def test_the_same_question_is_computed_once_and_shared_with_those_waiting() -> None:
    aggregates, work = Aggregates(ttl_s=60), Computing()
    asked = [asyncio.create_task(aggregates.get("a", "figures", None, work)) for _ in range(5)]
    await asyncio.sleep(0.01)
    work.gate.set()
    assert await asyncio.gather(*asked) == ["answer"] * 5
    assert await aggregates.get("a", "figures", None, work) == "answer"
    assert work.runs == 1


@sync
async def test_another_question_of_the_kind_replaces_the_answer_kept() -> None:
    aggregates, work = Aggregates(ttl_s=60), Computing()
    work.gate.set()
    assert await aggregates.get("a", "series", 1, lambda: work(1)) == 1
    assert await aggregates.get("a", "series", 2, lambda: work(2)) == 2
    assert await aggregates.get("a", "series", 1, lambda: work(1)) == 1
    assert await aggregates.get("a", "figures", None, lambda: work("f")) == "f"
    assert await aggregates.get("a", "figures", None, lambda: work("g")) == "f"  # kept
    assert work.runs == 4  # 1, 2, 1 again (2 replaced it), then the figures once


@sync
async def test_a_ttl_of_zero_computes_every_time_still_one_at_a_time() -> None:
    aggregates, work = Aggregates(ttl_s=0), Computing()
    asked = [asyncio.create_task(aggregates.get("a", "figures", None, work)) for _ in range(3)]
    await asyncio.sleep(0.01)
    work.gate.set()
    await asyncio.gather(*asked)
    assert (work.runs, work.most) == (3, 1)


@sync
async def test_a_failed_aggregate_lets_the_next_run_and_keeps_nothing() -> None:
    aggregates = Aggregates(ttl_s=60)

    async def broken() -> Any:
        raise RuntimeError("Postgres away")

    with pytest.raises(RuntimeError):
        await aggregates.get("a", "figures", None, broken)
    assert aggregates.tenants_in_progress == 0

    async def fine() -> Any:
        return "answer"

    assert await aggregates.get("a", "figures", None, fine) == "answer"


@sync
async def test_a_cached_value_is_computed_once_for_the_readers_that_ask_meanwhile() -> None:
    cache, work = TimedCache(ttl_s=60), Computing()
    asked = [asyncio.create_task(cache.computed("rates", work)) for _ in range(20)]
    await asyncio.sleep(0.01)
    work.gate.set()
    assert await asyncio.gather(*asked) == ["answer"] * 20
    assert await cache.computed("rates", work) == "answer"  # fresh: not computed again
    assert (work.runs, work.most) == (1, 1)


@sync
async def test_a_reader_that_goes_away_leaves_the_computation_to_the_others() -> None:
    cache, work = TimedCache(ttl_s=60), Computing()
    first = asyncio.create_task(cache.computed("rates", work))
    second = asyncio.create_task(cache.computed("rates", work))
    await asyncio.sleep(0.01)
    first.cancel()  # its request went away
    work.gate.set()
    assert await second == "answer"
    assert work.runs == 1


@sync
async def test_a_failed_computation_fails_its_readers_and_the_next_one_computes_again() -> None:
    cache = TimedCache(ttl_s=60)

    async def broken() -> Any:
        await asyncio.sleep(0.01)
        raise RuntimeError("Postgres away")

    asked = [asyncio.create_task(cache.computed("rates", broken)) for _ in range(3)]
    results = await asyncio.gather(*asked, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)

    async def fine() -> Any:
        return "answer"

    assert await cache.computed("rates", fine) == "answer"


@sync
async def test_a_tenants_reads_of_one_kind_wait_for_each_other_not_for_another_kind() -> None:
    reads, work = OneAtATime(), Computing()

    async def read(tenant: str, kind: str) -> Any:
        async with reads.turn(tenant, kind):
            return await work()

    asked = [
        asyncio.create_task(read("a", kind)) for kind in ("list", "list", "aggregates", "list")
    ]
    await asyncio.sleep(0.01)
    assert (work.running, reads.in_progress) == (2, 2)  # a list and the aggregate
    work.gate.set()
    await asyncio.gather(*asked)
    assert (work.runs, work.most, reads.in_progress) == (4, 2, 0)
