"""Saying no early: a per-tenant token bucket (429), a per-queue depth bound (503) and one
tenant's share of a queue (429), all decided before anything is written, so a refused request
consumes no idempotency key. And a tenant's fair slice of a queue: where its messages go, at
submit (``QueueBound``) and each time a task's message is published again (``FairPlace``).

The bucket lives in Redis and is updated by one Lua function (``admission`` runs it in the
same script as the route lookup), so every API process shares it and concurrent requests cannot
both take the last token.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kombu.transport.redis import PRIORITY_STEPS
from redis.asyncio import Redis
from sqlalchemy import Engine, Select, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.cache import RecentFigures
from broker.db.models import tasks_table as tasks
from broker.errors import ReachError, Unavailable
from broker.observability import metrics
from broker.tasks.dispatch import redis_lists
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
    """Queue depths straight from a Redis broker: one LLEN per list of each queue (one list
    per priority step, ``dispatch.redis_lists``), no kombu connection."""

    async def depths(queues: list[str]) -> dict[str, int]:
        pipe = client.pipeline(transaction=False)
        for queue in queues:
            for key in redis_lists(queue):
                pipe.llen(key)
        lengths = [int(n) for n in await pipe.execute()]
        per = len(PRIORITY_STEPS)
        return {queue: sum(lengths[i * per : (i + 1) * per]) for i, queue in enumerate(queues)}

    return depths


# (tenant, queue, limit): how many of the tenant's tasks wait in the queue, counted up to limit.
Queued = Callable[[str, str, int], Awaitable[int]]


def queued_query(tenant: str, queue: str, limit: int) -> Select[Any]:
    """A tenant's waiting tasks in a queue, as Postgres holds them, counted up to ``limit``:
    at most that many rows of ``ix_tasks_tenant_status_id`` are read, however many there are."""
    waiting = (
        select(tasks.c.id)
        .where(tasks.c.tenant == tenant, tasks.c.status == QUEUED, tasks.c.queue == queue)
        .limit(limit)
        .subquery()
    )
    return select(func.count()).select_from(waiting)


def postgres_queued(engine: AsyncEngine) -> Queued:
    """``queued_query`` on the API's engine."""

    async def queued(tenant: str, queue: str, limit: int) -> int:
        async with engine.connect() as conn:
            return int(await conn.scalar(queued_query(tenant, queue, limit)) or 0)

    return queued


def count_queued(engine: Engine, tenant: str, queue: str, limit: int) -> int:
    """``queued_query`` on a worker's engine."""
    with engine.connect() as conn:
        return int(conn.scalar(queued_query(tenant, queue, limit)) or 0)


def past_slice(depth: int, waiting: int, fair_slice: int) -> bool:
    """Whether a tenant with ``waiting`` other tasks in a queue that holds ``depth`` messages
    has its next one put behind every other tenant's (a ``fair_slice`` of 0: never)."""
    return 0 < fair_slice <= depth and waiting >= fair_slice


