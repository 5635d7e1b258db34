"""A read or a computation the cache shares between requests runs in no request's context:
it ran in the first asker's, so what it logged (a store away, for everyone) carried that
request's trace id and tenant."""

from __future__ import annotations

import asyncio
from typing import Any

from broker.cache import RecentFigures, TimedCache
from broker.observability import logs


def in_a_request(shared: Any) -> list[dict[str, Any]]:
    """The log context ``shared`` (given a recorder) ran in, asked from within a request."""
    seen: list[dict[str, Any]] = []

    async def record(*_: Any) -> int:
        seen.append(logs.current())
        return 1

    async def request() -> None:
        logs.bind(trace_id="a" * 32, tenant="tenant-a")
        await shared(record)

    asyncio.run(request())
    return seen


def test_a_shared_computation_runs_in_no_requests_context() -> None:
    cache = TimedCache(ttl_s=60)
    seen = in_a_request(lambda record: cache.computed("key", record))
    assert seen == [{}]


def test_a_shared_read_runs_in_no_requests_context() -> None:
    async def ask(record: Any) -> int:
        figures: RecentFigures[str] = RecentFigures(read=record)
        return await figures.get("key", refresh_s=1, stale_s=0)

    assert in_a_request(ask) == [{}]
