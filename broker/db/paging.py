"""Keyset paging, newest first. Ids are UUIDv7, so id order is creation order, and the cursor
is the last id of a page, encoded: a page never skips or repeats a row however many are
written meanwhile."""

from __future__ import annotations

import base64
import binascii
import uuid
from typing import Any

from sqlalchemy import Column, Select
from sqlalchemy.ext.asyncio import AsyncConnection

from broker.errors import BadRequest


def encode_cursor(last_id: uuid.UUID) -> str:
    return base64.urlsafe_b64encode(last_id.bytes).decode().rstrip("=")


def decode_cursor(cursor: str) -> uuid.UUID:
    try:
        return uuid.UUID(bytes=base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError):
        raise BadRequest("cursor is not one this API issued", code="invalid_cursor") from None


async def newest_first(
    conn: AsyncConnection,
    query: Select[Any],
    id_column: Column[uuid.UUID],
    *,
    limit: int,
    cursor: str | None,
) -> tuple[list[dict[str, Any]], str | None]:
    """One page of ``query``'s rows, and the cursor of the next page (None on the last)."""
    if cursor is not None:
        query = query.where(id_column < decode_cursor(cursor))
    query = query.order_by(id_column.desc()).limit(limit + 1)
    rows = [dict(r._mapping) for r in await conn.execute(query)]
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, encode_cursor(rows[-1]["id"]) if more else None
