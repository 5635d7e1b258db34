"""A delivery's attempts, as the webhooks worker makes them: claim, then record the outcome.

Each Celery message names the attempt it is for; the claim only succeeds when the row is
waiting for exactly that attempt, so a duplicated or late message never sends twice. An
attempt whose worker died is taken back once its lease has passed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, and_, func, insert, or_, select, text, update

from broker.db.models import callback_secrets_table as callback_secrets
from broker.db.models import webhook_attempts_table as attempts_log
from broker.db.models import webhook_deliveries_table as deliveries
from broker.db.models import webhooks_table as webhooks
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


def _seconds(value: float) -> Any:
    return func.make_interval(0, 0, 0, 0, 0, 0, value)


def claim(
    engine: Engine, delivery_id: uuid.UUID, attempt: int, *, lease_s: float
) -> Claimed | None:
    """Take attempt ``attempt`` of the delivery, or None when it is not this attempt's turn."""
    query = (
        update(deliveries)
        .where(
            deliveries.c.id == delivery_id,
            deliveries.c.attempts == attempt - 1,
            or_(
                and_(
                    deliveries.c.status == PENDING,
                    deliveries.c.next_attempt_at <= func.now() + _seconds(EARLY_TOLERANCE_S),
                ),
                and_(deliveries.c.status == SENDING, deliveries.c.lease_until < func.now()),
            ),
        )
        .values(status=SENDING, attempts=attempt, lease_until=func.now() + _seconds(lease_s))
        .returning(*deliveries.c)
    )
    with engine.begin() as conn:
        row = conn.execute(query).first()
        if row is None:
            return None
        valid, disabled = _signing(conn, dict(row._mapping))
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
    )


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
        values["next_attempt_at"] = func.now() + _seconds(retry_in_s)
    else:
        values["finished_at"] = func.now()
    with engine.begin() as conn:
        conn.execute(insert(attempts_log).values(**_attempt_row(claimed, outcome)))
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


def stranded(engine: Engine, *, grace_s: float, limit: int) -> list[tuple[uuid.UUID, int]]:
    """Deliveries whose message was lost: due a while ago, or an attempt whose worker died.
    Returns (delivery, attempt to publish)."""
    query = (
        select(deliveries.c.id, deliveries.c.attempts)
        .where(
            or_(
                and_(
                    deliveries.c.status == PENDING,
                    deliveries.c.next_attempt_at < func.now() - _seconds(grace_s),
                ),
                and_(deliveries.c.status == SENDING, deliveries.c.lease_until < func.now()),
            )
        )
        .limit(limit)
    )
    with engine.connect() as conn:
        return [(r.id, r.attempts + 1) for r in conn.execute(query)]


def purge_expired(engine: Engine, *, batch: int) -> int:
    """Delete one batch of deliveries past their retention (their attempts go with them)."""
    statement = text(
        "DELETE FROM webhook_deliveries WHERE id IN ("
        " SELECT id FROM webhook_deliveries WHERE expires_at <= now()"
        " ORDER BY expires_at LIMIT :batch FOR UPDATE SKIP LOCKED)"
    )
    with engine.begin() as conn:
        return int(conn.execute(statement, {"batch": batch}).rowcount)
