"""A tenant's subscriptions and its callback secret, as the API manages them.

A secret is returned once, by the call that makes it; reads never show it again. Rotating
keeps the previous secret signing for a grace period, so receivers can switch without losing
a message.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import callback_secrets_table as callback_secrets
from broker.db.models import tasks_table as tasks
from broker.db.models import webhooks_table as webhooks
from broker.errors import BadRequest
from broker.registry.capabilities import NAME_MAX, PATTERN_PATTERN, is_valid_pattern
from broker.tasks.resource import new_task_id
from broker.tenancy.heavy import OneAtATime
from broker.timestamps import iso
from broker.webhooks.events import EVENTS_SCHEMA, FINAL_EVENTS, check_events
from broker.webhooks.signing import new_secret
from broker.webhooks.ssrf import HostLookups


class WebhookSpec(BaseModel):
    """The body of ``POST /webhooks``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    url: str = Field(max_length=2048, examples=["https://example.com/hooks/reach"])
    events: list[str] = Field(
        default_factory=lambda: list(FINAL_EVENTS), max_length=16, json_schema_extra=EVENTS_SCHEMA
    )
    capabilities: list[str] = Field(
        default_factory=list,
        max_length=32,
        description="Capability patterns; empty: all.",
        json_schema_extra={
            "items": {"type": "string", "maxLength": NAME_MAX, "pattern": PATTERN_PATTERN}
        },
    )
    description: str | None = Field(None, max_length=256)

    @field_validator("events")
    @classmethod
    def _known_events(cls, value: list[str]) -> list[str]:
        return check_events(value)

    @field_validator("capabilities")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        bad = [p for p in value if not is_valid_pattern(p)]
        if bad:
            raise ValueError(f"not capability patterns: {bad}")
        return list(dict.fromkeys(value))


def render(row: dict[str, Any]) -> dict[str, Any]:
    """The webhook resource; never the secret."""
    return {
        "webhook_id": str(row["id"]),
        "url": row["url"],
        "events": row["events"],
        "capabilities": row["capabilities"],
        "description": row["description"],
        "status": "disabled" if row["disabled_at"] is not None else "enabled",
        "disabled_at": iso(row["disabled_at"]),
        "disabled_reason": row["disabled_reason"],
        "previous_secret_expires_at": iso(row["previous_secret_expires_at"]),
        "created_at": iso(row["created_at"]),
    }


async def create(
    engine: AsyncEngine, tenant: str, spec: WebhookSpec, *, max_per_tenant: int, turns: OneAtATime
) -> tuple[dict[str, Any], str]:
    """The new subscription and its secret (shown this once). A tenant's creations take the
    tenant's lock in Postgres, so the limit holds across processes; in this process they
    first wait their turn in ``turns``, without a connection, as a session's creations do
    (``broker.sessions.create``): each waiting with a pooled connection of its own, one
    tenant's burst held the whole pool, and every other tenant's requests waited for it."""
    secret = new_secret()
    values = {
        "id": new_task_id(),
        "tenant": tenant,
        "url": spec.url,
        "events": spec.events,
        "capabilities": spec.capabilities,
        "description": spec.description,
        "secret": secret,
    }
    async with turns.turn(tenant, "webhook create"), engine.begin() as conn:
        # Serialises a tenant's concurrent creations, so the limit holds.
        await conn.execute(select(func.pg_advisory_xact_lock(func.hashtext(f"wh:{tenant}"))))
        count = await conn.scalar(
            select(func.count()).select_from(webhooks).where(webhooks.c.tenant == tenant)
        )
        if (count or 0) >= max_per_tenant:
            raise BadRequest(
                f"a tenant may have {max_per_tenant} webhooks", code="webhook_limit_reached"
            )
        row = (await conn.execute(webhooks.insert().values(**values).returning(*webhooks.c))).one()
    return dict(row._mapping), secret


