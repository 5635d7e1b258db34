"""What a tenant holds in Postgres (its tasks, its sessions, its webhook deliveries) and in
Redis (its tasks' events), and the quotas on them.

Every other bound on a tenant is a rate or a size: a tenant held its task rate times the TTL
times a task's size, 17 TB at the defaults (200 tasks/s of 1 MiB for a day), every tenant's
disk. So each task counts what it holds: its payload, its metadata and ``ROW_BYTES`` for the
rest of its row and its index entries. Two statement triggers on ``tasks`` (migration 0016)
add what each INSERT writes to ``tenant_usage`` and take back what each DELETE removes, in
the same transaction, whichever code ran it: the API's grouped inserts, a session's turn, a
withdrawn submit, the janitor. The figure is exact when read; no code path can forget it.
A tenant's sessions count in the same figure (migration 0017): each session its state, its
metadata and ``ROW_BYTES``, each revision kept its copy of the state and ``ROW_BYTES``.
Without them a tenant held up to 10,000 sessions of 256 KiB with 20 revisions each, 51 GiB.
Its webhook deliveries count too (migration 0023): each its URL, its dedupe key and
``ROW_BYTES``, and a KiB for each attempt. They are kept ``REACH_WEBHOOK_DELIVERY_TTL_S``
(7 days) whatever their task's TTL: 50 subscriptions made 50 rows of each task, about 11 MB
a second at the default rate, counted nowhere.

A submit past ``REACH_TENANT_MAX_HELD_BYTES`` is 429 ``quota_exceeded`` before anything is
written (``Quota.take``), and so is a session's creation or write through the API
(``api.routes.sessions``; deleting one always goes through, and a task's own session writes
do too: its task was admitted). An idempotent replay holds nothing new and still gets its
task.
Each API process reads a tenant's figure at most once a second, and a figure up to
``stale_s`` old answers while the next is read beside the request, so a submit does not wait
on Postgres for it; the process counts what it admits until the next read. Several API
processes may each admit about a second's worth of the tenant's submits past the quota. A
read gives up ``READ_TIMEOUT_S`` after its call, whatever it waits behind (a Postgres that
says nothing, the reads before it), and the submit that needed it is 503
``service_unavailable``.

Redis holds each task's event log as long as its result: the events its agent streamed and
the final one, which carries the result. An agent that answers with what it was given
(``echo``) put a tenant's payloads in Redis too, the broker's memory and every tenant's,
where the Postgres quota does not reach, and an agent that streams turns a small payload
into megabytes. So the event log's script counts each tenant's bytes in Redis as well
(``broker.tasks.events``, ``RedisHeld`` reads them), and a tenant whose logs hold
``REACH_TENANT_MAX_EVENT_BYTES`` is refused new tasks the same way (``Quotas``) until some
of its logs expire. A submit cannot know what its agent will send back: each counts
``EVENT_BYTES`` (its log's stream and keys, and its status events) until the next read,
and the tasks already admitted may take a tenant past the limit by what they send.

Results in Postgres are not counted: an agent's answer is bounded per task
(``REACH_MAX_RESULT_BYTES``); the event quota bounds the same answers in Redis.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
from sqlalchemy import URL, String, any_, bindparam, func, select
from sqlalchemy.dialects.postgresql import ARRAY

from broker.cache import RecentFigures
from broker.db.engines import LoopConnection
from broker.db.models import tenant_usage_table as usage
from broker.errors import ReachError
from broker.grouping import Grouped
from broker.observability import metrics
from broker.tasks.events import LOG_OVERHEAD_BYTES, tenant_bytes_key

# A task's row and index entries beyond its payload and metadata, counted with each: a
# tenant of empty payloads still holds its rows. (The triggers of migration 0016 count the
# same.)
ROW_BYTES = 1024
RETRY_AFTER_S = 60  # tasks expire one by one; a minute is a fair time to look again
# What a new task's own log holds in Redis before its agent sends anything: its stream and
# keys (``LOG_OVERHEAD_BYTES``, what the event that creates it counts) and its status events,
# queued, running and the final one's envelope (a few hundred bytes).
EVENT_BYTES = LOG_OVERHEAD_BYTES + 1024


class Held(Protocol):
    """A tenant's bytes held, as a store counts them."""

    async def __call__(self, tenant: str) -> int: ...

    async def close(self) -> None: ...


class QuotaExceeded(ReachError):
    code = "quota_exceeded"


def task_bytes(payload_size: int, metadata_size: int) -> int:
    """What a new task will hold, as the triggers count it, from its payload's and its
    metadata's sizes as canonical JSON. Postgres prints JSON a few bytes longer, so the check
    may admit a task that ends a few bytes past the quota, never refuse one that fits."""
    return payload_size + metadata_size + ROW_BYTES


# A tenant's figure read waits at most this, from its call, whatever it waits for: the
# reads grouped before it, the connection, its statement. A read that never returned held every
# new tenant's first submit, which waits for it (``RecentFigures``); past it the read fails as
# an outage does (503 ``service_unavailable``) and nothing is kept of it. As the API's Redis
# client's ``socket_timeout``.
READ_TIMEOUT_S = 5.0
GROUP_MAX_TENANTS = 256

