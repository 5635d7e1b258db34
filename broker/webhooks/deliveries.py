"""A delivery's attempts, as the webhooks worker makes them: claim, then record the outcome.

Each Celery message names the attempt it is for; the claim only succeeds when the row is
waiting for exactly that attempt (never past the schedule, never with an expired body), so a
duplicated or late message never sends twice. A tenant has at most a set number of attempts
in flight; past it the claim answers ``Busy``. Attempts whose worker died are the sweep's
(``upkeep``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, func, select, update
from sqlalchemy.dialects.postgresql import insert

from broker.db.models import callback_secrets_table as callback_secrets
from broker.db.models import tasks_table as tasks
from broker.db.models import webhook_attempts_table as attempts_log
from broker.db.models import webhook_deliveries_table as deliveries
from broker.db.models import webhooks_table as webhooks
from broker.facades import a2a
from broker.webhooks.policy import PENDING, SENDING, Outcome, Verdict, status_after

EXCERPT_MAX = 512
# A message may arrive a little before its time by the database's clock.
EARLY_TOLERANCE_S = 1.0


def message_id(delivery_id: uuid.UUID) -> str:
    """The ``webhook-id``: fixed per delivery, so the same on every retry."""
    return f"msg_{delivery_id.hex}"


@dataclass(frozen=True)
class Claimed:
    delivery_id: uuid.UUID
    webhook_id: uuid.UUID | None
    url: str
    body: bytes
    trace_id: str
    attempt: int
    final_attempt: int
    secrets: tuple[str, ...]  # every secret that signs now: the new one first
    disabled: bool  # the subscription was disabled (410) after this was written
    # Sent besides the signature: an A2A push config's token and credentials.
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Busy:
    """The tenant already has its most attempts in flight: try this one a little later."""

    inflight: int


def interval(value: float) -> Any:
    """An SQL interval of ``value`` seconds."""
    return func.make_interval(0, 0, 0, 0, 0, 0, value)


def claim(
    engine: Engine, delivery_id: uuid.UUID, attempt: int, *, lease_s: float, max_inflight: int
) -> Claimed | Busy | None:
    """Take attempt ``attempt`` of the delivery; None when it is not this attempt's turn (or
    past the schedule, or its body has expired), Busy when its tenant is at ``max_inflight``."""
    due = (
        deliveries.c.id == delivery_id,
        deliveries.c.attempts == attempt - 1,
        deliveries.c.final_attempt >= attempt,
        deliveries.c.status == PENDING,
        deliveries.c.next_attempt_at <= func.now() + interval(EARLY_TOLERANCE_S),
        deliveries.c.body.is_not(None),
        deliveries.c.body_expires_at > func.now(),
    )
    with engine.begin() as conn:
        tenant = conn.execute(select(deliveries.c.tenant).where(*due)).scalar()
        if tenant is None:
            return None
        # One claim of a tenant at a time: the count and the claim are then one step.
        conn.execute(select(func.pg_advisory_xact_lock(func.hashtext(f"wh-send:{tenant}"))))
        inflight = conn.execute(
            select(func.count())
            .select_from(deliveries)
            .where(
                deliveries.c.tenant == tenant,
                deliveries.c.status == SENDING,
                deliveries.c.lease_until > func.now(),
            )
        ).scalar_one()
        if inflight >= max_inflight:
            return Busy(inflight)
        query = (
            update(deliveries)
            .where(*due)
            .values(status=SENDING, attempts=attempt, lease_until=func.now() + interval(lease_s))
            .returning(*deliveries.c)
        )
        row = conn.execute(query).first()
        if row is None:
            return None
        valid, disabled = _signing(conn, dict(row._mapping))
        headers = _callback_headers(conn, row.task_id) if row.webhook_id is None else {}
    return Claimed(
        delivery_id=row.id,
        webhook_id=row.webhook_id,
        url=row.url,
        body=row.body.encode(),
        trace_id=row.trace_id,
        attempt=attempt,
        final_attempt=row.final_attempt,
        secrets=valid,
        disabled=disabled,
        headers=headers,
    )


def _callback_headers(conn: Connection, task_id: uuid.UUID) -> dict[str, str]:
    callback = conn.execute(select(tasks.c.callback).where(tasks.c.id == task_id)).scalar()
    return a2a.push_headers(callback)


def _signing(conn: Connection, delivery: dict[str, Any]) -> tuple[tuple[str, ...], bool]:
    """The secrets that sign now, and whether the subscription is disabled."""
    if delivery["webhook_id"] is not None:
        query: Any = select(webhooks).where(webhooks.c.id == delivery["webhook_id"])
    else:
        query = select(callback_secrets).where(callback_secrets.c.tenant == delivery["tenant"])
    row = conn.execute(query).first()
    if row is None:
        return (), False
    valid = [row.secret]
    if row.previous_secret and row.previous_secret_expires_at > datetime.now(UTC):
        valid.append(row.previous_secret)
    return tuple(valid), getattr(row, "disabled_at", None) is not None


def due_in_s(engine: Engine, delivery_id: uuid.UUID, attempt: int) -> float | None:
    """Seconds until attempt ``attempt`` is due, when it arrived early; else None."""
    query = select(deliveries.c.next_attempt_at).where(
        deliveries.c.id == delivery_id,
        deliveries.c.attempts == attempt - 1,
        deliveries.c.status == PENDING,
    )
    with engine.connect() as conn:
        due_at = conn.execute(query).scalar()
    if due_at is None:
        return None
    left = (due_at - datetime.now(UTC)).total_seconds()
    return left if left > 0 else None


def record(
    engine: Engine, claimed: Claimed, outcome: Outcome, verdict: Verdict, retry_in_s: float
) -> str:
    """Log the attempt and move the delivery on; returns its new status. A 410 disables the
    subscription in the same transaction."""
    status = status_after(verdict, claimed.attempt, claimed.final_attempt)
    values: dict[str, Any] = {
        "status": status,
        "lease_until": None,
        "last_status_code": outcome.status_code,
        "last_error": outcome.error,
    }
    if status == PENDING:
        values["next_attempt_at"] = func.now() + interval(retry_in_s)
    else:
        values["finished_at"] = func.now()
    with engine.begin() as conn:
        # The sweep may have logged this attempt as lost already: that entry stays.
        logged = insert(attempts_log).values(**_attempt_row(claimed, outcome))
        conn.execute(logged.on_conflict_do_nothing())
        conn.execute(
            update(deliveries)
            .where(
                deliveries.c.id == claimed.delivery_id,
                deliveries.c.status == SENDING,
                deliveries.c.attempts == claimed.attempt,
            )
            .values(**values)
        )
        if verdict == "gone" and claimed.webhook_id is not None:
            conn.execute(
                update(webhooks)
                .where(webhooks.c.id == claimed.webhook_id, webhooks.c.disabled_at.is_(None))
                .values(disabled_at=func.now(), disabled_reason="the endpoint answered 410 Gone")
            )
    return status


def _attempt_row(claimed: Claimed, outcome: Outcome) -> dict[str, Any]:
    return {
        "delivery_id": claimed.delivery_id,
        "attempt": claimed.attempt,
        "at": datetime.now(UTC),
        "status_code": outcome.status_code,
        "error": outcome.error,
        "latency_ms": outcome.latency_ms,
        "address": outcome.address,
        "response_excerpt": (outcome.excerpt or "")[:EXCERPT_MAX] or None,
    }