@dataclass
class QueueBound:
    """Refuses work for a queue already holding ``max_depth`` messages. Depths come from the
    broker at most every ``refresh_s``, so a burst of submits costs one broker query. A depth
    older than that but not ``stale_s`` answers once more while a fresh one is read beside
    it: a submit to a quiet API does not wait on the broker for it (0: always read first;
    ``broker.cache.RecentFigures``).

    Tenants share a queue two ways (``queued`` counts a tenant's waiting tasks in it):

    - once it holds ``fair_slice`` messages, a tenant that has that many waiting in it has
      its next ones queued behind every other tenant's (``check`` answers True);
    - once it holds ``share`` (``max_share`` of ``max_depth``), a tenant that has that many
      waiting is refused (429 ``too_many_queued``): one tenant within its rate cannot fill a
      queue every tenant shares.

    Below both nothing is counted, so a quiet queue costs no query; past them, a tenant's
    count is read at most every ``refresh_s`` and counts this process's admissions until the
    next read.

    Admission lets only served capabilities through; still, past ``max_tracked`` queues the
    stale ones are forgotten, so no stream of queue names grows this process's memory."""

    depths: Depths
    max_depth: int
    queued: Queued | None = None
    max_share: float = 1.0
    fair_slice: int = 0
    refresh_s: float = 1.0
    stale_s: float = 5.0
    max_tracked: int = 4096
    _depths: RecentFigures[str] = field(init=False)
    # (tenant, queue): when counted, the count (with this process's admissions since), and
    # the limit it was counted up to
    _counts: dict[tuple[str, str], tuple[float, int, int]] = field(default_factory=dict)
    _count_locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._depths = RecentFigures(self._read_depth, "a queue depth", self.max_tracked)

    async def _read_depth(self, queue: str) -> int:
        return (await self.depths([queue]))[queue]

    @property
    def share(self) -> int:
        """The most waiting tasks of one tenant in a queue that holds this many."""
        return max(1, int(self.max_depth * self.max_share))

    async def check(self, queue: str, tenant: str | None = None, *, turn: bool = False) -> bool:
        """Raises when the queue is full, or ``tenant`` holds its share of it; else whether
        the task goes behind the other tenants' in it. A task let through counts in the
        queue's depth here until the next read: a burst within a second sees itself.

        ``turn``: the task is a session's turn, which may wait for the turns before it with
        no message in the queue (``broker.tasks.turns``), so the queue's depth does not show
        it: its tenant's share is counted whatever the depth. Uncounted, one tenant parked
        thousands of turns in a quiet queue and let them go together (a cancel of each turn
        before them), putting the queue past ``max_depth``: every tenant's submit to it was
        refused 503."""
        depth = await self._depths.get(queue, refresh_s=self.refresh_s, stale_s=self.stale_s)
        if depth >= self.max_depth:
            metrics.rejections.labels("overloaded").inc()
            raise Unavailable(
                f"{queue!r} already holds {depth} waiting tasks",
                code="overloaded",
                retry_after_s=5,
            )
        behind = await self._behind(queue, tenant, depth, turn=turn)
        self._depths.add(queue, 1)
        return behind

    async def _behind(self, queue: str, tenant: str | None, depth: int, *, turn: bool) -> bool:
        """Whether ``tenant``'s next task in a queue holding ``depth`` goes behind the other
        tenants'; raises ``TooManyQueued`` past its share."""
        shared = turn or depth >= self.share
        fair = 0 < self.fair_slice <= depth
        if tenant is None or self.queued is None or not (shared or fair):
            return False
        limit = max(self.share if shared else 0, self.fair_slice if fair else 0)
        key = (tenant, queue)
        waiting = await self._waiting(key, limit)
        if shared and waiting >= self.share:
            metrics.rejections.labels("too_many_queued").inc()
            raise TooManyQueued(
                f"this tenant already has {waiting} of the waiting tasks of {queue!r}"
                f" (a tenant may hold {self.share} once it holds that many)",
                retry_after_s=5,
            )
        counted_at, _, counted_to = self._counts[key]
        self._counts[key] = (counted_at, waiting + 1, counted_to)  # this one, until the next
        return past_slice(depth, waiting, self.fair_slice)

    async def republish_behind(self, queue: str, tenant: str) -> bool:
        """Whether the message of a task of ``tenant`` that waits already (a session's turn a
        cancel let go) goes behind the other tenants' in ``queue``: as ``check`` decides for
        a new one, but never refused (it was accepted) and with the task itself among the
        tenant's waiting ones. Its message counts in the depth until the next read."""
        if self.queued is None or self.fair_slice <= 0:
            return False
        depth = await self._depths.get(queue, refresh_s=self.refresh_s, stale_s=self.stale_s)
        self._depths.add(queue, 1)
        if depth < self.fair_slice:
            return False  # not crowded: nothing counted
        waiting = await self._waiting((tenant, queue), self.fair_slice + 1)
        return past_slice(depth, waiting - 1, self.fair_slice)

    async def _waiting(self, key: tuple[str, str], limit: int) -> int:
        """The tenant's waiting tasks in the queue, counted up to at least ``limit``."""

        def usable(counted: tuple[float, int, int] | None) -> bool:
            return (
                counted is not None
                and time.monotonic() - counted[0] <= self.refresh_s
                and (counted[1] < counted[2] or counted[2] >= limit)  # exact, or far enough
            )

        counted = self._counts.get(key)
        if not usable(counted):
            if len(self._count_locks) >= self.max_tracked:
                _forget_stale(self._count_locks, self._counts, self.refresh_s)
            async with self._count_locks.setdefault(key, asyncio.Lock()):
                counted = self._counts.get(key)
                if not usable(counted):
                    assert self.queued is not None
                    waiting = await self.queued(*key, limit)
                    counted = self._counts[key] = (time.monotonic(), waiting, limit)
        assert counted is not None
        return counted[1]

    async def close(self) -> None:
        """Wait for the depths being read beside requests (before their clients close)."""
        await self._depths.close()

    @property
    def tracked(self) -> int:
        """How many queues, and tenants' shares of them, this bound holds a figure or a lock
        for."""
        return self._depths.tracked + len(self._count_locks.keys() | self._counts.keys())


