"""What a worker does to a task row: claim it, report progress, record the outcome.

Every write is conditional on the status it expects, so a redelivered message or a late write
never moves a task backwards or out of a final state.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, func, text, update

from broker.db.models import tasks_table as tasks
from broker.tasks import FAILED, QUEUED, RUNNING, SUCCEEDED


@dataclass(frozen=True)
class Claimed:
    task_id: uuid.UUID
    capability: str
    payload: Any
    trace_id: str
    attempt: int
    deadline_at: datetime | None
    session_id: str | None
    metadata: dict[str, Any]
    result_ttl_s: int


def _expiry() -> Any:
    return func.now() + func.make_interval(0, 0, 0, 0, 0, 0, tasks.c.result_ttl_s)


def claim(
    engine: Engine, task_id: uuid.UUID, *, agent_id: str, version: str, instance: str
) -> Claimed | None:
    """Move queued -> running and take the payload in one statement; None if not queued."""
    query = (
        update(tasks)
        .where(tasks.c.id == task_id, tasks.c.status == QUEUED, tasks.c.expires_at > func.now())
        .values(
            status=RUNNING,
            started_at=func.now(),
            attempts=tasks.c.attempts + 1,
            agent_id=agent_id,
            agent_version=version,
            instance=instance,
        )
        .returning(
            tasks.c.id,
            tasks.c.capability,
            tasks.c.payload,
            tasks.c.trace_id,
            tasks.c.attempts,
            tasks.c.deadline_at,
            tasks.c.session_id,
            tasks.c.metadata,
            tasks.c.result_ttl_s,
        )
    )
    with engine.begin() as conn:
        row = conn.execute(query).first()
    if row is None:
        return None
    return Claimed(
        task_id=row.id,
        capability=row.capability,
        payload=row.payload,
        trace_id=row.trace_id,
        attempt=row.attempts,
        deadline_at=row.deadline_at,
        session_id=row.session_id,
        metadata=row.metadata,
        result_ttl_s=row.result_ttl_s,
    )


def report_progress(engine: Engine, task_id: uuid.UUID, progress: dict[str, Any]) -> bool:
    with engine.begin() as conn:
        result = conn.execute(
            update(tasks)
            .where(tasks.c.id == task_id, tasks.c.status == RUNNING)
            .values(progress=progress)
        )
    return result.rowcount == 1


def succeed(engine: Engine, task_id: uuid.UUID, result: Any) -> dict[str, Any] | None:
    """The finished row, or None when the task was no longer running (cancelled, say)."""
    return _finish(engine, task_id, status=SUCCEEDED, result=result)


def fail(engine: Engine, task_id: uuid.UUID, error: dict[str, Any]) -> dict[str, Any] | None:
    """Fail a running task, or a queued one that cannot be run (no such capability here)."""
    return _finish(engine, task_id, status=FAILED, error=error, from_status=(RUNNING, QUEUED))


def _finish(
    engine: Engine,
    task_id: uuid.UUID,
    *,
    status: str,
    from_status: tuple[str, ...] = (RUNNING,),
    **outcome: Any,
) -> dict[str, Any] | None:
    query = (
        update(tasks)
        .where(tasks.c.id == task_id, tasks.c.status.in_(from_status))
        .values(status=status, finished_at=func.now(), expires_at=_expiry(), **outcome)
        .returning(*tasks.c)
    )
    with engine.begin() as conn:
        row = conn.execute(query).first()
    return dict(row._mapping) if row is not None else None


def purge_expired(engine: Engine, *, batch: int, max_batches: int = 100) -> int:
    """Delete expired rows in bounded batches, so one run never holds a long transaction."""
    statement = text(
        "DELETE FROM tasks WHERE id IN ("
        " SELECT id FROM tasks WHERE expires_at <= now()"
        " ORDER BY expires_at LIMIT :batch FOR UPDATE SKIP LOCKED)"
    )
    removed = 0
    for _ in range(max_batches):
        with engine.begin() as conn:
            count = conn.execute(statement, {"batch": batch}).rowcount
        removed += count
        if count < batch:
            break
    return removed
