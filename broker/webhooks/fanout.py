"""From a task event to deliveries: one per endpoint that wants it, written before any send.

Fanout runs at least once (a redelivered Celery message runs it again), so a final event
makes at most one delivery per endpoint: the ``dedupe_key`` is unique. Progress events are
not deduplicated: each report is its own message.

The worker publishes no more of what it wrote than the tenant has delivery slots free
(``deliveries.release``); the rest wait in Postgres for an attempt of the tenant to end.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.dialects.postgresql import insert

from broker.db.models import as_task_row
from broker.db.models import tasks_table as tasks
from broker.db.models import webhook_deliveries_table as deliveries
from broker.db.models import webhooks_table as webhooks
from broker.facades import a2a
from broker.registry.capabilities import any_pattern_allows
from broker.settings import Settings
from broker.tasks.resource import TaskRow, new_task_id, render
from broker.timestamps import iso
from broker.webhooks.events import PROGRESS
from broker.webhooks.policy import PENDING

Target = tuple[uuid.UUID | None, str]  # (subscription id, or None for the callback; url)


@dataclass(frozen=True)
class Written:
    """The deliveries of an event not yet attempted, and whose they are."""

    tenant: str
    waiting: list[uuid.UUID]


def body_of(event_type: str, task: TaskRow, at: datetime) -> str:
    """The message body: ``{"type", "timestamp", "data": <the task resource>}``."""
    message = {"type": event_type, "timestamp": iso(at), "data": render(task)}
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False)


def _body_for(target: Target, task: TaskRow, body: str) -> str:
    """A task's own callback set as an A2A push config gets A2A's body; every other
    endpoint gets ``body_of``'s."""
    if target[0] is None and a2a.is_push(task.get("callback")):
        return a2a.push_body(render(task))
    return body


def targets(conn: Connection, task: TaskRow, event_type: str) -> list[Target]:
    """The task's callback when it asked for the event, then each matching subscription."""
    found: list[Target] = []
    callback = task.get("callback")
    if callback and event_type in callback.get("events", []):
        found.append((None, callback["url"]))
    query = select(webhooks.c.id, webhooks.c.url, webhooks.c.capabilities).where(
        webhooks.c.tenant == task["tenant"],
        webhooks.c.disabled_at.is_(None),
        webhooks.c.events.any_() == event_type,
    )
    for row in conn.execute(query.order_by(webhooks.c.id)):
        if not row.capabilities or any_pattern_allows(row.capabilities, task["capability"]):
            found.append((row.id, row.url))
    return found


def wanted(engine: Engine, task_id: uuid.UUID, event_type: str) -> bool:
    """Whether any endpoint wants this event of the task (saves a message per progress
    report when nobody subscribed to progress)."""
    with engine.connect() as conn:
        row = conn.execute(select(tasks).where(tasks.c.id == task_id)).first()
        return row is not None and bool(targets(conn, as_task_row(row), event_type))


def fanout(
    engine: Engine, task_id: uuid.UUID, event_type: str, settings: Settings
) -> Written | None:
    """Write the event's deliveries; returns those not yet attempted, None when the event
    has none."""
    now = datetime.now(UTC)
    with engine.begin() as conn:
        query = select(tasks).where(tasks.c.id == task_id, tasks.c.expires_at > func.now())
        row = conn.execute(query).first()
        if row is None:  # expired or purged already: nothing left to tell
            return None
        task = as_task_row(row)
        found = targets(conn, task, event_type)
        if not found:
            return None
        body = body_of(event_type, task, now)
        values = [
            _delivery(task, event_type, t, _body_for(t, task, body), now, settings) for t in found
        ]
        conn.execute(insert(deliveries).values(values).on_conflict_do_nothing())
        waiting = select(deliveries.c.id).where(
            deliveries.c.task_id == task_id,
            deliveries.c.event_type == event_type,
            deliveries.c.status == PENDING,
            deliveries.c.attempts == 0,
        )
        return Written(task["tenant"], [r.id for r in conn.execute(waiting)])


def _delivery(
    task: TaskRow,
    event_type: str,
    target: Target,
    body: str,
    now: datetime,
    settings: Settings,
) -> dict[str, Any]:
    webhook_id, url = target
    dedupe = None
    if event_type != PROGRESS:
        dedupe = f"{task['id']}:{event_type}:{webhook_id or 'callback'}"
    schedule = settings.webhook_schedule_s
    return {
        "id": new_task_id(),
        "tenant": task["tenant"],
        "webhook_id": webhook_id,
        "task_id": task["id"],
        "event_type": event_type,
        "dedupe_key": dedupe,
        "url": url,
        "body": body,
        # The body carries the task (its result too): it may not outlive it.
        "body_expires_at": task["expires_at"],
        "trace_id": task["trace_id"],
        "status": PENDING,
        "attempts": 0,
        "final_attempt": len(schedule),
        "next_attempt_at": now + timedelta(seconds=schedule[0]),
        "expires_at": now + timedelta(seconds=settings.webhook_delivery_ttl_s),
    }
