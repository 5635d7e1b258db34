"""Timestamps as the HTTP contract writes them: ISO 8601 in UTC, ending in ``Z``."""

from __future__ import annotations

from datetime import UTC, datetime


def iso(ts: datetime | None) -> str | None:
    """``2024-05-01T12:00:01.250000Z``; None stays None (a time that has not come)."""
    return None if ts is None else ts.astimezone(UTC).isoformat().replace("+00:00", "Z")
