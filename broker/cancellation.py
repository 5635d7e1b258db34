"""Cancelling a task: the row moves to ``cancelled`` at once (queued or running), and a flag in
Redis tells a running agent through its context. Whatever the agent does afterwards cannot
move the task: every later write is conditional on ``running``."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, update
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import in_sources
from broker.db.models import tasks_table as tasks
from broker.queries import allowed_by
from broker.tasks import CANCEL, task_error

FLAG_TTL_S = 24 * 3600


def flag_key(task_id: uuid.UUID | str) -> str:
    return f"reach:cancel:{task_id}"


async def cancel(
    engine: AsyncEngine,
    tenant: str,
    task_id: uuid.UUID,
    *,
    patterns: Sequence[str],
) -> dict[str, Any] | None:
    """The cancelled row, or None when the task is unknown, foreign, outside ``patterns``,
    expired or already final."""
    error = task_error("cancelled", "cancelled by the caller")
    query = (
        update(tasks)
        .where(
            tasks.c.id == task_id,
            tasks.c.tenant == tenant,
            allowed_by(patterns, tasks.c.capability),
            in_sources(CANCEL),
            tasks.c.expires_at > func.now(),
        )
        .values(
            status=CANCEL.target,
            error=error,
            finished_at=func.now(),
            expires_at=func.now() + func.make_interval(0, 0, 0, 0, 0, 0, tasks.c.result_ttl_s),
        )
        .returning(*tasks.c)
    )
    async with engine.begin() as conn:
        row = (await conn.execute(query)).first()
    return dict(row._mapping) if row is not None else None
