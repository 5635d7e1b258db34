"""Task events: a per-task log in Redis with a sequence number that only grows, and pub/sub
for live delivery.

One Lua script appends events: for each it takes the next ``seq`` (INCR), adds it to the task's
stream with the explicit id ``0-<seq>``, sets its keys to expire with the task, and publishes
it (and, for the API's first event of a task, pushes the task's Celery message too). So
the log and the live channel never disagree on order, and a reader that missed a live message
(pub/sub is at-most-once) finds it in the log by ``seq``.

A final event closes the log: the script records its ``seq`` under ``final_key`` and refuses
every later append (it returns 0 for it). So whoever announces a final state (the worker, a
redelivery of its message, the reaper, a reader that found the task final in Postgres) may
append it again: the log holds it exactly once, and it is always the last event.

The log holds at most ``LOG_MAX_EVENTS`` events and at most ``max_bytes`` of them
(``REACH_EVENT_LOG_MAX_BYTES``), its final event aside: past either, its oldest events give
way, as a reader that comes late finds them gone (it reads from the oldest kept). The bytes are
counted under ``bytes_key`` as events go in and out. One event larger than the whole budget is
refused (``FULL``), which raises ``EventsTooLarge`` in the handler that sent it (the task fails
``events_too_large``). The final event carries the result, bounded on its own
(``REACH_MAX_RESULT_BYTES``), and is always let in. Before the bytes were bounded, an agent
streaming large chunks filled Redis for every tenant: 10,000 events of any size.

Every event counts against its tenant too, in one hash per tenant (``tenant_bytes_key``)
whose fields are the hours by which the bytes added to them are gone: the hour the event's
log expires, as of the append. The script adds each event it stores (the final one too: it
carries the result) and takes back each one it lets go, and with the event that creates a
log it adds what the log holds beside its events (``LOG_OVERHEAD_BYTES``: a small task's
stream and keys take about six times its events' bytes), counted in the same hour. So the
live fields' sum is what the tenant's logs hold in Redis (``broker.tenancy.usage.RedisHeld``)
to within a task's run time (a log's expiry moves on with each append), and at most a node's
4 KiB over for each. Redis is the broker's memory, and every tenant's: past
``REACH_TENANT_MAX_EVENT_BYTES`` a tenant's submits are refused until some of its logs
expire.

A worker's events carry the attempt they belong to, and the log keeps the latest attempt it
has seen under ``attempt_key``: an event of an earlier attempt is refused (0), as its final
write is in Postgres. A worker that stopped answering long enough for the reaper to give its
task to another (a paused process, a network cut) wakes to a stale attempt, whose progress
and outputs must not mix with the new attempt's. The event that requeues a task opens the
next attempt, so the old one is shut out from there on, before any new worker claims it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis

from broker import jsoncodec
from broker.errors import EventsTooLarge
from broker.grouping import Grouped, ThreadGrouped
from broker.tasks.resource import FINAL, STATUSES, TaskRow, render

STATUS, PROGRESS, OUTPUT = "status", "progress", "output"
# Every type a stream carries: the three above, then one final event named after the status.
STREAM_EVENT_TYPES = (STATUS, PROGRESS, OUTPUT, *(s for s in STATUSES if s in FINAL))
LOG_MAX_EVENTS = 10_000
FULL = -1  # what an append past the budget comes to
# What a log holds in Redis beside its events' bytes, by MEMORY USAGE on Redis 7.0.15: its
# stream, 4,784 bytes for one event or for as many as fill 4 KiB (the stream's first node is
# allocated whole, stream-node-max-bytes' 4,096), and its four small keys (seq, attempt,
# bytes and final marker), 104 bytes each. Counted without it, 2,000 small echo tasks held
# 5.85 times what their tenant was counted.
STREAM_NODE_BYTES = 4_784
LOG_KEY_BYTES = 104
LOG_OVERHEAD_BYTES = STREAM_NODE_BYTES + 4 * LOG_KEY_BYTES
CHANNEL_PREFIX = "reach:task:"

# Appends any number of events (one per task): ARGV[1] is the most events a log holds, ARGV[2]
# the most bytes, ARGV[3] what a new log counts beside its events (``LOG_OVERHEAD_BYTES``),
# then per event i (from 0) ARGV[4+6i] the event without its seq, ARGV[5+6i] its TTL,
# ARGV[6+6i] a Celery message to LPUSH after it or '', ARGV[7+6i] '1' for a final event,
# ARGV[8+6i] the attempt it belongs to or 0, ARGV[9+6i] the hour its bytes are gone by;
# KEYS[1+8i..8+8i] its log, seq, channel, list, final marker, latest attempt, the bytes the
# log holds and its tenant's bytes by hour. An event for a closed log, or of an attempt older
# than the latest, is refused (0); one larger than the whole budget too (-1, a final one
# aside). Past either bound the oldest events give way (never the newest).
_APPEND = """
local seqs = {}
local cap, budget, overhead = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 0, (#ARGV - 3) / 6 - 1 do
  local k, a = 8 * i, 4 + 6 * i
  local log, held, ttl = KEYS[k + 1], KEYS[k + 7], ARGV[a + 1]
  local tenant, hour = KEYS[k + 8], ARGV[a + 5]
  local final = ARGV[a + 3] == '1'
  local attempt = tonumber(ARGV[a + 4])
  local refused = redis.call('EXISTS', KEYS[k + 5]) == 1
  if not refused and attempt > 0 then
    refused = attempt < tonumber(redis.call('GET', KEYS[k + 6]) or '0')
    if not refused then redis.call('SET', KEYS[k + 6], attempt, 'EX', ttl) end
  end
  if refused then
    seqs[i + 1] = 0
  elseif not final and #ARGV[a] > budget then
    seqs[i + 1] = -1
  else
    local seq = redis.call('INCR', KEYS[k + 2])
    local event = '{"seq":' .. seq .. ',' .. string.sub(ARGV[a], 2)
    local added = #event
    -- A new log takes its stream's first node and its keys: counted once, gone by its hour
    if redis.call('EXISTS', log) == 0 then added = added + overhead end
    if final then
      redis.call('XADD', log, 'MAXLEN', cap, '0-' .. seq, 'e', event)
      redis.call('SET', KEYS[k + 5], seq, 'EX', ttl)
    else
      redis.call('XADD', log, '0-' .. seq, 'e', event)
      local bytes = redis.call('INCRBY', held, #event)
      local n = redis.call('XLEN', log)
      while (bytes > budget or n > cap) and n > 1 do
        local oldest = redis.call('XRANGE', log, '-', '+', 'COUNT', 1)[1]
        bytes = redis.call('INCRBY', held, -#oldest[2][2])
        added = added - #oldest[2][2]
        redis.call('XDEL', log, oldest[1])
        n = n - 1
      end
      -- Alone in its log, the event is all it holds: a log lost before its count starts anew
      if n == 1 then
        redis.call('SET', held, #event, 'EX', ttl)
      else
        redis.call('EXPIRE', held, ttl)
      end
    end
    redis.call('EXPIRE', log, ttl)
    redis.call('EXPIRE', KEYS[k + 2], ttl)
    redis.call('HINCRBY', tenant, hour, added)
    if redis.call('TTL', tenant) < ttl + 3540 then redis.call('EXPIRE', tenant, ttl + 3600) end
    redis.call('PUBLISH', KEYS[k + 3], event)
    if ARGV[a + 2] ~= '' then redis.call('LPUSH', KEYS[k + 4], ARGV[a + 2]) end
    seqs[i + 1] = seq
  end
end
return seqs
"""
GROUP_MAX_EVENTS = 100


@dataclass(frozen=True)
class Append:
    """One event to append, counted against ``tenant``; ``push``: (list, message) LPUSHed
    right after it, atomically. ``attempt``: the attempt it belongs to (refused once a later
    one has appended), or 0. ``hold_s``: its log is kept that much past ``ttl_s`` (a running
    attempt's, as long as its row), its bytes counted until ``ttl_s`` only."""

    task_id: uuid.UUID | str
    type: str
    data: Any
    trace_id: str
    tenant: str
    ttl_s: int
    push: tuple[str, bytes] | None = None
    attempt: int = 0
    hold_s: int = 0


def log_key(task_id: uuid.UUID | str) -> str:
    return f"reach:events:{task_id}"


def seq_key(task_id: uuid.UUID | str) -> str:
    return f"reach:seq:{task_id}"


def attempt_key(task_id: uuid.UUID | str) -> str:
    """The latest attempt whose events the log took (see the module's doc)."""
    return f"reach:attempt:{task_id}"


def final_key(task_id: uuid.UUID | str) -> str:
    """Holds the seq of the task's final event once there is one: the log is closed."""
    return f"reach:final:{task_id}"


def handed_key(task_id: uuid.UUID | str) -> str:
    """The ids resumed streams gave the final event of a log that began again, a sorted set
    by when (``broker.tasks.eventhub``)."""
    return f"reach:handedids:{task_id}"


def bytes_key(task_id: uuid.UUID | str) -> str:
    """The bytes the log's events hold, its final event aside (see the module's doc)."""
    return f"reach:logbytes:{task_id}"


def tenant_bytes_key(tenant: str) -> str:
    """The bytes a tenant's logs hold, by the hour they are gone by (see the module's doc)."""
    return f"reach:tenantbytes:{tenant}"


def gone_by_hour(ttl_s: int, now: float) -> int:
    """The hour (counted from the epoch) by whose start a log expiring ``ttl_s`` after
    ``now`` is gone: its bytes are counted until then."""
    return -(-int(now + ttl_s) // 3600)


def channel(task_id: uuid.UUID | str) -> str:
    return f"{CHANNEL_PREFIX}{task_id}"


@dataclass(frozen=True)
class Event:
    seq: int
    type: str
    data: Any
    trace_id: str
    at: float
    # The JSON it was read from (the log's entry, pub/sub's message), which holds just these
    # fields: ``sse`` writes it out as it is instead of writing them again.
    stored: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def final(self) -> bool:
        """A final event's type is the final status it announces."""
        return self.type in FINAL

    @classmethod
    def parse(cls, raw: str | bytes) -> Event:
        doc = jsoncodec.loads(raw)
        return cls(
            seq=doc["seq"],
            type=doc["type"],
            data=doc["data"],
            trace_id=doc["trace_id"],
            at=doc["at"],
            stored=raw if isinstance(raw, bytes) else raw.encode(),
        )

    def sse(self) -> bytes:
        """One SSE frame: id, event and a JSON data line (trace id included). The line
        breaks Python's ``str.splitlines`` knows beyond CR and LF (httpx's ``iter_lines``
        splits there, and so read our own client) are escaped; JSON's control characters
        are escaped already. An event read from the log is written out as it was stored: a
        replay of 10,000 events spent half its CPU writing each one's JSON again."""
        if self.stored is not None:
            stored = self.stored
            if b"\xe2\x80" in stored or b"\xc2\x85" in stored:  # U+2028, U+2029, U+0085
                for breaking, escaped in _LINE_BREAK_BYTES:
                    stored = stored.replace(breaking, escaped)
            return b"id: %d\nevent: %s\ndata: %s\n\n" % (self.seq, self.type.encode(), stored)
        data = jsoncodec.dumps_str(
            {
                "seq": self.seq,
                "type": self.type,
                "trace_id": self.trace_id,
                "at": self.at,
                "data": self.data,
            }
        ).translate(_LINE_BREAKS)
        return f"id: {self.seq}\nevent: {self.type}\ndata: {data}\n\n".encode()


# Unicode's line breaks that JSON leaves as they are, as JSON escapes: str.splitlines
# breaks lines at them.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
_LINE_BREAK_BYTES = tuple(
    (line_break.encode(), f"\\u{ord(line_break):04x}".encode()) for line_break in "\x85\u2028\u2029"
)


def encode(event_type: str, data: Any, trace_id: str) -> str:
    """The event without its seq (the script prepends it)."""
    body = {"type": event_type, "data": data, "trace_id": trace_id, "at": time.time()}
    return jsoncodec.dumps_str(body)


# Events outlive the result a little, so a stream opened just before expiry still ends.
EVENTS_SLACK_S = 3600


class EventLog:
    """The writing side, for workers and the API (redis-py's sync or asyncio client). Appends
    that arrive together go out in one call (``grouping``): from the API's coroutines, or from
    a worker's threads."""

    def __init__(
        self, client: Any, ttl_s: int, max_bytes: int, max_events: int = LOG_MAX_EVENTS
    ) -> None:
        self.ttl_s = ttl_s
        self.max_bytes, self.max_events = max_bytes, max_events
        self._append = client.register_script(_APPEND)
        self._grouped = Grouped(
            self._append_many, max_items=GROUP_MAX_EVENTS, name="events", retry_alone=False
        )
        self._grouped_sync = ThreadGrouped(
            self._append_many_sync, max_items=GROUP_MAX_EVENTS, name="events", retry_alone=False
        )

    def _item(
        self,
        task_id: uuid.UUID | str,
        event_type: str,
        data: Any,
        trace_id: str,
        tenant: str,
        ttl_s: int | None,
        push: tuple[str, bytes] | None = None,
        attempt: int = 0,
        hold_s: int = 0,
    ) -> Append:
        ttl_s = ttl_s or self.ttl_s
        return Append(task_id, event_type, data, trace_id, tenant, ttl_s, push, attempt, hold_s)

    def _args(self, items: list[Append]) -> dict[str, Any]:
        keys: list[Any] = []
        argv: list[Any] = [self.max_events, self.max_bytes, LOG_OVERHEAD_BYTES]
        now = time.time()
        for item in items:
            task_id = str(item.task_id)
            log = log_key(task_id)
            queue, message = item.push if item.push is not None else (log, b"")
            keys += [log, seq_key(task_id), channel(task_id), queue, final_key(task_id)]
            keys += [attempt_key(task_id), bytes_key(task_id), tenant_bytes_key(item.tenant)]
            final = "1" if item.type in FINAL else ""
            event = encode(item.type, item.data, item.trace_id)
            hour = gone_by_hour(item.ttl_s, now)
            argv += [event, item.ttl_s + item.hold_s, message, final, item.attempt, hour]
        return {"keys": keys, "args": argv}

    def append(
        self,
        task_id: uuid.UUID | str,
        event_type: str,
        data: Any,
        *,
        trace_id: str,
        tenant: str,
        ttl_s: int | None = None,
        attempt: int = 0,
        hold_s: int = 0,
    ) -> int:
        """The event's seq; 0 when the log was closed already (a final event is in it), or
        when ``attempt`` (the attempt the event belongs to) is older than the latest one.
        Raises ``EventsTooLarge`` for an event larger than the log may hold (``max_bytes``).
        ``hold_s``: as ``Append``'s."""
        item = self._item(
            task_id, event_type, data, trace_id, tenant, ttl_s, attempt=attempt, hold_s=hold_s
        )
        return self._taken(self._grouped_sync(item))

    async def append_async(
        self,
        task_id: uuid.UUID | str,
        event_type: str,
        data: Any,
        *,
        trace_id: str,
        tenant: str,
        ttl_s: int | None = None,
        push: tuple[str, bytes] | None = None,
        attempt: int = 0,
        hold_s: int = 0,
    ) -> int:
        """``push``: (list, message) LPUSHed after the event, in the same atomic call (not
        when the event is refused: 0, as ``append``)."""
        item = self._item(task_id, event_type, data, trace_id, tenant, ttl_s, push, attempt, hold_s)
        return self._taken(await self._grouped(item))

    def _taken(self, seq: int) -> int:
        if seq == FULL:
            raise EventsTooLarge(self.max_bytes)
        return seq

    def append_final(self, row: TaskRow) -> int:
        """The final event of a final task row (the task as it ended); 0 when the log has its
        final event already."""
        return self._grouped_sync(self._final(row))

    async def append_final_async(self, row: TaskRow) -> int:
        return await self._grouped(self._final(row))

    def _final(self, row: TaskRow) -> Append:
        ttl_s = row["result_ttl_s"] + EVENTS_SLACK_S
        return self._item(
            row["id"], row["status"], render(row), row["trace_id"], row["tenant"], ttl_s
        )

    async def _append_many(self, items: list[Append]) -> list[int]:
        return [int(seq) for seq in await self._append(**self._args(items))]

    def _append_many_sync(self, items: list[Append]) -> list[int]:
        return [int(seq) for seq in self._append(**self._args(items))]


_SEQ_FIRST, _TYPE_AFTER_SEQ = b'{"seq":', b',"type":"'


def type_of(stored: bytes | str) -> str:
    """A stored event's type, read from the front of its JSON, which the append script writes
    as ``{"seq":<n>,"type":"<type>",`` (the whole of it parsed when it is not so)."""
    raw = stored if isinstance(stored, bytes) else stored.encode()
    digits = len(raw[7:27]) - len(raw[7:27].lstrip(b"0123456789"))
    start = 7 + digits + len(_TYPE_AFTER_SEQ)
    end = raw.find(b'"', start, start + 64)
    if raw.startswith(_SEQ_FIRST) and raw.startswith(_TYPE_AFTER_SEQ, 7 + digits) and end > 0:
        found = raw[start:end]
        if b"\\" not in found:
            return found.decode()
    return str(jsoncodec.loads(raw)["type"])


def parse_entries(entries: Any) -> list[Event]:
    """Events from an XRANGE answer (each entry's one field, ``e``, holds the event)."""
    return [Event.parse(fields.get(b"e") or fields["e"]) for _, fields in entries or []]


def unannounced(client: redis.Redis, task_ids: list[uuid.UUID]) -> list[uuid.UUID]:
    """The tasks among ``task_ids`` whose log holds no final event (one round trip)."""
    if not task_ids:
        return []
    closed = client.mget([final_key(t) for t in task_ids])
    return [t for t, seq in zip(task_ids, closed, strict=True) if seq is None]


def read_log_sync(client: redis.Redis, task_id: uuid.UUID | str, after: int = 0) -> list[Event]:
    return parse_entries(client.xrange(log_key(task_id), min=f"(0-{after}", max="+"))
