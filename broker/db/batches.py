"""A batch of rows picked once.

``UPDATE … WHERE id IN (SELECT id … LIMIT n FOR UPDATE SKIP LOCKED)`` is planned by
Postgres as a semi-join. Where it picks a nested loop (a small or unanalyzed table), the
limited subquery runs again for each row the outer side checks, each run locking and
returning rows of its own: one statement with a batch of 100 ended 2,000 tasks, in time
growing with the square of the rows. Materialized, the subquery runs once, and a batch is at
most ``n`` rows whatever the plan (``tests/integration/test_batches.py``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, select


def picked_once(picked: Select[Any], name: str = "picked") -> Select[Any]:
    """``picked``'s rows, from a common table expression Postgres runs once: for
    ``column.in_(picked_once(…))``."""
    batch = picked.cte(name).prefix_with("MATERIALIZED")
    return select(*batch.c)
