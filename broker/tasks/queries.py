"""What the API reads of tasks: those of one tenant (expired ones read as gone), paged.

A read narrowed by ``patterns`` (a key's ``Principal.sees``) finds only tasks of capabilities
they allow: a task outside them reads as gone, like a foreign one. A read selects the columns
it shows and no more: a task's payload (up to a megabyte) only when asked for.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import ColumnElement, Select, Text, false, func, or_, select, true
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import FINAL_COLUMNS, as_task_row
from broker.db.models import tasks_table as tasks
from broker.db.paging import Budget, json_bytes, newest_first
from broker.errors import NotFound
from broker.tasks.resource import (
    FINAL,
    SHOWN_COLUMNS,
    SHOWN_JSON,
    TaskRow,
    parse_task_id,
    render,
)
from broker.tenancy.keys import Principal

EVERY_CAPABILITY = ("*",)
# The JSON columns whose bytes a row keeps, measured as they were written: a listing's budget
# adds them rather than measure the JSON (``paging.json_bytes``).
KEPT_SIZES = {"metadata": "metadata_size", "result": "result_size"}
# What the readers of one task show of it: the resource's columns (``render``) and its
# callback (A2A shows it as the task's push config). Not its payload, unless asked for.
READ_COLUMNS = (*SHOWN_COLUMNS, "callback")


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


# The columns of JSON a read may take as their text (``get_task``'s ``as_text``).
TEXT_JSON = (*SHOWN_JSON, "payload")


def _one_task(
    columns: Sequence[str],
    tenant: str,
    task_id: uuid.UUID,
    patterns: Sequence[str],
    *,
    as_text: bool = False,
) -> Select[Any]:
    """The ``columns`` of one task of ``tenant`` the ``patterns`` allow, unless expired;
    ``as_text``: those of ``TEXT_JSON`` as Postgres writes their JSON, not decoded."""

    def column(name: str) -> Any:
        if as_text and name in TEXT_JSON:
            return tasks.c[name].cast(Text).label(name)
        return tasks.c[name]

    return select(*(column(name) for name in columns)).where(
        tasks.c.id == task_id,
        tasks.c.tenant == tenant,
        tasks.c.expires_at > func.now(),
        allowed_by(patterns, tasks.c.capability),
    )


def task_query(
    tenant: str,
    task_id: uuid.UUID,
    *,
    patterns: Sequence[str] = EVERY_CAPABILITY,
    payload: bool = False,
    as_text: bool = False,
) -> Select[Any]:
    """What ``get_task`` reads: ``READ_COLUMNS``, and the payload only when ``payload`` asks
    for it (``GET /tasks/{id}?include=payload``). A payload may be a megabyte, and nothing
    else shows it."""
    columns = (*READ_COLUMNS, "payload") if payload else READ_COLUMNS
    return _one_task(columns, tenant, task_id, patterns, as_text=as_text)


def status_query(tenant: str, task_id: uuid.UUID) -> Select[Any]:
    """What ``task_status`` reads: the status alone."""
    return _one_task(("status",), tenant, task_id, EVERY_CAPABILITY)


def final_query(tenant: str, task_id: uuid.UUID) -> Select[Any]:
    """What ``final_task`` reads: every column but the payload, of a final task only."""
    columns = tuple(column.key for column in FINAL_COLUMNS)
    query = _one_task(columns, tenant, task_id, EVERY_CAPABILITY)
    return query.where(tasks.c.status.in_(sorted(FINAL)))


async def get_task(
    engine: AsyncEngine,
    tenant: str,
    task_id: uuid.UUID,
    *,
    patterns: Sequence[str] = EVERY_CAPABILITY,
    payload: bool = False,
    as_text: bool = False,
) -> TaskRow | None:
    """The task's ``READ_COLUMNS`` (``render`` reads no others of a row), and its ``payload``
    when asked: no other column is read, and no other key is in the row. ``as_text``: its
    JSON columns (``TEXT_JSON``) as text, for an answer that passes them on as they are
    (``api.rawjson``): decoding a result of a million small values took the API's event
    loop for most of a second, at a request any tenant may send many times a second."""
    query = task_query(tenant, task_id, patterns=patterns, payload=payload, as_text=as_text)
    async with engine.connect() as conn:
        row = (await conn.execute(query)).first()
    return as_task_row(row) if row is not None else None


async def task_status(engine: AsyncEngine, tenant: str, task_id: uuid.UUID) -> str | None:
    """The task's status alone, None when it is gone: what a wait polls while the task runs
    (``api.replies``), a query that costs the same whatever the task holds."""
    async with engine.connect() as conn:
        status: str | None = (await conn.execute(status_query(tenant, task_id))).scalar()
    return status


async def final_task(engine: AsyncEngine, tenant: str, task_id: uuid.UUID) -> TaskRow | None:
    """The task once final, as a final write returns it (every column but the payload:
    enough for its final event), else None."""
    async with engine.connect() as conn:
        row = (await conn.execute(final_query(tenant, task_id))).first()
    return as_task_row(row) if row is not None else None


async def visible_task(
    engine: AsyncEngine,
    caller: Principal,
    task_id: str,
    *,
    payload: bool = False,
    as_text: bool = False,
) -> TaskRow:
    """The task if this key may see it (as ``get_task`` reads it), else ``task_not_found``:
    unknown, expired, other tenants' ids and tasks of capabilities outside the key's patterns
    do not exist for it."""
    tid = parse_task_id(task_id)
    row = None
    if tid is not None:
        row = await get_task(
            engine, caller.tenant, tid, patterns=caller.sees, payload=payload, as_text=as_text
        )
    if row is None:
        raise NotFound("no such task", code="task_not_found")
    return row


# When a task's status last moved: its end, else its start, else its acceptance (as A2A's
# status timestamp has it, ``broker.facades.a2a.status_of``).
MOVED_AT = func.coalesce(tasks.c.finished_at, tasks.c.started_at, tasks.c.created_at)


def _listed(
    tenant: str,
    *,
    capability: str | None,
    status: str | Sequence[str] | None,
    patterns: Sequence[str],
    session_id: str | None,
    moved_after: datetime | None,
) -> list[Any]:
    """The conditions of a listing: ``list_tasks`` pages by them, ``count_tasks`` counts."""
    where = [
        tasks.c.tenant == tenant,
        tasks.c.expires_at > func.now(),
        allowed_by(patterns, tasks.c.capability),
    ]
    if capability is not None:
        where.append(tasks.c.capability == capability)
    if isinstance(status, str):
        where.append(tasks.c.status == status)
    elif status is not None:
        where.append(tasks.c.status.in_(list(status)))
    if session_id is not None:
        where.append(tasks.c.session_id == session_id)
    if moved_after is not None:
        where.append(moved_after < MOVED_AT)
    return where


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
    moved_after: datetime | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """The task resources, newest first, a page at a time (``broker.db.paging``) of at most
    ``max_bytes`` of their JSON (and at least one task). ``status``: one, or any of several;
    ``moved_after``: only those whose status moved since (``MOVED_AT``).

    Only the columns the resource shows are read, and the sizes its budget adds: a payload
    of up to a megabyte a task is not, since a listing never shows it."""
    columns = (*SHOWN_COLUMNS, *KEPT_SIZES.values())
    where = _listed(
        tenant,
        capability=capability,
        status=status,
        patterns=patterns,
        session_id=session_id,
        moved_after=moved_after,
    )
    query = select(*(tasks.c[name] for name in columns)).where(*where)
    budget = Budget(max_bytes, json_bytes(*SHOWN_JSON, kept=KEPT_SIZES))
    async with engine.connect() as conn:
        rows, next_cursor = await newest_first(
            conn, query, tasks.c.id, limit=limit, cursor=cursor, budget=budget
        )
    # The shown columns are all ``render`` reads of a row.
    return [render(cast(TaskRow, row)) for row in rows], next_cursor


async def count_tasks(
    engine: AsyncEngine,
    tenant: str,
    *,
    at_most: int,
    status: str | Sequence[str] | None = None,
    patterns: Sequence[str],
    session_id: str | None = None,
    moved_after: datetime | None = None,
) -> int:
    """How many tasks ``list_tasks`` would list over all its pages, counted up to
    ``at_most``: a tenant of millions of tasks costs one bounded read, not a count of all."""
    where = _listed(
        tenant,
        capability=None,
        status=status,
        patterns=patterns,
        session_id=session_id,
        moved_after=moved_after,
    )
    some = select(tasks.c.id).where(*where).limit(at_most).subquery()
    async with engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(some))).scalar_one())