async def list_for(engine: AsyncEngine, tenant: str) -> list[dict[str, Any]]:
    query = select(webhooks).where(webhooks.c.tenant == tenant).order_by(webhooks.c.id)
    async with engine.connect() as conn:
        return [dict(r._mapping) for r in await conn.execute(query)]


async def get(engine: AsyncEngine, tenant: str, webhook_id: uuid.UUID) -> dict[str, Any] | None:
    query = select(webhooks).where(webhooks.c.id == webhook_id, webhooks.c.tenant == tenant)
    async with engine.connect() as conn:
        row = (await conn.execute(query)).first()
    return dict(row._mapping) if row is not None else None


async def remove(engine: AsyncEngine, tenant: str, webhook_id: uuid.UUID) -> bool:
    """Delete it and its delivery log (pending attempts then find nothing to send)."""
    query = delete(webhooks).where(webhooks.c.id == webhook_id, webhooks.c.tenant == tenant)
    async with engine.begin() as conn:
        return (await conn.execute(query)).rowcount == 1


async def rotate(
    engine: AsyncEngine, tenant: str, webhook_id: uuid.UUID, *, grace_s: int
) -> tuple[dict[str, Any], str] | None:
    """A new secret; the current one keeps signing for ``grace_s``. None when not found."""
    secret = new_secret()
    query = (
        update(webhooks)
        .where(webhooks.c.id == webhook_id, webhooks.c.tenant == tenant)
        .values(_rotated(webhooks.c.secret, secret, grace_s))
        .returning(*webhooks.c)
    )
    async with engine.begin() as conn:
        row = (await conn.execute(query)).first()
    return (dict(row._mapping), secret) if row is not None else None


async def rotate_callback_secret(
    engine: AsyncEngine, tenant: str, *, grace_s: int
) -> tuple[str, datetime | None]:
    """Create the tenant's callback secret, or replace it (the old one signs for
    ``grace_s``). Returns the new secret and when the previous one stops signing."""
    secret = new_secret()
    query = (
        insert(callback_secrets)
        .values(tenant=tenant, secret=secret)
        .on_conflict_do_update(
            index_elements=["tenant"],
            set_=_rotated(callback_secrets.c.secret, secret, grace_s),
        )
        .returning(callback_secrets.c.previous_secret_expires_at)
    )
    async with engine.begin() as conn:
        expires_at = (await conn.execute(query)).scalar_one()
    return secret, expires_at


async def has_callback_secret(engine: AsyncEngine, tenant: str) -> bool:
    query = select(callback_secrets.c.tenant).where(callback_secrets.c.tenant == tenant)
    async with engine.connect() as conn:
        return (await conn.execute(query)).first() is not None


def _rotated(current: Any, secret: str, grace_s: int) -> dict[str, Any]:
    return {
        "previous_secret": current,
        "previous_secret_expires_at": func.now() + func.make_interval(0, 0, 0, 0, 0, 0, grace_s),
        "secret": secret,
    }


async def vet_callback(
    engine: AsyncEngine, lookups: HostLookups, tenant: str, url: str, *, allow: list[str]
) -> None:
    """A task's callback is accepted only to a URL the guard allows, and only once the tenant
    has a callback secret to verify it with (``POST /callbacks/secret``)."""
    await lookups.vet(url, allow=allow, tenant=tenant)
    if not await has_callback_secret(engine, tenant):
        raise BadRequest(
            "create the secret that signs callbacks first: POST /callbacks/secret",
            code="callback_secret_missing",
        )


async def set_callback(
    engine: AsyncEngine, tenant: str, task_id: uuid.UUID, callback: dict[str, Any] | None
) -> None:
    """Set (or, with None, clear) a task's callback after it was accepted: an A2A push config
    (``broker.facades.a2a``), vetted like any other by ``vet_callback`` first. Events already
    fanned out keep the endpoints they had."""
    async with engine.begin() as conn:
        await conn.execute(
            update(tasks)
            .where(tasks.c.id == task_id, tasks.c.tenant == tenant)
            .values(callback=callback)
        )
