"""Saying no early: a per-tenant token bucket (429), a per-queue depth bound (503) and one
tenant's share of a queue (429), all decided before anything is written, so a refused request
consumes no idempotency key.

The bucket lives in Redis and is updated by one Lua function (``admission`` runs it in the
same script as the route lookup), so every API process shares it and concurrent requests cannot
both take the last token.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import tasks_table as tasks
from broker.errors import ReachError, Unavailable
from broker.observability import metrics
from broker.tasks.resource import QUEUED

log = logging.getLogger("reach.api")

# A Lua function, so that admission can run it in the same script as the route lookup.
BUCKET_LUA = """
local function take_token(key, rate, burst, now)
  local state = redis.call('HMGET', key, 'tokens', 'at')
  local tokens, at = tonumber(state[1]) or burst, tonumber(state[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
  local wait = 0
  if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
  redis.call('HSET', key, 'tokens', tokens, 'at', now)
  redis.call('EXPIRE', key, math.ceil(burst / rate) + 1)
  return wait
end
"""


class RateLimited(ReachError):
    code = "rate_limited"


class TooManyQueued(ReachError):
    code = "too_many_queued"


@dataclass(frozen=True)
class TokenBucket:
    """A tenant's rate limit: ``rate_per_s`` sustained, ``burst`` at once."""

    rate_per_s: float
    burst: int

    def key(self, tenant: str) -> str:
        return f"reach:rate:{tenant}"

    def check(self, wait: float) -> None:
        """Raise RateLimited when ``take_token`` answered a wait."""
        if wait > 0:
            metrics.rejections.labels("rate_limited").inc()
            raise RateLimited(
                f"more than {self.rate_per_s:g} tasks/s for this tenant",
                retry_after_s=max(1, round(wait + 0.5)),
            )


Depths = Callable[[list[str]], Awaitable[dict[str, int]]]


def redis_depths(client: Redis) -> Depths:
    """Queue depths straight from a Redis broker: one LLEN per queue, no kombu connection."""

    async def depths(queues: list[str]) -> dict[str, int]:
        pipe = client.pipeline(transaction=False)
        for queue in queues:
            pipe.llen(queue)
        return dict(zip(queues, [int(n) for n in await pipe.execute()], strict=True))

    return depths


# (tenant, queue, limit): how many of the tenant's tasks wait in the queue, counted up to limit.
Queued = Callable[[str, str, int], Awaitable[int]]


def postgres_queued(engine: AsyncEngine) -> Queued:
    """A tenant's waiting tasks in a queue, as Postgres holds them: at most ``limit`` rows of
    ``ix_tasks_tenant_status_id`` are read, however many there are."""

    async def queued(tenant: str, queue: str, limit: int) -> int:
        waiting = (
            select(tasks.c.id)
            .where(tasks.c.tenant == tenant, tasks.c.status == QUEUED, tasks.c.queue == queue)
            .limit(limit)
            .subquery()
        )
        async with engine.connect() as conn:
            return int(await conn.scalar(select(func.count()).select_from(waiting)) or 0)

    return queued


@dataclass
class QueueBound:
    """Refuses work for a queue already holding ``max_depth`` messages. Depths come from the
    broker at most every ``refresh_s``, so a burst of submits costs one broker query. A depth
    older than that but not ``stale_s`` answers once more while a fresh one is read beside
    it: a submit to a quiet API does not wait on the broker for it (0: always read first).

    Once a queue holds ``share`` messages (``max_share`` of ``max_depth``), a tenant holding
    that many of its waiting tasks is refused (429 ``too_many_queued``): one tenant within
    its rate cannot fill a queue every tenant shares. Below it nothing is counted, so a quiet
    queue costs no query; past it, a tenant's count is read at most every ``refresh_s`` and
    counts this process's admissions until the next read.

    Admission lets only served capabilities through; still, past ``max_tracked`` queues the
    stale ones are forgotten, so no stream of queue names grows this process's memory."""

    depths: Depths
    max_depth: int
    queued: Queued | None = None
    max_share: float = 1.0
    refresh_s: float = 1.0
    stale_s: float = 5.0
    max_tracked: int = 4096
    _seen: dict[str, tuple[float, int]] = field(default_factory=dict)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    _refreshing: set[asyncio.Task[tuple[float, int]]] = field(default_factory=set)
    _counts: dict[tuple[str, str], tuple[float, int]] = field(default_factory=dict)
    _count_locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)

    @property
    def share(self) -> int:
        """The most waiting tasks of one tenant in a queue that holds this many."""
        return max(1, int(self.max_depth * self.max_share))

    async def check(self, queue: str, tenant: str | None = None) -> None:
        seen = await self._depth(queue)
        if seen[1] >= self.max_depth:
            metrics.rejections.labels("overloaded").inc()
            raise Unavailable(
                f"{queue!r} already holds {seen[1]} waiting tasks",
                code="overloaded",
                retry_after_s=5,
            )
        if tenant is not None and self.queued is not None and seen[1] >= self.share:
            await self._check_share(tenant, queue)

    async def _check_share(self, tenant: str, queue: str) -> None:
        key = (tenant, queue)
        counted = self._counts.get(key)
        if counted is None or time.monotonic() - counted[0] > self.refresh_s:
            if len(self._count_locks) >= self.max_tracked:
                _forget_stale(self._count_locks, self._counts, self.refresh_s)
            async with self._count_locks.setdefault(key, asyncio.Lock()):
                counted = self._counts.get(key)
                if counted is None or time.monotonic() - counted[0] > self.refresh_s:
                    assert self.queued is not None
                    counted = (time.monotonic(), await self.queued(tenant, queue, self.share))
        if counted[1] >= self.share:
            self._counts[key] = counted
            metrics.rejections.labels("too_many_queued").inc()
            raise TooManyQueued(
                f"this tenant already has {counted[1]} of the waiting tasks of {queue!r}"
                f" (a tenant may hold {self.share} once it holds that many)",
                retry_after_s=5,
            )
        self._counts[key] = (counted[0], counted[1] + 1)  # this one, until the next count

    async def _depth(self, queue: str) -> tuple[float, int]:
        """The last depth read; one refresh in flight per queue, the others use what is known
        (a burst of submits must not become a burst of broker queries)."""
        seen = self._seen.get(queue)
        age = time.monotonic() - seen[0] if seen is not None else math.inf
        if seen is not None and age <= self.refresh_s:
            return seen
        if len(self._locks) >= self.max_tracked:
            _forget_stale(self._locks, self._seen, self.refresh_s)
        lock = self._locks.setdefault(queue, asyncio.Lock())
        if seen is not None and (lock.locked() or age <= self.stale_s):
            if not lock.locked():
                refresh = asyncio.create_task(self._read(queue, lock))
                self._refreshing.add(refresh)  # the loop holds its tasks weakly
                refresh.add_done_callback(self._refreshed)
            return seen
        return await self._read(queue, lock)

    async def _read(self, queue: str, lock: asyncio.Lock) -> tuple[float, int]:
        async with lock:
            seen = self._seen.get(queue)
            if seen is None or time.monotonic() - seen[0] > self.refresh_s:
                depth = (await self.depths([queue]))[queue]
                seen = self._seen[queue] = (time.monotonic(), depth)
            return seen

    async def close(self) -> None:
        """Wait for the depths being read beside requests (before their clients close)."""
        await asyncio.gather(*self._refreshing, return_exceptions=True)

    def _refreshed(self, refresh: asyncio.Task[tuple[float, int]]) -> None:
        self._refreshing.discard(refresh)
        if not refresh.cancelled() and refresh.exception() is not None:
            # The broker away: the next submit past ``stale_s`` reads it and answers 503.
            log.warning("reading a queue depth failed: %r", refresh.exception())

    @property
    def tracked(self) -> int:
        """How many queues, and tenants' shares of them, this bound holds a figure or a lock
        for."""
        return len(self._locks.keys() | self._seen.keys()) + len(
            self._count_locks.keys() | self._counts.keys()
        )


def _forget_stale(
    locks: dict[Any, asyncio.Lock], seen: dict[Any, tuple[float, int]], refresh_s: float
) -> None:
    """Drop the figures older than ``refresh_s`` that no read holds the lock of."""
    cutoff = time.monotonic() - refresh_s
    for key, lock in list(locks.items()):
        figure = seen.get(key)
        if not lock.locked() and (figure is None or figure[0] <= cutoff):
            del locks[key]
            seen.pop(key, None)
