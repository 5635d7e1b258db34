"""Event appends and the door, grouped (``broker.grouping``), against the real Redis: callers
arriving together share one Redis call, and each still gets its own answer."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from broker.registry import leases
from broker.registry.model import READY, CardRef, Lease, now_s
from broker.tasks.admission import Door
from broker.tasks.backpressure import RateLimited, TokenBucket
from broker.tasks.events import EventLog, read_log_sync


async def _counting(url: str, body: Any) -> tuple[Any, int]:
    """Runs ``body(client)``; also how many EVALSHA calls the client sent."""
    client = AsyncRedis.from_url(url)
    calls = 0
    original = client.execute_command

    async def counted(*args: Any, **options: Any) -> Any:
        nonlocal calls
        calls += args[0] == "EVALSHA"
        return await original(*args, **options)

    client.execute_command = counted  # type: ignore[method-assign]
    try:
        return await body(client), calls
    finally:
        await client.aclose()


def test_appends_arriving_together_share_one_call_and_keep_their_order(own_redis: str) -> None:
    tasks = [str(uuid.uuid4()) for _ in range(3)]

    async def body(client: AsyncRedis) -> list[int]:
        log = EventLog(client, ttl_s=60, max_bytes=1 << 20)
        appends = [
            log.append_async(task, "progress", {"n": n}, tenant="t", trace_id="t", push=None)
            for n in range(4)
            for task in tasks
        ]
        return list(await asyncio.gather(*appends))

    seqs, calls = asyncio.run(_counting(own_redis, body))
    assert seqs == [n + 1 for n in range(4) for _ in tasks]  # each task counts from 1
    assert calls == 1
    sync = redis.Redis.from_url(own_redis)
    for task in tasks:
        events = read_log_sync(sync, task)
        assert [e.seq for e in events] == [1, 2, 3, 4]
        assert [e.data for e in events] == [{"n": n} for n in range(4)]


def test_a_grouped_append_pushes_only_its_own_message(own_redis: str) -> None:
    tasks = [str(uuid.uuid4()) for _ in range(3)]

    async def body(client: AsyncRedis) -> None:
        log = EventLog(client, ttl_s=60, max_bytes=1 << 20)
        await asyncio.gather(
            log.append_async(
                tasks[0], "status", {}, tenant="t", trace_id="t", push=("grouped.q", b"m-0")
            ),
            log.append_async(tasks[1], "status", {}, tenant="t", trace_id="t"),
            log.append_async(
                tasks[2], "status", {}, tenant="t", trace_id="t", push=("grouped.q", b"m-2")
            ),
        )

    _, calls = asyncio.run(_counting(own_redis, body))
    assert calls == 1
    assert redis.Redis.from_url(own_redis).lrange("grouped.q", 0, -1) == [b"m-2", b"m-0"]


@pytest.mark.parametrize("burst", [1, 3])
def test_the_door_grants_exactly_the_burst_to_requests_arriving_together(
    own_redis: str, burst: int
) -> None:
    tenant = f"door-{uuid.uuid4().hex[:6]}"

    async def body(client: AsyncRedis) -> list[Any]:
        door = Door(client, TokenBucket(rate_per_s=0.001, burst=burst))
        entries = [door.take(tenant) for _ in range(8)]
        return list(await asyncio.gather(*entries, return_exceptions=True))

    answers, calls = asyncio.run(_counting(own_redis, body))
    assert calls == 1
    refused = [a for a in answers if isinstance(a, BaseException)]
    assert len(answers) - len(refused) == burst
    assert all(isinstance(a, RateLimited) for a in refused)


def live_echo_lease(url: str) -> Lease:
    """A ready instance serving ``echo``, written as a worker writes its lease (and indexed in
    echo's live set until it expires)."""
    instance = f"door-{uuid.uuid4().hex[:6]}@test"
    lease = Lease(
        instance=instance,
        state=READY,
        heartbeat_at=now_s(),
        started_at=now_s() - 60,
        lease_ttl_s=60,
        cards=(CardRef("echo", "1.0.0", "echo"),),
    )
    return leases.renew(redis.Redis.from_url(url), lease)


def served(answer: tuple[float, list[Any]]) -> list[tuple[str, CardRef]]:
    """(instance, card) of each live candidate the door answered."""
    return [(c.lease.instance, c.card) for c in answer[1]]


def test_the_door_reads_the_live_leases_of_requests_arriving_together_in_one_call(
    own_redis: str,
) -> None:
    # Given one live instance serving echo, and none serving a.b
    lease = live_echo_lease(own_redis)

    async def body(client: AsyncRedis) -> list[Any]:
        door = Door(client, TokenBucket(rate_per_s=1, burst=1))
        return list(await asyncio.gather(*(door.live(c) for c in ("echo", "a.b", "echo"))))

    answers, calls = asyncio.run(_counting(own_redis, body))
    assert calls == 1
    echo = [(lease.instance, lease.cards[0])]
    assert [served(a) for a in answers] == [echo, [], echo]


def test_the_door_takes_tokens_and_reads_leases_of_requests_arriving_together_in_one_call(
    own_redis: str,
) -> None:
    """Given a tenant with two tokens, a live instance serving echo, and four small requests
    arriving together, when each takes its token with its route lookup, I expect one Redis
    call, two answered with the live leases and two refused."""
    tenant = f"door-{uuid.uuid4().hex[:6]}"
    lease = live_echo_lease(own_redis)

    async def body(client: AsyncRedis) -> list[Any]:
        door = Door(client, TokenBucket(rate_per_s=0.001, burst=2))
        asks = [door.live(c, metering=tenant) for c in ("echo", "a.b", "echo", "a.b")]
        return list(await asyncio.gather(*asks, return_exceptions=True))

    answers, calls = asyncio.run(_counting(own_redis, body))
    assert calls == 1
    assert [served(a) for a in answers[:2]] == [[(lease.instance, lease.cards[0])], []]
    assert all(isinstance(a, RateLimited) for a in answers[2:])
