"""Task rows written straight into Postgres, for tests that need a state no request makes (a
row whose message was lost, a name reserved after it was queued, any status at all)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, insert

from broker import jsonbody
from broker.db.models import tasks_table


def a_task_row(
    engine: Engine,
    *,
    tenant: str,
    capability: str = "echo",
    status: str = "queued",
    payload: Any = None,
    age: timedelta = timedelta(0),
    deadline_at: datetime | None = None,
) -> uuid.UUID:
    """A task of ``tenant`` in ``status``, created ``age`` ago, with no message anywhere."""
    payload = {} if payload is None else payload
    task_id = uuid.uuid4()
    digest, size = jsonbody.digest(payload)
    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(
            insert(tasks_table).values(
                id=task_id,
                tenant=tenant,
                capability=capability,
                queue=capability,
                status=status,
                payload=payload,
                payload_digest=digest,
                payload_size=size,
                trace_id=uuid.uuid4().hex,
                result_ttl_s=600,
                created_at=now - age,
                deadline_at=deadline_at,
                expires_at=now + timedelta(minutes=10),
            )
        )
    return task_id
