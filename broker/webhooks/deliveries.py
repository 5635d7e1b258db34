"""A delivery's attempts, as the webhooks worker makes them: claim, then record the outcome.

Each Celery message names the attempt it is for; the claim only succeeds when the row is
waiting for exactly that attempt (never past the schedule, never with an expired body), so a
duplicated or late message never sends twice. Attempts whose worker died are the sweep's
(``upkeep``).

A tenant has at most a set number of attempts in flight. Its other due deliveries wait in
Postgres, not on the queue every tenant's deliveries share:

- A claim past the bound answers ``Busy``; its message is dropped, and the delivery is parked
  (pending and due), holding no message and no worker.
- Whoever frees or may free a slot (an attempt that ended, a fanout, the sweep) then
  publishes the tenant's oldest due deliveries, as many as it has slots free (``release``),
  after its commit. A released delivery is marked (``lease_until`` on a pending row) until
  its message is claimed or parked again, so that two releases never pick the same one and
  a release counts those already on their way. It takes the tenant's lock, as the claim
  does, so a delivery parked meanwhile is seen by the next release.
- A release lost between commit and publish: its mark lapses after ``RELEASE_HOLD_S``, and
  the sweep releases what a tenant with free slots left waiting.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import IntegrityError

from broker.db.models import callback_secrets_table as callback_secrets
from broker.db.models import tasks_table as tasks
from broker.db.models import webhook_attempts_table as attempts_log
from broker.db.models import webhook_bodies_table as bodies
from broker.db.models import webhook_deliveries_table as deliveries
from broker.db.models import webhooks_table as webhooks
from broker.facades import a2a
from broker.webhooks.policy import PENDING, SENDING, Outcome, Verdict, status_after

EXCERPT_MAX = 512
# A message may arrive a little before its time by the database's clock.
EARLY_TOLERANCE_S = 1.0
# A released delivery counts as on its way this long; past it, its message is taken as lost
# (the delivery may be released again: a second message finds its attempt taken).
RELEASE_HOLD_S = 30.0
# What ``record`` answers when the delivery went while its attempt was under way (its
# subscription was deleted, and its deliveries with it): not a status a row holds.
DELETED = "deleted"
_ATTEMPT_OF_A_DELIVERY = "fk_webhook_attempts_delivery_id_webhook_deliveries"


def message_id(delivery_id: uuid.UUID) -> str:
    """The ``webhook-id``: fixed per delivery, so the same on every retry."""
    return f"msg_{delivery_id.hex}"


@dataclass(frozen=True)
class Claimed:
    delivery_id: uuid.UUID
    tenant: str
    webhook_id: uuid.UUID | None
    url: str
    body: bytes
    trace_id: str
    task_id: uuid.UUID
    attempt: int
    final_attempt: int
    secrets: tuple[str, ...]  # every secret that signs now: the new one first
    disabled: bool  # the subscription was disabled (410) after this was written
    # Sent besides the signature: an A2A push config's token and credentials.
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Busy:
    """The tenant already has its most attempts in flight: the delivery waits, parked, for
    one of them to end and release it."""

    inflight: int


def interval(value: float) -> Any:
    """An SQL interval of ``value`` seconds."""
    return func.make_interval(0, 0, 0, 0, 0, 0, value)


def _waiting() -> tuple[Any, ...]:
    """A delivery waiting for an attempt that is due now (or about to be)."""
    return (
        deliveries.c.status == PENDING,
        deliveries.c.attempts < deliveries.c.final_attempt,
        deliveries.c.next_attempt_at <= func.now() + interval(EARLY_TOLERANCE_S),
        deliveries.c.body_id.is_not(None),
        deliveries.c.body_expires_at > func.now(),
    )


def _body_of_delivery() -> Any:
    """The text of the delivery's body (``webhook_bodies``), as a column of its row."""
    return select(bodies.c.body).where(bodies.c.id == deliveries.c.body_id).scalar_subquery()


def _lock_tenant(conn: Connection, tenant: str) -> None:
    """One claim or release of a tenant at a time: its count and its writes are one step."""
    conn.execute(select(func.pg_advisory_xact_lock(func.hashtext(f"wh-send:{tenant}"))))


def _count(tenant: str, status: str) -> Any:
    """The tenant's deliveries in ``status`` whose lease (or release mark) has not lapsed:
    read from ``ix_webhook_deliveries_tenant_sending`` or, for the marked pending ones,
    ``ix_webhook_deliveries_released_tenant_lease_until`` (migration 0019), never the
    tenant's backlog: a release follows every attempt."""
    return (
        select(func.count())
        .select_from(deliveries)
        .where(
            deliveries.c.tenant == tenant,
            deliveries.c.status == status,
            deliveries.c.lease_until > func.now(),
        )
        .scalar_subquery()
    )


