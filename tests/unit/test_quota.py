"""``usage.Quota``: a tenant's bytes held, read at most once a refresh and counted in between;
refusals past the limit; a stale figure answering while the next is read beside it."""

from __future__ import annotations

import asyncio

import pytest

from broker.tenancy.usage import Quota, QuotaExceeded
from tests.unit.test_aggregates import sync


class Counted:
    """What Postgres counts for each tenant, and how many reads were made."""

    def __init__(self, **held: int) -> None:
        self.held = held
        self.reads = 0
        self.gate: asyncio.Event | None = None

    async def __call__(self, tenant: str) -> int:
        self.reads += 1
        if self.gate is not None:
            await self.gate.wait()
        return self.held.get(tenant, 0)

    async def close(self) -> None:
        pass


@sync
async def test_a_task_that_would_pass_the_limit_is_refused_with_what_is_held() -> None:
    quota = Quota(Counted(hog=900), limit=1000)
    await quota.take("hog", 100)  # exactly at the limit
    with pytest.raises(QuotaExceeded) as refused:
        await quota.take("hog", 1)
    assert refused.value.code == "quota_exceeded"
    assert refused.value.details["held_bytes"] == 1000
    assert refused.value.details["limit_bytes"] == 1000
    assert refused.value.details["retry_after_s"] >= 1
    await quota.take("calm", 1000)  # another tenant's own count


@sync
async def test_the_tasks_admitted_between_reads_count_and_those_given_back_do_not() -> None:
    counted = Counted()
    quota = Quota(counted, limit=250, refresh_s=3600)
    await quota.take("t", 100)
    await quota.take("t", 100)
    with pytest.raises(QuotaExceeded):
        await quota.take("t", 100)
    quota.give_back("t", 100)  # a replay: it held nothing new
    await quota.take("t", 100)
    assert counted.reads == 1


@sync
async def test_a_stale_figure_answers_while_the_next_is_read_beside_the_request() -> None:
    counted = Counted(t=100)
    quota = Quota(counted, limit=1000, refresh_s=0, stale_s=3600)
    await quota.take("t", 10)  # the first read is waited for
    counted.held["t"] = 950
    counted.gate = asyncio.Event()
    await asyncio.wait_for(quota.take("t", 10), 5)  # answered from 110, the read still out
    for _ in range(10):  # the read, begun beside the answer, starts once the loop turns
        if counted.reads == 2:
            break
        await asyncio.sleep(0)
    assert counted.reads == 2
    counted.gate.set()
    await quota.close()
    with pytest.raises(QuotaExceeded):  # the next take sees the read's 950
        await quota.take("t", 100)


@sync
async def test_requests_that_find_no_figure_wait_for_one_read() -> None:
    counted = Counted(t=10)
    counted.gate = asyncio.Event()
    quota = Quota(counted, limit=1000)
    takes = [asyncio.ensure_future(quota.take("t", 1)) for _ in range(20)]
    await asyncio.sleep(0)
    counted.gate.set()
    await asyncio.gather(*takes)
    assert counted.reads == 1


@sync
async def test_a_failed_read_with_nothing_known_fails_the_request() -> None:
    class Away(Counted):
        async def __call__(self, tenant: str) -> int:
            raise ConnectionError("Postgres away")

    quota = Quota(Away(), limit=1000)
    with pytest.raises(ConnectionError):
        await quota.take("t", 1)
