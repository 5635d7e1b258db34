"""The task resource: statuses, the one-way state machine, ids, and its JSON rendering."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

QUEUED, RUNNING = "queued", "running"
SUCCEEDED, FAILED, CANCELLED, EXPIRED = "succeeded", "failed", "cancelled", "expired"
STATUSES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, EXPIRED)
FINAL = frozenset({SUCCEEDED, FAILED, CANCELLED, EXPIRED})

# Status moves only forward; nothing leaves a final state.
_NEXT: dict[str, frozenset[str]] = {
    QUEUED: frozenset({RUNNING, CANCELLED, EXPIRED, FAILED}),
    RUNNING: frozenset({QUEUED, SUCCEEDED, FAILED, CANCELLED, EXPIRED}),
}


def can_move(current: str, target: str) -> bool:
    return target in _NEXT.get(current, frozenset())


def new_task_id() -> uuid.UUID:
    """A UUIDv7: time-ordered, so the primary key index stays append-mostly and id order is
    creation order (cursor pagination relies on it)."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version
    value |= ((rand >> 62) & 0xFFF) << 64  # rand_a, 12 bits
    value |= 0b10 << 62  # variant
    value |= rand & ((1 << 62) - 1)  # rand_b
    return uuid.UUID(int=value)


_CANONICAL_UUID = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")


def parse_task_id(raw: str) -> uuid.UUID | None:
    """The id in its canonical 36-character form only (no braces, urn: or other digits)."""
    return uuid.UUID(raw) if _CANONICAL_UUID.fullmatch(raw) else None


def _iso(ts: datetime | None) -> str | None:
    if ts is None:
        return None
    return ts.astimezone(UTC).isoformat().replace("+00:00", "Z")


def render(row: Mapping[str, Any]) -> dict[str, Any]:
    """The task resource of the HTTP contract, from a ``tasks`` row."""
    agent = None
    if row["agent_id"] is not None:
        agent = {
            "agent_id": row["agent_id"],
            "version": row["agent_version"],
            "instance": row["instance"],
        }
    return {
        "task_id": str(row["id"]),
        "capability": row["capability"],
        "status": row["status"],
        "progress": row["progress"],
        "result": row["result"],
        "error": row["error"],
        "attempts": row["attempts"],
        "agent": agent,
        "trace_id": row["trace_id"],
        "session_id": row["session_id"],
        "metadata": row["metadata"],
        "created_at": _iso(row["created_at"]),
        "started_at": _iso(row["started_at"]),
        "finished_at": _iso(row["finished_at"]),
        "expires_at": _iso(row["expires_at"]),
    }
