"""What the webhook sweep does to deliveries, on the maintenance worker.

- An attempt whose lease passed without an outcome (its worker died) is taken back: it
  counts as an attempt and is logged as lost, so the schedule's length is the most attempts
  a delivery ever makes; after the last one it is dead.
- A delivery whose message was lost (due a while ago) is published again.
- A body lives only as long as its task: it is removed at the task's expiry, and a delivery
  still waiting is failed; the attempts' log stays.
- A delivery past its retention goes, its attempts with it.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from sqlalchemy import Engine, case, func, select, text, update
from sqlalchemy.dialects.postgresql import insert

from broker.db.models import webhook_attempts_table as attempts_log
from broker.db.models import webhook_deliveries_table as deliveries
from broker.webhooks.deliveries import interval
from broker.webhooks.policy import DEAD, FAILED, PENDING, SENDING

LOST = "lost: no outcome within its lease (its worker stopped?)"
TASK_EXPIRED = "the task expired before the message was delivered; its body is gone"


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
                {
                    "delivery_id": r.id,
                    "attempt": r.attempts,
                    "at": now,
                    "latency_ms": 0,
                    "error": LOST,
                }
                for r in rows
            ]
            # Unless the attempt's own outcome came in after all.
            conn.execute(insert(attempts_log).values(entries).on_conflict_do_nothing())
    return [(r.id, r.attempts + 1) for r in rows if r.status == PENDING]


def stranded(engine: Engine, *, grace_s: float, limit: int) -> list[tuple[uuid.UUID, int]]:
    """Deliveries whose message was lost: due a while ago. Returns (delivery, attempt to
    publish)."""
    query = (
        select(deliveries.c.id, deliveries.c.attempts)
        .where(
            deliveries.c.status == PENDING,
            deliveries.c.next_attempt_at < func.now() - interval(grace_s),
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
