"""What the webhook sweep does to deliveries, on the maintenance worker.

- An attempt whose lease passed without an outcome (its worker died) is taken back: it
  counts as an attempt and is logged as lost, so the schedule's length is the most attempts
  a delivery ever makes; after the last one it is dead.
- A delivery whose message was lost (due a while ago) is published again.
- A body lives only as long as its task: it is removed at the task's expiry, and a delivery
  still waiting is failed; the attempts' log stays.
- A delivery past its retention goes, its attempts with it: batch after batch, until none
  is left or the sweep's time for it is spent.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

from sqlalchemy import CTE, Engine, case, delete, exists, func, select, text, true, update
from sqlalchemy.dialects.postgresql import insert

from broker.db.batches import picked_once
from broker.db.models import webhook_attempts_table as attempts_log
from broker.db.models import webhook_bodies_table as bodies
from broker.db.models import webhook_deliveries_table as deliveries
from broker.webhooks.deliveries import interval
from broker.webhooks.policy import DEAD, FAILED, PENDING, SENDING, TASK_EXPIRED

LOST = "lost: no outcome within its lease (its worker stopped?)"


def take_back_lost(engine: Engine, *, limit: int) -> list[tuple[uuid.UUID, int]]:
    """Attempts whose lease passed without an outcome: each is logged as a lost attempt, and
    its delivery is due again at once, or dead when that was its last attempt. Returns
    (delivery, attempt to publish) for those due again."""
    lost = (
        select(deliveries.c.id)
        .where(deliveries.c.status == SENDING, deliveries.c.lease_until < func.now())
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    last = deliveries.c.attempts >= deliveries.c.final_attempt
    query = (
        update(deliveries)
        .where(deliveries.c.id.in_(picked_once(lost)))
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
    publish).

    Shared fairly, so that one tenant's backlog never hides another's delivery: each tenant
    with such deliveries gets its ``limit / tenants`` longest overdue, at least one; past
    ``limit`` tenants, the longest overdue of each. One probe a tenant of
    ``ix_webhook_deliveries_pending_tenant_next_attempt_at`` and a range of it: at most
    ``limit`` plus a row a tenant are read."""
    before = func.now() - interval(grace_s)
    tenants = _pending_tenants()
    late = select(tenants).where(tenants.c.oldest < before).cte("late_tenants")
    share = select((limit + func.count() - 1) // func.greatest(func.count(), 1)).select_from(late)
    oldest = (
        select(deliveries.c.id, deliveries.c.attempts, deliveries.c.next_attempt_at)
        .where(
            deliveries.c.status == PENDING,
            deliveries.c.tenant == late.c.tenant,
            deliveries.c.next_attempt_at < before,
        )
        .order_by(deliveries.c.next_attempt_at)
        .limit(share.scalar_subquery())
        .lateral("oldest")
    )
    nth = func.row_number().over(partition_by=late.c.tenant, order_by=oldest.c.next_attempt_at)
    query = (
        select(oldest.c.id, oldest.c.attempts)
        .select_from(late.join(oldest, true()))
        .order_by(nth, oldest.c.next_attempt_at)
        .limit(limit)
    )
    with engine.connect() as conn:
        return [(r.id, r.attempts + 1) for r in conn.execute(query)]


def _pending_tenants() -> CTE:
    """Each tenant with pending deliveries, with its earliest ``next_attempt_at``: a loose
    scan of the pending deliveries' index, one probe a tenant (Postgres has no skip scan)."""
    first = (
        select(deliveries.c.tenant, deliveries.c.next_attempt_at.label("oldest"))
        .where(deliveries.c.status == PENDING)
        .order_by(deliveries.c.tenant, deliveries.c.next_attempt_at)
        .limit(1)
    )
    found = first.cte("pending_tenants", recursive=True)
    after = first.where(deliveries.c.tenant > found.c.tenant).lateral("after")
    return found.union_all(select(after).select_from(found.join(after, true())))


def purge_expired_bodies(engine: Engine, *, batch: int, budget_s: float) -> int:
    """Remove the bodies whose task has expired, in batches of ``batch`` (the attempts' log
    stays), until none is left or ``budget_s`` is spent on each of the two steps; how many
    deliveries lost theirs and how many bodies went. A budget of time: a cap of 20 batches a
    sweep (10,000 bodies every 30 s) fell behind one body a task at 400 tasks a second.
    A delivery still waiting for an attempt is failed: there is nothing left to send. One
    in flight is left to finish, and keeps its body; the next sweep takes it. A body goes
    once no delivery names it (an event's endpoints share one)."""
    expired = (
        select(deliveries.c.id)
        .where(
            deliveries.c.body_id.is_not(None),
            deliveries.c.body_expires_at <= func.now(),
            deliveries.c.status != SENDING,
        )
        .order_by(deliveries.c.body_expires_at)
        .limit(batch)
        .with_for_update(skip_locked=True)
    )
    waiting = deliveries.c.status == PENDING
    unnamed = (
        update(deliveries)
        .where(deliveries.c.id.in_(picked_once(expired)))
        .values(
            body_id=None,
            status=case((waiting, FAILED), else_=deliveries.c.status),
            finished_at=case((waiting, func.now()), else_=deliveries.c.finished_at),
            last_error=case((waiting, TASK_EXPIRED), else_=deliveries.c.last_error),
        )
    )
    gone = (
        select(bodies.c.id)
        .where(
            bodies.c.expires_at <= func.now(),
            ~exists().where(deliveries.c.body_id == bodies.c.id),
        )
        .order_by(bodies.c.expires_at)
        .limit(batch)
        .with_for_update(skip_locked=True)
    )
    removed = 0
    stop_at = time.monotonic() + budget_s
    for statement in (unnamed, delete(bodies).where(bodies.c.id.in_(picked_once(gone)))):
        while True:
            with engine.begin() as conn:
                count = int(conn.execute(statement).rowcount)
            removed += count
            if count < batch or time.monotonic() >= stop_at:
                break
    return removed


def purge_expired(engine: Engine, *, batch: int, budget_s: float) -> int:
    """Delete deliveries past their retention (their attempts go with them) in batches of
    ``batch``, each its own short transaction, until none is left or ``budget_s`` is spent.
    One batch a sweep removed 17 rows a second, while one task's progress reports may write
    thirty times that (a delivery per report and endpoint): the table grew without end."""
    statement = text(
        "WITH picked AS MATERIALIZED ("
        " SELECT id FROM webhook_deliveries WHERE expires_at <= now()"
        " ORDER BY expires_at LIMIT :batch FOR UPDATE SKIP LOCKED)"
        " DELETE FROM webhook_deliveries WHERE id IN (SELECT id FROM picked)"
    )
    removed = 0
    stop_at = time.monotonic() + budget_s
    while True:
        with engine.begin() as conn:
            count = int(conn.execute(statement, {"batch": batch}).rowcount)
        removed += count
        if count < batch or time.monotonic() >= stop_at:
            return removed
