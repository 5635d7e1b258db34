"""Task and delivery rows written straight into Postgres, for tests that need a state no
request makes (a row whose message was lost, a name reserved after it was queued, any status
at all, a delivery whose body has expired)."""

from __future__ import annotations

import secrets
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, insert

from broker import jsonbody
from broker.db.models import tasks_table
from broker.db.models import webhook_bodies_table as bodies_table
from broker.db.models import webhook_deliveries_table as deliveries_table


def a_task_row(
    engine: Engine,
    *,
    tenant: str,
    capability: str = "echo",
    status: str = "queued",
    payload: Any = None,
    age: timedelta = timedelta(0),
    deadline_at: datetime | None = None,
    turn: tuple[str, int] | None = None,
) -> uuid.UUID:
    """A task of ``tenant`` in ``status``, created ``age`` ago, with no message anywhere;
    ``turn``: (session, turn) it takes in a session's order."""
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
                session_id=None if turn is None else turn[0],
                session_turn=None if turn is None else turn[1],
            )
        )
    return task_id


def a_delivery_row(
    engine: Engine,
    *,
    body: str = "{}",
    body_expires_in: timedelta,
    final_attempt: int = 3,
    tenant: str | None = None,
    due_for: timedelta = timedelta(0),
) -> uuid.UUID:
    """A webhook delivery of ``tenant`` (else a fresh one), pending its first attempt, due
    ``due_for`` ago and with no message anywhere."""
    delivery_id, now = uuid.uuid4(), datetime.now(UTC)
    values = {
        "id": delivery_id,
        "tenant": tenant or f"t-{secrets.token_hex(4)}",
        "task_id": uuid.uuid4(),
        "event_type": "task.succeeded",
        "url": "http://127.0.0.1:9/hook",
        "body_expires_at": now + body_expires_in,
        "trace_id": secrets.token_hex(16),
        "status": "pending",
        "attempts": 0,
        "final_attempt": final_attempt,
        "next_attempt_at": now - due_for,
        "expires_at": now + timedelta(days=7),
    }
    with engine.begin() as conn:
        values["body_id"] = a_body_row(conn, body, values["body_expires_at"])
        conn.execute(insert(deliveries_table).values(values))
    return delivery_id


def a_body_row(conn: Connection, body: str, expires_at: datetime) -> uuid.UUID:
    """A stored webhook body, as fanout writes one for an event's deliveries."""
    body_id = uuid.uuid4()
    conn.execute(insert(bodies_table).values(id=body_id, body=body, expires_at=expires_at))
    return body_id