def claim(
    engine: Engine, delivery_id: uuid.UUID, attempt: int, *, lease_s: float, max_inflight: int
) -> Claimed | Busy | None:
    """Take attempt ``attempt`` of the delivery; None when it is not this attempt's turn (or
    past the schedule, or its body has expired), Busy when its tenant is at ``max_inflight``
    (the delivery is then parked: no longer marked released)."""
    due = (deliveries.c.id == delivery_id, deliveries.c.attempts == attempt - 1, *_waiting())
    with engine.begin() as conn:
        tenant = conn.execute(select(deliveries.c.tenant).where(*due)).scalar()
        if tenant is None:
            return None
        _lock_tenant(conn, tenant)
        inflight = conn.execute(select(_count(tenant, SENDING))).scalar_one()
        if inflight >= max_inflight:
            conn.execute(
                update(deliveries)
                .where(*due, deliveries.c.lease_until.is_not(None))
                .values(lease_until=None)
            )
            return Busy(inflight)
        query = (
            update(deliveries)
            .where(*due)
            .values(status=SENDING, attempts=attempt, lease_until=func.now() + interval(lease_s))
            .returning(*deliveries.c, _body_of_delivery().label("body"))
        )
        row = conn.execute(query).first()
        if row is None:
            return None
        valid, disabled = _signing(conn, dict(row._mapping))
        headers = _callback_headers(conn, row.task_id, row.url) if row.webhook_id is None else {}
    return Claimed(
        delivery_id=row.id,
        tenant=row.tenant,
        webhook_id=row.webhook_id,
        url=row.url,
        body=row.body.encode(),
        trace_id=row.trace_id,
        task_id=row.task_id,
        attempt=attempt,
        final_attempt=row.final_attempt,
        secrets=valid,
        disabled=disabled,
        headers=headers,
    )


def slots_taken(tenant: str) -> Any:
    """The tenant's attempts in flight and releases on their way, as one statement."""
    return select(_count(tenant, SENDING) + _count(tenant, PENDING))


def release(engine: Engine, tenant: str, *, max_inflight: int) -> list[tuple[uuid.UUID, int]]:
    """Mark the tenant's oldest due deliveries released, as many as it has slots free (its
    bound less its attempts in flight and its releases on their way); returns (delivery,
    attempt) for each, to publish after this commits."""
    with engine.begin() as conn:
        _lock_tenant(conn, tenant)
        free = max_inflight - conn.execute(slots_taken(tenant)).scalar_one()
        if free <= 0:
            return []
        oldest = (
            select(deliveries.c.id)
            .where(
                deliveries.c.tenant == tenant,
                *_waiting(),
                or_(deliveries.c.lease_until.is_(None), deliveries.c.lease_until <= func.now()),
            )
            .order_by(deliveries.c.next_attempt_at, deliveries.c.id)
            .limit(free)
            .scalar_subquery()
        )
        query = (
            update(deliveries)
            .where(deliveries.c.id.in_(oldest))
            .values(lease_until=func.now() + interval(RELEASE_HOLD_S))
            .returning(deliveries.c.id, deliveries.c.attempts, deliveries.c.next_attempt_at)
        )
        rows = sorted(conn.execute(query), key=lambda r: (r.next_attempt_at, r.id))
    return [(r.id, r.attempts + 1) for r in rows]


def tenants_of(engine: Engine, delivery_ids: list[uuid.UUID]) -> list[str]:
    """The tenants these deliveries belong to, each once."""
    if not delivery_ids:
        return []
    query = select(deliveries.c.tenant).where(deliveries.c.id.in_(delivery_ids)).distinct()
    with engine.connect() as conn:
        return [str(t) for t in conn.execute(query).scalars()]


def _callback_headers(conn: Connection, task_id: uuid.UUID, url: str) -> dict[str, str]:
    """The push config's token and credentials, when the task's callback still names the
    delivery's URL: a config replaced meanwhile (a new URL, a new token) has its credentials
    sent to its own URL only, never to the one its predecessor named."""
    callback = conn.execute(select(tasks.c.callback).where(tasks.c.id == task_id)).scalar()
    if not callback or callback.get("url") != url:
        return {}
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
    """Log the attempt and move the delivery on; returns its new status, or ``DELETED`` when
    the delivery no longer exists. A 410 disables the subscription in the same transaction."""
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
    try:
        with engine.begin() as conn:
            _write_outcome(conn, claimed, outcome, values, gone=verdict == "gone")
    except IntegrityError as exc:
        if not _violates(exc, _ATTEMPT_OF_A_DELIVERY):
            raise
        return DELETED  # nothing is left to log the attempt against
    return status


def _write_outcome(
    conn: Connection, claimed: Claimed, outcome: Outcome, values: dict[str, Any], *, gone: bool
) -> None:
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
    if gone and claimed.webhook_id is not None:
        conn.execute(
            update(webhooks)
            .where(webhooks.c.id == claimed.webhook_id, webhooks.c.disabled_at.is_(None))
            .values(disabled_at=func.now(), disabled_reason="the endpoint answered 410 Gone")
        )


def _violates(exc: IntegrityError, constraint: str) -> bool:
    diag = getattr(exc.orig, "diag", None)
    return diag is not None and diag.constraint_name == constraint


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
