"""What the API reads: tasks of one tenant (expired ones read as gone) and API keys."""

from __future__ import annotations

import base64
import binascii
import uuid
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import api_keys_table as keys
from broker.db.models import tasks_table as tasks
from broker.errors import BadRequest


async def get_task(engine: AsyncEngine, tenant: str, task_id: uuid.UUID) -> dict[str, Any] | None:
    query = select(tasks).where(
        tasks.c.id == task_id, tasks.c.tenant == tenant, tasks.c.expires_at > func.now()
    )
    async with engine.connect() as conn:
        row = (await conn.execute(query)).first()
    return dict(row._mapping) if row is not None else None


def encode_cursor(task_id: uuid.UUID) -> str:
    return base64.urlsafe_b64encode(task_id.bytes).decode().rstrip("=")


def decode_cursor(cursor: str) -> uuid.UUID:
    try:
        return uuid.UUID(bytes=base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError):
        raise BadRequest("cursor is not one this API issued", code="invalid_cursor") from None


async def list_tasks(
    engine: AsyncEngine,
    tenant: str,
    *,
    capability: str | None,
    status: str | None,
    limit: int,
    cursor: str | None,
) -> tuple[list[dict[str, Any]], str | None]:
    """Newest first. Ids are UUIDv7, so id order is creation order and the cursor is an id."""
    query = select(tasks).where(tasks.c.tenant == tenant, tasks.c.expires_at > func.now())
    if capability is not None:
        query = query.where(tasks.c.capability == capability)
    if status is not None:
        query = query.where(tasks.c.status == status)
    if cursor is not None:
        query = query.where(tasks.c.id < decode_cursor(cursor))
    query = query.order_by(tasks.c.id.desc()).limit(limit + 1)
    async with engine.connect() as conn:
        rows = [dict(r._mapping) for r in await conn.execute(query)]
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, encode_cursor(rows[-1]["id"]) if more else None


async def get_key(engine: AsyncEngine, key_id: str) -> dict[str, Any] | None:
    query = select(keys).where(keys.c.key_id == key_id, keys.c.revoked_at.is_(None))
    async with engine.connect() as conn:
        row = (await conn.execute(query)).first()
    return dict(row._mapping) if row is not None else None
