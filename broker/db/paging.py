"""Keyset paging, newest first. Ids are UUIDv7, so id order is creation order, and the cursor
is the last id of a page, encoded: a page never skips or repeats a row however many are
written meanwhile."""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from typing import Any

from sqlalchemy import Column, Select
from sqlalchemy.ext.asyncio import AsyncConnection

from broker.errors import BadRequest

# 16 bytes in unpadded URL-safe base64; the OpenAPI document states the same pattern.
CURSOR_PATTERN = "^[A-Za-z0-9_-]{22}$"
CURSOR = re.compile(CURSOR_PATTERN)


def encode_cursor(last_id: uuid.UUID) -> str:
    return base64.urlsafe_b64encode(last_id.bytes).decode().rstrip("=")


def decode_cursor(cursor: str) -> uuid.UUID:
    # Exactly what encode_cursor writes: the decoder alone would skip stray characters.
    if CURSOR.fullmatch(cursor) is None:
        raise BadRequest("cursor is not one this API issued", code="invalid_cursor")
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
