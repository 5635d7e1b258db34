"""What the API reads of tasks: those of one tenant (expired ones read as gone), paged.

A read narrowed by ``patterns`` (a key's ``Principal.sees``) finds only tasks of capabilities
they allow: a task outside them reads as gone, like a foreign one.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, false, func, or_, select, true
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import tasks_table as tasks
from broker.errors import BadRequest

EVERY_CAPABILITY = ("*",)


def allowed_by(patterns: Sequence[str], column: ColumnElement[str]) -> ColumnElement[bool]:
    """SQL for ``any_pattern_allows(patterns, column)``."""
    if "*" in patterns:
        return true()
    clauses: list[ColumnElement[bool]] = []
    for pattern in patterns:
        if pattern.endswith(".*"):
            stem = pattern[:-2]
            # autoescape: "_" is a LIKE wildcard and a legal character of a name.
            clauses += [column == stem, column.startswith(stem + ".", autoescape=True)]
        else:
            clauses.append(column == pattern)
    return or_(false(), *clauses)


async def get_task(
    engine: AsyncEngine,
    tenant: str,
    task_id: uuid.UUID,
    *,
    patterns: Sequence[str] = EVERY_CAPABILITY,
) -> dict[str, Any] | None:
    query = select(tasks).where(
        tasks.c.id == task_id,
        tasks.c.tenant == tenant,
        tasks.c.expires_at > func.now(),
        allowed_by(patterns, tasks.c.capability),
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
    patterns: Sequence[str],
) -> tuple[list[dict[str, Any]], str | None]:
    """Newest first. Ids are UUIDv7, so id order is creation order and the cursor is an id."""
    query = select(tasks).where(
        tasks.c.tenant == tenant,
        tasks.c.expires_at > func.now(),
        allowed_by(patterns, tasks.c.capability),
    )
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
