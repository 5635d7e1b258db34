"""From a task event to deliveries: one per endpoint that wants it, written before any send.

Fanout runs at least once (a redelivered Celery message runs it again), so a final event
makes at most one delivery per endpoint: the ``dedupe_key`` is unique. Progress events are
not deduplicated: each report is its own message. A final event's fanout settles what the
task's final write recorded as owed (``outbox``), in the transaction that writes it.

The worker publishes no more of what it wrote than the tenant has delivery slots free
(``deliveries.release``); the rest wait in Postgres for an attempt of the tenant to end.

An event's body is stored once, whatever the number of endpoints (``webhook_bodies``): each
delivery names it. A final event's body has an id derived from the task and the event, so a
fanout run again stores no second copy.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import ColumnElement, Connection, Engine, func, select
from sqlalchemy.dialects.postgresql import insert

from broker.db.models import FINAL_COLUMNS, as_task_row
from broker.db.models import tasks_table as tasks
from broker.db.models import webhook_bodies_table as bodies
from broker.db.models import webhook_deliveries_table as deliveries
from broker.db.models import webhooks_table as webhooks
from broker.facades import a2a
from broker.registry.capabilities import any_pattern_allows
from broker.settings import Settings
from broker.tasks.resource import TaskRow, new_task_id, render
from broker.timestamps import iso
from broker.webhooks import outbox
from broker.webhooks.events import PROGRESS
from broker.webhooks.policy import FAILED, PENDING, TASK_EXPIRED

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


def _a2a_push(target: Target, task: TaskRow) -> bool:
    """A task's own callback set as an A2A push config gets A2A's body; every other
    endpoint gets ``body_of``'s."""
    return target[0] is None and a2a.is_push(task.get("callback"))


# The ids of final events' bodies: one per (task, event, kind of body), however often the
# event's fanout runs.
_BODY_IDS = uuid.UUID("6f1d0c9e-4b7a-4d0e-9a51-2c3f8e7d6b10")


def _body_id(task: TaskRow, event_type: str, kind: str) -> uuid.UUID:
    if event_type == PROGRESS:  # each report is its own message
        return new_task_id()
    return uuid.uuid5(_BODY_IDS, f"{task['id']}:{event_type}:{kind}")


# What ``targets`` reads of a task.
_TARGETED_BY: tuple[ColumnElement[Any], ...] = (
    tasks.c.tenant,
    tasks.c.capability,
    tasks.c.callback,
)


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
        row = conn.execute(select(*_TARGETED_BY).where(tasks.c.id == task_id)).first()
        return row is not None and bool(targets(conn, as_task_row(row), event_type))


def fanout(
    engine: Engine, task_id: uuid.UUID, event_type: str, settings: Settings
) -> Written | None:
    """Write the event's deliveries; returns those waiting for their first attempt (of a
    progress report, the ones it wrote), None when the event has none."""
    now = datetime.now(UTC)
    with engine.begin() as conn:
        if event_type != PROGRESS:  # written below, or nothing to write: owed no more
            outbox.settle(conn, task_id)
        # Not the payload: neither body carries it, and it may be large.
        expired = (tasks.c.expires_at <= func.now()).label("expired")
        # A progress fanout reads the latest report when it runs, which may be after the
        # task's end: its subscribers still get the last one (webhooks come in no order;
        # each carries the task's status as it stood then).
        query = select(*FINAL_COLUMNS, expired).where(tasks.c.id == task_id)
        row = conn.execute(query).first()
        if row is None or (row.expired and event_type == PROGRESS):
            return None  # purged, or a report past its task's expiry: nothing left to tell
        task = cast(TaskRow, {k: v for k, v in row._mapping.items() if k != "expired"})
        found = targets(conn, task, event_type)
        if not found:
            return None
        if row.expired:
            # Its fanout came after the task's expiry (a short ``result_ttl_s`` behind a
            # queue): no body may outlive the task, so each delivery is logged failed.
            gone = {"status": FAILED, "finished_at": now, "last_error": TASK_EXPIRED}
            values = [
                _delivery(task, event_type, target, None, task["expires_at"], now, settings) | gone
                for target in found
            ]
            conn.execute(insert(deliveries).values(values).on_conflict_do_nothing())
            return None
        kinds = ["a2a" if _a2a_push(t, task) else "event" for t in found]
        body_ids = {kind: _body_id(task, event_type, kind) for kind in set(kinds)}
        texts = {
            "event": lambda: body_of(event_type, task, now),
            "a2a": lambda: a2a.push_body(render(task)),
        }
        expires_at = body_expiry(task, event_type, now)
        stored = [
            {"id": body_id, "body": texts[kind](), "expires_at": expires_at}
            for kind, body_id in body_ids.items()
        ]
        conn.execute(insert(bodies).values(stored).on_conflict_do_nothing())
        values = [
            _delivery(task, event_type, target, body_ids[kind], expires_at, now, settings)
            for target, kind in zip(found, kinds, strict=True)
        ]
        written = insert(deliveries).values(values).on_conflict_do_nothing()
        if event_type == PROGRESS:
            # Each report's deliveries are its own: an earlier report's have their messages.
            new = conn.execute(written.returning(deliveries.c.id)).scalars()
            return Written(task["tenant"], list(new))
        conn.execute(written)
        # A final event's fanout run again (its first run may have stopped before
        # publishing) finds its deliveries written: those not yet attempted are waiting.
        waiting = select(deliveries.c.id).where(
            deliveries.c.tenant == task["tenant"],  # ix_webhook_deliveries_tenant_task_id
            deliveries.c.task_id == task_id,
            deliveries.c.event_type == event_type,
            deliveries.c.status == PENDING,
            deliveries.c.attempts == 0,
        )
        return Written(task["tenant"], list(conn.execute(waiting).scalars()))


def body_expiry(task: TaskRow, event_type: str, now: datetime) -> datetime:
    """When a body carrying the task (its result too) expires: no later than the task. A
    final event's task expires when its row says. A running task's row is held past its run
    (``broker.tasks.execution``) and its end pulls ``expires_at`` in to the end plus
    ``result_ttl_s``: the body of a progress report, written while it runs, expires at the
    earliest the task can, ``result_ttl_s`` from the report (it outlived the task by up to
    the hold's 6 hours)."""
    if event_type != PROGRESS:
        return task["expires_at"]
    return min(task["expires_at"], now + timedelta(seconds=task["result_ttl_s"]))


def _delivery(
    task: TaskRow,
    event_type: str,
    target: Target,
    body_id: uuid.UUID | None,
    body_expires_at: datetime,
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
        "body_id": body_id,
        "body_expires_at": body_expires_at,
        "trace_id": task["trace_id"],
        "status": PENDING,
        "attempts": 0,
        "final_attempt": len(schedule),
        "next_attempt_at": now + timedelta(seconds=schedule[0]),
        "expires_at": now + timedelta(seconds=settings.webhook_delivery_ttl_s),
    }
