"""What the API reads of tasks: those of one tenant (expired ones read as gone), paged.

A read narrowed by ``patterns`` (a key's ``Principal.sees``) finds only tasks of capabilities
they allow: a task outside them reads as gone, like a foreign one.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import ColumnElement, false, func, or_, select, true
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import as_task_row
from broker.db.models import tasks_table as tasks
from broker.db.paging import Budget, json_bytes, newest_first
from broker.errors import NotFound
from broker.tasks.resource import SHOWN_COLUMNS, SHOWN_JSON, TaskRow, parse_task_id, render
from broker.tenancy.keys import Principal

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
) -> TaskRow | None:
    query = select(tasks).where(
        tasks.c.id == task_id,
        tasks.c.tenant == tenant,
        tasks.c.expires_at > func.now(),
        allowed_by(patterns, tasks.c.capability),
    )
    async with engine.connect() as conn:
        row = (await conn.execute(query)).first()
    return as_task_row(row) if row is not None else None


async def visible_task(engine: AsyncEngine, caller: Principal, task_id: str) -> TaskRow:
    """The task if this key may see it, else ``task_not_found``: unknown, expired, other
    tenants' ids and tasks of capabilities outside the key's patterns do not exist for it."""
    tid = parse_task_id(task_id)
    row = None if tid is None else await get_task(engine, caller.tenant, tid, patterns=caller.sees)
    if row is None:
        raise NotFound("no such task", code="task_not_found")
    return row


async def list_tasks(
    engine: AsyncEngine,
    tenant: str,
    *,
    capability: str | None,
    status: str | Sequence[str] | None,
    limit: int,
    cursor: str | None,
    patterns: Sequence[str],
    max_bytes: int,
    session_id: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """The task resources, newest first, a page at a time (``broker.db.paging``) of at most
    ``max_bytes`` of their JSON (and at least one task). ``status``: one, or any of several.

    Only the columns the resource shows are read: a payload of up to a megabyte a task is
    not, since a listing never shows it."""
    query = select(*(tasks.c[name] for name in SHOWN_COLUMNS)).where(
        tasks.c.tenant == tenant,
        tasks.c.expires_at > func.now(),
        allowed_by(patterns, tasks.c.capability),
    )
    if capability is not None:
        query = query.where(tasks.c.capability == capability)
    if isinstance(status, str):
        query = query.where(tasks.c.status == status)
    elif status is not None:
        query = query.where(tasks.c.status.in_(list(status)))
    if session_id is not None:
        query = query.where(tasks.c.session_id == session_id)
    budget = Budget(max_bytes, json_bytes(*SHOWN_JSON))
    async with engine.connect() as conn:
        rows, next_cursor = await newest_first(
            conn, query, tasks.c.id, limit=limit, cursor=cursor, budget=budget
        )
    # The shown columns are all ``render`` reads of a row.
    return [render(cast(TaskRow, row)) for row in rows], next_cursor
