"""What a tenant's tasks hold in Postgres, and the quota on it.

Every other bound on a tenant is a rate or a size: a tenant held its task rate times the TTL
times a task's size, 17 TB at the defaults (200 tasks/s of 1 MiB for a day), every tenant's
disk. So each task counts what it holds: its payload, its metadata and ``ROW_BYTES`` for the
rest of its row and its index entries. Two statement triggers on ``tasks`` (migration 0016)
add what each INSERT writes to ``tenant_usage`` and take back what each DELETE removes, in
the same transaction, whichever code ran it: the API's grouped inserts, a session's turn, a
withdrawn submit, the janitor. The figure is exact when read; no code path can forget it.

A submit past ``REACH_TENANT_MAX_HELD_BYTES`` is 429 ``quota_exceeded`` before anything is
written (``Quota.check``). An idempotent replay holds nothing new and still gets its task.
Each API process reads a tenant's figure at most once a second, and a figure up to
``stale_s`` old answers while the next is read beside the request, so a submit does not wait
on Postgres for it; the process counts what it admits until the next read. Several API
processes may each admit about a second's worth of the tenant's submits past the quota.

Results are not counted: an agent's answer is bounded per task (``REACH_MAX_RESULT_BYTES``)
and comes from the operator's agents, not the tenant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from sqlalchemy import URL, bindparam, func, select

from broker.cache import RecentFigures
from broker.db.engines import LoopConnection
from broker.db.models import tenant_usage_table as usage
from broker.errors import ReachError
from broker.observability import metrics

# A task's row and index entries beyond its payload and metadata, counted with each: a
# tenant of empty payloads still holds its rows. (The triggers of migration 0016 count the
# same.)
ROW_BYTES = 1024
RETRY_AFTER_S = 60  # tasks expire one by one; a minute is a fair time to look again


class Held(Protocol):
    """A tenant's bytes held, as Postgres counts them."""

    async def __call__(self, tenant: str) -> int: ...

    async def close(self) -> None: ...


class QuotaExceeded(ReachError):
    code = "quota_exceeded"


def task_bytes(payload_size: int, metadata_size: int) -> int:
    """What a new task will hold, as the triggers count it, from its payload's and its
    metadata's sizes as canonical JSON. Postgres prints JSON a few bytes longer, so the check
    may admit a task that ends a few bytes past the quota, never refuse one that fits."""
    return payload_size + metadata_size + ROW_BYTES


_HELD = select(func.coalesce(func.sum(usage.c.bytes), 0).label("held")).where(
    usage.c.tenant == bindparam("tenant")
)


class PostgresHeld:
    """``tenant_usage``'s figure of a tenant (at most 16 rows), on a psycopg connection of its
    own: the read goes out beside a submit, on the API's event loop, and through the
    engine's pool and result layers it cost a quiet sync call about 1.5 ms at its p50
    (``docs/performance.md``)."""

    def __init__(self, url: str | URL) -> None:
        self._db = LoopConnection(url)

    async def __call__(self, tenant: str) -> int:
        return int((await self._db.execute(_HELD, {"tenant": tenant}))[0]["held"])

    async def close(self) -> None:
        await self._db.close()


@dataclass
class Quota:
    """Refuses a tenant's task that would take what its tasks hold past ``limit``."""

    held: Held
    limit: int
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
                f"this tenant's tasks hold {held} bytes; another {size} would pass its quota"
                f" of {self.limit} (REACH_TENANT_MAX_HELD_BYTES) until some expire",
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