_HELD = (
    select(usage.c.tenant, func.sum(usage.c.bytes).label("held"))
    .where(usage.c.tenant == any_(bindparam("tenants", type_=ARRAY(String))))
    .group_by(usage.c.tenant)
)


class PostgresHeld:
    """``tenant_usage``'s figure of a tenant (at most 16 rows), on a psycopg connection of its
    own: the read goes out beside a submit, on the API's event loop, and through the
    engine's pool and result layers it cost a quiet sync call about 1.5 ms at its p50
    (``docs/performance.md``). The tenants whose figures are due together are read in one
    statement (``Grouped``), one statement at a time on the connection.

    Each caller gives up after ``timeout_s`` of its own: a read queued behind a statement
    Postgres did not answer waited, before, for that statement's end, 10 s past the
    statement's timeout (psycopg's wait on its cancel request, then on the statement). The
    statement is left to end for the others grouped in it, at its own ``timeout_s``: cancelled
    on the server, its connection dropped if Postgres says nothing (``LoopConnection``)."""

    def __init__(self, url: str | URL, *, timeout_s: float = READ_TIMEOUT_S) -> None:
        self._db = LoopConnection(url)
        self.timeout_s = timeout_s
        self._read = Grouped(
            self._read_many, max_items=GROUP_MAX_TENANTS, name="held bytes", retry_alone=False
        )

    async def __call__(self, tenant: str) -> int:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._read(tenant)
        except TimeoutError:
            raise self._outage() from None

    async def close(self) -> None:
        await self._db.close()

    async def _read_many(self, tenants: list[str]) -> list[int]:
        try:
            rows = await self._db.execute(
                _HELD, {"tenants": sorted(set(tenants))}, timeout_s=self.timeout_s
            )
        except TimeoutError:
            raise self._outage() from None
        held = {row["tenant"]: int(row["held"]) for row in rows}
        return [held.get(tenant, 0) for tenant in tenants]

    def _outage(self) -> psycopg.OperationalError:
        return psycopg.OperationalError(
            f"Postgres gave no tenant's bytes held within {self.timeout_s} s"
        )


class RedisHeld:
    """The bytes a tenant's event logs hold in Redis: the sum of its hash's fields for the
    hours still to come (``broker.tasks.events``). The fields of hours past are deleted as
    they are read; the hash itself expires an hour after the tenant's last event's log."""

    def __init__(self, client: Any) -> None:
        self._redis = client  # redis.asyncio

    async def __call__(self, tenant: str) -> int:
        key = tenant_bytes_key(tenant)
        hours = await self._redis.hgetall(key)
        now = int(time.time() // 3600)
        past = [hour for hour in hours if int(hour) <= now]
        if past:
            await self._redis.hdel(key, *past)
        return max(0, sum(int(n) for hour, n in hours.items() if int(hour) > now))

    async def close(self) -> None:
        """The client is the API's own: it closes it."""


@dataclass
class Quota:
    """Refuses a tenant's task that would take what a store holds of it past ``limit``
    (``setting`` names it to the tenant)."""

    held: Held
    limit: int
    setting: str = "REACH_TENANT_MAX_HELD_BYTES"
    what: str = "tasks, webhook deliveries and sessions hold"
    refresh_s: float = 1.0
    stale_s: float = 30.0
    max_tracked: int = 4096
    _figures: RecentFigures[str] = field(init=False)

    def __post_init__(self) -> None:
        self._figures = RecentFigures(self.held, "a tenant's bytes held", self.max_tracked)

    async def take(self, tenant: str, size: int) -> None:
        """Count a task of ``size`` bytes against the tenant, or raise ``QuotaExceeded``.
        A task taken but then not written (a replay, a failure) is ``give_back``-ed."""
        held = await self._figures.get(tenant, refresh_s=self.refresh_s, stale_s=self.stale_s)
        if held + size > self.limit:
            metrics.rejections.labels("quota_exceeded").inc()
            raise QuotaExceeded(
                f"this tenant's {self.what} {held} bytes; another {size} would pass its quota"
                f" of {self.limit} ({self.setting}) until some expire",
                retry_after_s=RETRY_AFTER_S,
                held_bytes=held,
                limit_bytes=self.limit,
            )
        self._figures.add(tenant, size)

    def give_back(self, tenant: str, size: int) -> None:
        self._figures.add(tenant, -size)

    async def close(self) -> None:
        """Wait for the figures read beside requests, then close the reader."""
        await self._figures.close()
        await self.held.close()

    @property
    def tracked(self) -> int:
        return self._figures.tracked


@dataclass
class Quotas:
    """Both quotas a submit passes: its tasks' rows in Postgres (``size`` bytes, exact) and
    their events in Redis (``EVENT_BYTES`` a task until its agent's are counted)."""

    rows: Quota
    events: Quota

    async def take(self, tenant: str, size: int) -> None:
        await self.rows.take(tenant, size)
        try:
            await self.events.take(tenant, EVENT_BYTES)
        except BaseException:
            self.rows.give_back(tenant, size)
            raise

    def give_back(self, tenant: str, size: int) -> None:
        self.rows.give_back(tenant, size)
        self.events.give_back(tenant, EVENT_BYTES)

    async def close(self) -> None:
        await self.rows.close()
        await self.events.close()