@dataclass
class FairPlace:
    """Where a worker puts the message of a task it publishes again (a retry, a session's turn
    that came due, a task recovered or moved): behind the other tenants' in its queue when
    the queue holds ``fair_slice`` messages and the tenant has that many other tasks waiting
    in it, as ``QueueBound`` decides at submit. A turn's message from its submit is dropped
    when taken while the turn waits, so the one that runs it is most often published here:
    without this, a session's later turns went in front however much of the queue their
    tenant held.

    For the workers' threads: sync reads (``depth``, a Redis broker's lists; ``queued``,
    Postgres), each figure kept ``refresh_s``, so a burst of retries costs one depth read a
    queue and, only past the slice, one count a tenant. A message published here counts in
    its queue's depth until the next read. A figure that cannot be read puts the message in
    front: the task was accepted, and its message matters more than its place."""

    depth: Callable[[str], int]
    queued: Callable[[str, str, int], int]  # (tenant, queue, limit), as ``Queued``
    fair_slice: int
    refresh_s: float = 1.0
    max_tracked: int = 4096
    # a queue's depth, a (tenant, queue)'s count: when read, and the figure
    _figures: dict[Any, tuple[float, int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def behind(self, queue: str, tenant: str) -> bool:
        """Whether the message of ``tenant``'s task, queued in Postgres, goes behind."""
        if self.fair_slice <= 0:
            return False
        try:
            depth = self._figure(queue, lambda: self.depth(queue), added=1)
            if depth < self.fair_slice:
                return False  # not crowded: nothing counted
            limit = self.fair_slice + 1  # the task itself is one of its tenant's waiting
            waiting = self._figure((tenant, queue), lambda: self.queued(tenant, queue, limit))
        except Exception as exc:  # a broker or a database away: see the docstring
            log.warning("the fair place of a task of %r in %r: %r", tenant, queue, exc)
            return False
        return past_slice(depth, waiting - 1, self.fair_slice)

    def _figure(self, key: Any, read: Callable[[], int], added: int = 0) -> int:
        """The figure of ``key``, read when none is younger than ``refresh_s``; ``added``
        counts in it from now on, until the next read."""
        now = time.monotonic()
        with self._lock:
            known = self._figures.get(key)
            if known is not None and now - known[0] <= self.refresh_s:
                self._figures[key] = (known[0], known[1] + added)
                return known[1]
        figure = read()  # threads racing here read twice, harmlessly
        with self._lock:
            if len(self._figures) >= self.max_tracked and key not in self._figures:
                self._forget_older_than(now - self.refresh_s)
            self._figures[key] = (now, figure + added)
        return figure

    def _forget_older_than(self, cutoff: float) -> None:
        old = [key for key, (at, _) in self._figures.items() if at <= cutoff]
        for key in old or list(self._figures):  # all fresh: start again
            del self._figures[key]

    @property
    def tracked(self) -> int:
        """How many queues' depths and tenants' counts this holds."""
        return len(self._figures)


def _forget_stale(locks: dict[Any, asyncio.Lock], seen: dict[Any, Any], refresh_s: float) -> None:
    """Drop the figures (tuples of the time read, then values) older than ``refresh_s`` that
    no read holds the lock of."""
    cutoff = time.monotonic() - refresh_s
    for key, lock in list(locks.items()):
        figure = seen.get(key)
        if not lock.locked() and (figure is None or figure[0] <= cutoff):
            del locks[key]
            seen.pop(key, None)
