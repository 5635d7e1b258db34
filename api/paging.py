"""The query parameters of a listing: ``limit`` (capped by the server) and ``cursor`` (a
``next_cursor`` the same listing issued; ``broker.db.paging`` decodes it)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query

from broker.db.paging import CREATED_CURSOR_PATTERN, CURSOR_PATTERN

LIMIT_DEFAULT = 50

Limit = Annotated[
    int, Query(ge=1, description="At most this many; the server caps it (list_page_max)")
]
# Listings in id order (ids that grow with time: tasks, deliveries).
Cursor = Annotated[
    str | None,
    Query(
        description="A next_cursor this API issued",
        json_schema_extra={"pattern": CURSOR_PATTERN},
    ),
]
# Listings in creation order (random ids: sessions).
CreatedCursor = Annotated[
    str | None,
    Query(
        description="A next_cursor this API issued",
        json_schema_extra={"pattern": CREATED_CURSOR_PATTERN},
    ),
]
