"""Keyset paging, newest first: a page never skips or repeats a row however many are written
meanwhile.

Two keys. Ids that are UUIDv7 are in creation order already, and the cursor is the last id
of a page, encoded (``newest_first``). Ids that are not (a session's is random) page on
``(created_at, id)``, and the cursor is both (``newest_created_first``). Every string of a
cursor's documented pattern decodes, so a client's well-formed cursor is never refused.

A page may also have a byte budget (``Budget``): it ends before the row that would pass it,
with a cursor to that row, and always holds one row, so paging goes on."""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    Column,
    ColumnElement,
    Select,
    Subquery,
    Text,
    cast,
    func,
    or_,
    select,
    tuple_,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from broker.errors import BadRequest

# 16 bytes in unpadded URL-safe base64; the OpenAPI document states the same pattern.
CURSOR_PATTERN = "^[A-Za-z0-9_-]{22}$"
CURSOR = re.compile(CURSOR_PATTERN)
# 8 bytes of microseconds since the epoch in URL-safe base64 (11 characters), then the id
# itself: ids that page this way are drawn from the same alphabet (``broker.sessions``).
CREATED_CURSOR_PATTERN = "^[A-Za-z0-9_-]{12,139}$"
CREATED_CURSOR = re.compile(CREATED_CURSOR_PATTERN)
_AT_CHARS = 11
_ID = re.compile("^[A-Za-z0-9_-]{1,128}$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_FIRST_US = (datetime.min.replace(tzinfo=UTC) - _EPOCH) // timedelta(microseconds=1)
_LAST_US = (datetime.max.replace(tzinfo=UTC) - _EPOCH) // timedelta(microseconds=1)
# The columns a budgeted page adds to its rows, dropped before they are returned.
_AT, _BYTES_SO_FAR, _CANDIDATES = "page_row", "page_bytes", "page_candidates"


@dataclass(frozen=True)
class Budget:
    """At most ``max_bytes`` of what a page shows, measured by ``row_bytes`` on each row of
    the page's candidates (the page's query as a subquery)."""

    max_bytes: int
    row_bytes: Callable[[Subquery], ColumnElement[int]]


def json_bytes(
    *names: str, kept: Mapping[str, str] | None = None
) -> Callable[[Subquery], ColumnElement[int]]:
    """A row's bytes: the text of these JSON columns, as long as the API's answer has them.

    ``octet_length(col::text)`` rather than ``pg_column_size(col)``: the stored size is after
    compression, and JSON a tenant chose to compress well (a megabyte of one letter) would
    count a hundredth of what it costs to send.

    ``kept``: a JSON column's size column, its bytes measured when it was written; where it
    is set, it is added instead (``COALESCE`` evaluates no further). Turning a megabyte of
    JSON into text costs Postgres about 10 ms, and a page measures ``limit + 1`` rows: with
    40 results of 1.1 MB, a page of ``GET /tasks`` took 424 ms at limit=100 measured so,
    28 ms with the sizes kept."""
    kept = kept or {}

    def measure(rows: Subquery) -> ColumnElement[int]:
        sizes = [
            func.coalesce(
                *([rows.c[kept[n]]] if n in kept else []),
                func.octet_length(cast(rows.c[n], Text)),
                0,
            )
            for n in names
        ]
        return sum(sizes[1:], sizes[0])

    return measure


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
    budget: Budget | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """One page of ``query``'s rows, and the cursor of the next page (None on the last)."""
    if cursor is not None:
        query = query.where(id_column < decode_cursor(cursor))
    rows, more = await first_rows(conn, query, [id_column], limit=limit, budget=budget)
    return rows, encode_cursor(rows[-1]["id"]) if more else None


def encode_created_cursor(created_at: datetime, last_id: str) -> str:
    if _ID.fullmatch(last_id) is None:
        raise ValueError(f"an id that pages by creation time is URL-safe: {last_id!r}")
    micros = (created_at - _EPOCH) // timedelta(microseconds=1)
    at = base64.urlsafe_b64encode(micros.to_bytes(8, "big", signed=True)).decode().rstrip("=")
    return at + last_id


def decode_created_cursor(cursor: str) -> tuple[datetime, str]:
    """``(created_at, id)`` of any string of the documented pattern: a time beyond what a
    datetime holds is taken as the nearest one it does (nothing is older or newer)."""
    if CREATED_CURSOR.fullmatch(cursor) is None:
        raise BadRequest("cursor is not one this API issued", code="invalid_cursor")
    # 11 characters carry 66 bits: the decoder drops the 2 past the 8 bytes.
    raw = base64.urlsafe_b64decode(cursor[:_AT_CHARS] + "=")
    micros = min(max(int.from_bytes(raw, "big", signed=True), _FIRST_US), _LAST_US)
    return _EPOCH + timedelta(microseconds=micros), cursor[_AT_CHARS:]


async def newest_created_first(
    conn: AsyncConnection,
    query: Select[Any],
    created_column: Column[datetime],
    id_column: Column[str],
    *,
    limit: int,
    cursor: str | None,
    budget: Budget | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """``newest_first`` for rows whose ids are not in creation order: by ``created_column``,
    ties broken by ``id_column``."""
    key = tuple_(created_column, id_column)
    if cursor is not None:
        query = query.where(key < tuple_(*decode_created_cursor(cursor)))
    keys: list[Column[Any]] = [created_column, id_column]
    rows, more = await first_rows(conn, query, keys, limit=limit, budget=budget)
    if not more:
        return rows, None
    last = rows[-1]
    return rows, encode_created_cursor(last[created_column.name], last[id_column.name])


async def first_rows(
    conn: AsyncConnection,
    query: Select[Any],
    keys: Sequence[Column[Any]],
    *,
    limit: int,
    budget: Budget | None,
) -> tuple[list[dict[str, Any]], bool]:
    """The first rows of ``query``, newest ``keys`` first, at most ``limit`` of them and
    within ``budget``; and whether more follow."""
    query = query.order_by(*(k.desc() for k in keys)).limit(limit + 1)
    if budget is None:
        rows = [dict(r._mapping) for r in await conn.execute(query)]
        return rows[:limit], len(rows) > limit
    rows = [dict(r._mapping) for r in await conn.execute(_within(query, keys, limit, budget))]
    candidates = rows[0].pop(_CANDIDATES) if rows else 0
    for row in rows[1:]:
        del row[_CANDIDATES]
    return rows, len(rows) < candidates


def _within(
    query: Select[Any], keys: Sequence[Column[Any]], limit: int, budget: Budget
) -> Select[Any]:
    """``query`` (ordered, limit + 1 rows) cut where its running byte count passes the
    budget, each row with the number of candidates.

    The sizes are summed in SQL over the candidates, which the inner LIMIT bounds: Postgres
    measures at most limit + 1 rows, and a row past the budget never leaves it. Measured in
    an outer query, not beside the columns, so a plan that sorts cannot measure every row
    of the tenant's before its LIMIT."""
    candidates = query.subquery("candidates")
    order = [candidates.c[k.name].desc() for k in keys]
    sized = select(
        candidates,
        func.row_number().over(order_by=order).label(_AT),
        func.sum(budget.row_bytes(candidates))
        .over(order_by=order, rows=(None, 0))
        .label(_BYTES_SO_FAR),
        func.count().over().label(_CANDIDATES),
    ).subquery("sized")
    shown = [sized.c[column.key] for column in candidates.c]
    return (
        select(*shown, sized.c[_CANDIDATES])
        .where(
            sized.c[_AT] <= limit,
            # The first row always: a row larger than the budget pages on alone.
            or_(sized.c[_AT] == 1, sized.c[_BYTES_SO_FAR] <= budget.max_bytes),
        )
        .order_by(sized.c[_AT])
    )
