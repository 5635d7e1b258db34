"""What the API shows of deliveries, and redelivery of a failed or dead one.

Every read is scoped to the tenant: another tenant's delivery is "not found", the same as
one that never existed.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import webhook_attempts_table as attempts_log
from broker.db.models import webhook_deliveries_table as deliveries
from broker.db.models import webhooks_table as webhooks
from broker.db.paging import newest_first
from broker.errors import Conflict, NotFound
from broker.timestamps import iso
from broker.webhooks.deliveries import message_id
from broker.webhooks.policy import DEAD, FAILED, PENDING

# A delivery may be sent again by hand this many times past its schedule's attempts: each
# redelivery logs an attempt, and a tenant looping over its failed deliveries piled them up
# without end (every page then listed them all).
REDELIVERIES_MAX = 10
# The attempts a page shows of each delivery, the latest ones (``attempt_count``: all of them).
ATTEMPTS_SHOWN = 20


def render(row: dict[str, Any], attempts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "delivery_id": str(row["id"]),
        "message_id": message_id(row["id"]),
        "webhook_id": str(row["webhook_id"]) if row["webhook_id"] else None,
        "kind": "subscription" if row["webhook_id"] else "callback",
        "task_id": str(row["task_id"]),
        "event_type": row["event_type"],
        "url": row["url"],
        "status": row["status"],
        "attempt_count": row["attempts"],
        "next_attempt_at": iso(row["next_attempt_at"]) if row["status"] == PENDING else None,
        "last_status_code": row["last_status_code"],
        "last_error": row["last_error"],
        "created_at": iso(row["created_at"]),
        "finished_at": iso(row["finished_at"]),
        "attempts": [
            {
                "attempt": a["attempt"],
                "at": iso(a["at"]),
                "status_code": a["status_code"],
                "error": a["error"],
                "latency_ms": a["latency_ms"],
                "address": a["address"],
                "response_excerpt": a["response_excerpt"],
            }
            for a in attempts
        ],
    }


async def page(
    engine: AsyncEngine,
    tenant: str,
    scope: ColumnElement[bool],
    *,
    limit: int,
    cursor: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """Deliveries matching ``scope``, newest first, each with its attempts."""
    # Not the body: it carries the task's result, of any size, and the log never shows it.
    shown = [c for c in deliveries.c if c.name != "body_id"]
    query = select(*shown).where(deliveries.c.tenant == tenant, scope)
    async with engine.connect() as conn:
        rows, next_cursor = await newest_first(
            conn, query, deliveries.c.id, limit=limit, cursor=cursor
        )
        latest = func.row_number().over(
            partition_by=attempts_log.c.delivery_id, order_by=attempts_log.c.attempt.desc()
        )
        numbered = (
            select(attempts_log, latest.label("latest"))
            .where(attempts_log.c.delivery_id.in_([r["id"] for r in rows]))
            .subquery()
        )
        logged = await conn.execute(
            select(numbered).where(numbered.c.latest <= ATTEMPTS_SHOWN).order_by(numbered.c.attempt)
        )
        by_delivery: dict[uuid.UUID, list[dict[str, Any]]] = {}
        for a in logged:
            by_delivery.setdefault(a.delivery_id, []).append(dict(a._mapping))
    rendered = [render(r, by_delivery.get(r["id"], [])) for r in rows]
    return rendered, next_cursor


def of_webhook(webhook_id: uuid.UUID) -> ColumnElement[bool]:
    return deliveries.c.webhook_id == webhook_id


def of_task(task_id: uuid.UUID, webhook_ids: list[uuid.UUID] | None = None) -> ColumnElement[bool]:
    """The task's deliveries; given ``webhook_ids``, only its own callback's and those to
    these subscriptions."""
    of_it = deliveries.c.task_id == task_id
    if webhook_ids is None:
        return of_it
    to = or_(deliveries.c.webhook_id.is_(None), deliveries.c.webhook_id.in_(webhook_ids))
    return and_(of_it, to)


def only(delivery_id: uuid.UUID) -> ColumnElement[bool]:
    return deliveries.c.id == delivery_id


async def redeliver(
    engine: AsyncEngine,
    tenant: str,
    delivery_id: uuid.UUID,
    scope: ColumnElement[bool],
    *,
    scheduled: int,
) -> int:
    """Make a failed or dead delivery due now for one more attempt (same webhook-id and
    body); returns that attempt's number for the message that sends it. ``scheduled``: the
    attempts of the schedule; past them a delivery is sent again ``REDELIVERIES_MAX`` times
    at most."""
    attempts_max = scheduled + REDELIVERIES_MAX
    async with engine.begin() as conn:
        found = (
            await conn.execute(
                select(
                    deliveries.c.status,
                    deliveries.c.attempts,
                    webhooks.c.disabled_at,
                    (deliveries.c.body_expires_at <= func.now()).label("body_expired"),
                )
                .select_from(deliveries.outerjoin(webhooks))
                .where(deliveries.c.id == delivery_id, deliveries.c.tenant == tenant, scope)
            )
        ).first()
        if found is None:
            raise NotFound("no such delivery", code="delivery_not_found")
        if found.disabled_at is not None:
            raise Conflict("the webhook is disabled", code="webhook_disabled")
        if found.body_expired:
            raise Conflict("the task has expired, and the message with it", code="delivery_expired")
        if found.attempts >= attempts_max:
            raise Conflict(
                f"the delivery was attempted {found.attempts} times, the most it may be",
                code="delivery_not_redeliverable",
            )
        attempt = (
            await conn.execute(
                update(deliveries)
                .where(
                    deliveries.c.id == delivery_id,
                    deliveries.c.status.in_((FAILED, DEAD)),
                    deliveries.c.body_id.is_not(None),
                    deliveries.c.attempts < attempts_max,
                )
                .values(
                    status=PENDING,
                    final_attempt=deliveries.c.attempts + 1,
                    next_attempt_at=func.now(),
                    finished_at=None,
                )
                .returning(deliveries.c.attempts + 1)
            )
        ).scalar()
    if attempt is None:
        raise Conflict(
            f"only a failed or dead delivery can be sent again; this one is {found.status}",
            code="delivery_not_redeliverable",
        )
    return int(attempt)
