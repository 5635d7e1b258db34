"""A delivery's attempts, as the webhooks worker makes them: claim, then record the outcome.

Each Celery message names the attempt it is for; the claim only succeeds when the row is
waiting for exactly that attempt, so a duplicated or late message never sends twice. A
tenant has at most a set number of attempts in flight; past it the claim answers ``Busy``.
An attempt whose lease passed without an outcome (its worker died) is taken back by the
sweep: it counts as an attempt, so the schedule's length is the most a delivery ever makes.
A body lives only as long as its task: the sweep removes it at the task's expiry.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, case, func, select, text, update
from sqlalchemy.dialects.postgresql import insert

from broker.db.models import callback_secrets_table as callback_secrets
from broker.db.models import webhook_attempts_table as attempts_log
from broker.db.models import webhook_deliveries_table as deliveries
from broker.db.models import webhooks_table as webhooks
from broker.webhooks.policy import (
    DEAD,
    FAILED,
    PENDING,
    SENDING,
    Outcome,
    Verdict,
    status_after,
)

EXCERPT_MAX = 512
# A message may arrive a little before its time by the database's clock.
EARLY_TOLERANCE_S = 1.0
LOST = "lost: no outcome within its lease (its worker stopped?)"
TASK_EXPIRED = "the task expired before the message was delivered; its body is gone"


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


@dataclass(frozen=True)
class Busy:
    """The tenant already has its most attempts in flight: try this one a little later."""

    inflight: int


def _seconds(value: float) -> Any:
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
        deliveries.c.next_attempt_at <= func.now() + _seconds(EARLY_TOLERANCE_S),
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
            .values(status=SENDING, attempts=attempt, lease_until=func.now() + _seconds(lease_s))
            .returning(*deliveries.c)
        )
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


def take_back_lost(engine: Engine, *, limit: int) -> list[tuple[uuid.UUID, int]]:
    """Attempts whose lease passed without an outcome: each is logged as a lost attempt, and
    its delivery is due again at once, or dead when that was its last attempt. Returns
    (delivery, attempt to publish) for those due again."""
    lost = (
        select(deliveries.c.id)
        .where(deliveries.c.status == SENDING, deliveries.c.lease_until < func.now())
        .limit(limit)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    last = deliveries.c.attempts >= deliveries.c.final_attempt
    query = (
        update(deliveries)
        .where(deliveries.c.id.in_(lost))
        .values(
            status=case((last, DEAD), else_=PENDING),
            lease_until=None,
            next_attempt_at=func.now(),
            finished_at=case((last, func.now()), else_=None),
            last_status_code=None,
            last_error=LOST,
        )
        .returning(deliveries.c.id, deliveries.c.attempts, deliveries.c.status)
    )
    with engine.begin() as conn:
        rows = conn.execute(query).all()
        if rows:
            now = datetime.now(UTC)
            entries = [
                {"delivery_id": r.id, "attempt": r.attempts, "at": now, "latency_ms": 0}
                for r in rows
            ]
            # Unless the attempt's own outcome came in after all.
            lost_log = insert(attempts_log).values([{**e, "error": LOST} for e in entries])
            conn.execute(lost_log.on_conflict_do_nothing())
    return [(r.id, r.attempts + 1) for r in rows if r.status == PENDING]


def stranded(engine: Engine, *, grace_s: float, limit: int) -> list[tuple[uuid.UUID, int]]:
    """Deliveries whose message was lost: due a while ago. Returns (delivery, attempt to
    publish)."""
    query = (
        select(deliveries.c.id, deliveries.c.attempts)
        .where(
            deliveries.c.status == PENDING,
            deliveries.c.next_attempt_at < func.now() - _seconds(grace_s),
        )
        .limit(limit)
    )
    with engine.connect() as conn:
        return [(r.id, r.attempts + 1) for r in conn.execute(query)]


def purge_expired_bodies(engine: Engine, *, batch: int, max_batches: int = 20) -> int:
    """Remove the bodies whose task has expired, in bounded batches (the attempts' log
    stays). A delivery still waiting for an attempt is failed: there is nothing left to send.
    One in flight is left to finish; the next sweep takes its body."""
    expired = (
        select(deliveries.c.id)
        .where(
            deliveries.c.body.is_not(None),
            deliveries.c.body_expires_at <= func.now(),
            deliveries.c.status != SENDING,
        )
        .order_by(deliveries.c.body_expires_at)
        .limit(batch)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    waiting = deliveries.c.status == PENDING
    query = (
        update(deliveries)
        .where(deliveries.c.id.in_(expired))
        .values(
            body=None,
            status=case((waiting, FAILED), else_=deliveries.c.status),
            finished_at=case((waiting, func.now()), else_=deliveries.c.finished_at),
            last_error=case((waiting, TASK_EXPIRED), else_=deliveries.c.last_error),
        )
    )
    removed = 0
    for _ in range(max_batches):
        with engine.begin() as conn:
            count = int(conn.execute(query).rowcount)
        removed += count
        if count < batch:
            break
    return removed


def purge_expired(engine: Engine, *, batch: int) -> int:
    """Delete one batch of deliveries past their retention (their attempts go with them)."""
    statement = text(
        "DELETE FROM webhook_deliveries WHERE id IN ("
        " SELECT id FROM webhook_deliveries WHERE expires_at <= now()"
        " ORDER BY expires_at LIMIT :batch FOR UPDATE SKIP LOCKED)"
    )
    with engine.begin() as conn:
        return int(conn.execute(statement, {"batch": batch}).rowcount)
