"""Task events: a per-task log in Redis with a sequence number that only grows, and pub/sub
for live delivery.

One Lua script appends an event: it takes the next ``seq`` (INCR), adds it to the task's stream
with the explicit id ``0-<seq>``, sets both keys to expire with the task, and publishes it
(and, for the API's first event of a task, pushes the task's Celery message too). So
the log and the live channel never disagree on order, and a reader that missed a live message
(pub/sub is at-most-once) finds it in the log by ``seq``. The stream is capped at
``LOG_MAX_EVENTS``; the final event is always kept.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

STATUS, PROGRESS, OUTPUT = "status", "progress", "output"
FINAL_TYPES = frozenset({"succeeded", "failed", "cancelled", "expired"})
LOG_MAX_EVENTS = 10_000
CHANNEL_PREFIX = "reach:task:"

_APPEND = """
local seq = redis.call('INCR', KEYS[2])
local event = '{"seq":' .. seq .. ',' .. string.sub(ARGV[1], 2)
redis.call('XADD', KEYS[1], 'MAXLEN', ARGV[3], '0-' .. seq, 'e', event)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('PUBLISH', KEYS[3], event)
if KEYS[4] then redis.call('LPUSH', KEYS[4], ARGV[4]) end
return seq
"""


def log_key(task_id: uuid.UUID | str) -> str:
    return f"reach:events:{task_id}"


def seq_key(task_id: uuid.UUID | str) -> str:
    return f"reach:seq:{task_id}"


def channel(task_id: uuid.UUID | str) -> str:
    return f"{CHANNEL_PREFIX}{task_id}"


@dataclass(frozen=True)
class Event:
    seq: int
    type: str
    data: Any
    trace_id: str
    at: float

    @property
    def final(self) -> bool:
        return self.type in FINAL_TYPES

    @classmethod
    def parse(cls, raw: str | bytes) -> Event:
        doc = json.loads(raw)
        return cls(
            seq=doc["seq"],
            type=doc["type"],
            data=doc["data"],
            trace_id=doc["trace_id"],
            at=doc["at"],
        )

    def sse(self) -> bytes:
        """One SSE frame: id, event and a JSON data line (trace id included)."""
        data = json.dumps(
            {
                "seq": self.seq,
                "type": self.type,
                "trace_id": self.trace_id,
                "at": self.at,
                "data": self.data,
            },
            separators=(",", ":"),
            ensure_ascii=False,
        )
        return f"id: {self.seq}\nevent: {self.type}\ndata: {data}\n\n".encode()


def encode(event_type: str, data: Any, trace_id: str) -> str:
    """The event without its seq (the script prepends it)."""
    body = {"type": event_type, "data": data, "trace_id": trace_id, "at": time.time()}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


class EventLog:
    """The writing side, for workers and the API (redis-py's sync or asyncio client)."""

    def __init__(self, client: Any, ttl_s: int) -> None:
        self.ttl_s = ttl_s
        self._append = client.register_script(_APPEND)

    def _args(
        self,
        task_id: uuid.UUID | str,
        event_type: str,
        data: Any,
        trace_id: str,
        ttl_s: int | None,
        push: tuple[str, bytes] | None = None,
    ) -> dict[str, Any]:
        keys = [log_key(task_id), seq_key(task_id), channel(task_id)]
        argv: list[Any] = [encode(event_type, data, trace_id), ttl_s or self.ttl_s, LOG_MAX_EVENTS]
        if push is not None:
            keys.append(push[0])
            argv.append(push[1])
        return {"keys": keys, "args": argv}

    def append(
        self,
        task_id: uuid.UUID | str,
        event_type: str,
        data: Any,
        *,
        trace_id: str,
        ttl_s: int | None = None,
    ) -> int:
        return int(self._append(**self._args(task_id, event_type, data, trace_id, ttl_s)))

    async def append_async(
        self,
        task_id: uuid.UUID | str,
        event_type: str,
        data: Any,
        *,
        trace_id: str,
        ttl_s: int | None = None,
        push: tuple[str, bytes] | None = None,
    ) -> int:
        """``push``: (list, message) LPUSHed after the event, in the same atomic call."""
        args = self._args(task_id, event_type, data, trace_id, ttl_s, push)
        return int(await self._append(**args))


def parse_entries(entries: Any) -> list[Event]:
    """Events from an XRANGE answer (each entry's one field, ``e``, holds the event)."""
    return [Event.parse(fields.get(b"e") or fields["e"]) for _, fields in entries or []]


def read_log_sync(client: redis.Redis, task_id: uuid.UUID | str, after: int = 0) -> list[Event]:
    return parse_entries(client.xrange(log_key(task_id), min=f"(0-{after}", max="+"))
