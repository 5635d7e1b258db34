"""The task resource: statuses, the one-way state machine, ids, its error and its JSON
rendering."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, NotRequired, TypedDict, get_args

from broker.timestamps import iso

Status = Literal["queued", "running", "succeeded", "failed", "cancelled", "expired"]
STATUSES: tuple[str, ...] = get_args(Status)
QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, EXPIRED = STATUSES


@dataclass(frozen=True)
class Move:
    """A status change a task row may make: from any of ``sources`` to ``target``. Every
    write of a status is conditional on its move's sources (``broker.db.models.in_sources``),
    so a late or repeated write finds the row moved on and changes nothing."""

    sources: tuple[str, ...]
    target: str


# The state machine, one move per operation. Status moves only forward: a task goes back to
# ``queued`` only from ``running``, to be tried again (a new attempt), and nothing leaves a
# final status. Two moves reach ``expired``, each from one status: a running task overran
# its time; a queued one's deadline passed before it started.
CLAIM = Move((QUEUED,), RUNNING)
RETRY = Move((RUNNING,), QUEUED)
SUCCEED = Move((RUNNING,), SUCCEEDED)
FAIL = Move((QUEUED, RUNNING), FAILED)  # from queued: nothing here can run it
# A running task whose worker is lost. Not from queued: the recovery read it running, and
# its worker may have requeued it since (a retry), keeping its attempt.
LOSE = Move((RUNNING,), FAILED)
CANCEL = Move((QUEUED, RUNNING), CANCELLED)
OVERRUN = Move((RUNNING,), EXPIRED)
EXPIRE_UNSTARTED = Move((QUEUED,), EXPIRED)
MOVES = (CLAIM, RETRY, SUCCEED, FAIL, LOSE, CANCEL, OVERRUN, EXPIRE_UNSTARTED)

# Where each status may go; a final status is one the machine never leaves.
NEXT: dict[str, frozenset[str]] = {
    status: frozenset(m.target for m in MOVES if status in m.sources) for status in STATUSES
}
FINAL = frozenset(status for status in STATUSES if not NEXT[status])


class TaskRow(TypedDict):
    """A row of ``tasks`` as it travels between modules. The table is defined in
    ``broker/db/models.py``; a unit test holds the two to the same columns. A row a final write
    returned has no ``payload`` (nothing reads a task's payload once it has ended, and it may
    be a megabyte) and says whether the tenant has a webhook subscription
    (``tenant_subscribes``)."""

    id: uuid.UUID
    tenant: str
    capability: str
    queue: str
    status: str
    payload: NotRequired[Any]
    payload_digest: str
    payload_size: int
    result: Any
    metadata_size: int | None
    result_size: int | None
    error: dict[str, Any] | None
    progress: Any
    attempts: int
    max_attempts: int | None
    priority: int | None
    trace_id: str
    session_id: str | None
    session_turn: int | None
    source: str | None
    metadata: dict[str, Any]
    idempotency_key: str | None
    agent_id: str | None
    agent_version: str | None
    instance: str | None
    result_ttl_s: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    deadline_at: datetime | None
    retry_at: datetime | None
    session_written_at: datetime | None
    expires_at: datetime
    callback: dict[str, Any] | None
    tenant_subscribes: NotRequired[bool]


MESSAGE_MAX = 2000
CODE_MAX = 64


def task_error(code: str, message: str, *, retryable: bool = False) -> dict[str, Any]:
    """A task's ``error``: a stable ``code`` cut to ``CODE_MAX`` characters, a message cut to
    ``MESSAGE_MAX``, and whether trying the task again may succeed. Both as Postgres can
    store them (``storable``): an agent's error that held a NUL failed the final write, and
    its task stayed running for good."""
    return {
        "code": storable(code, CODE_MAX),
        "message": storable(message, MESSAGE_MAX),
        "retryable": retryable,
    }


def said(value: object, show: Callable[[object], str] = str) -> str:
    """``show(value)``, or what it is when that raises: an agent's exception whose ``__str__``
    raised failed its run's failure, and its task was left for the orphan check."""
    try:
        return show(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"


def storable(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with what no Postgres text or JSON holds replaced
    by U+FFFD: NUL, and a lone surrogate (no UTF-8 encodes it)."""
    text = said(text)[:limit].replace("\x00", "\ufffd")
    if text.isascii():
        return text
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)


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


# The columns the resource shows as they are stored, and its times, in the contract's order.
_AS_STORED = ("capability", "status", "progress", "result", "error", "attempts")
_AS_STORED_AFTER_AGENT = ("trace_id", "session_id", "metadata")
_TIMES = ("created_at", "started_at", "finished_at", "expires_at")
_AGENT = ("agent_id", "agent_version", "instance")
# Every column ``render`` reads: what a listing selects (not the payload, nor the callback).
SHOWN_COLUMNS = ("id", *_AS_STORED, *_AGENT, *_AS_STORED_AFTER_AGENT, *_TIMES)
# Those that hold JSON, which a listing's byte budget counts.
SHOWN_JSON = ("progress", "result", "error", "metadata")


def render(row: TaskRow) -> dict[str, Any]:
    """The task resource of the HTTP contract, from a ``tasks`` row."""
    agent = None
    if row["agent_id"] is not None:
        agent = {
            "agent_id": row["agent_id"],
            "version": row["agent_version"],
            "instance": row["instance"],
        }
    stored: Mapping[str, Any] = row
    return {
        "task_id": str(row["id"]),
        **{name: stored[name] for name in _AS_STORED},
        "agent": agent,
        **{name: stored[name] for name in _AS_STORED_AFTER_AGENT},
        **{name: iso(stored[name]) for name in _TIMES},
    }
