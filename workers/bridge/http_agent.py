"""The ``http`` protocol: how the bridge calls a remote agent (``shared/design.md``).

The broker POSTs ``{"task_id", "capability", "payload", "attempt", "deadline_at", "session",
"metadata"}``, signed with the agent's secret (Standard Webhooks headers), with the task's
``traceparent`` and ``Idempotency-Key: <task_id>``. The agent answers ``application/json``
(``{"result": ...}`` or ``{"error": {...}}``) or ``text/event-stream`` (``progress``,
``output``, then ``result`` or ``error``).

``session`` is the task's session as its claim read it, ``{"session_id", "revision",
"state"}`` (null without one). The agent writes the next revision with ``"session":
{"state": {...}}`` beside its ``result``, or with a ``session`` event before it: what
``ctx.session.update`` does for a Python agent, a compare-and-set on the revision sent.

What is retried follows the seeds: a connection that fails, a first byte that does not come
within ``first_byte_timeout_s``, 408, 429 and 5xx; never once output was streamed (the caller
has seen it). Any other 4xx fails at once. The call's own end (its timeout, the task's
deadline, a cancel) cancels this coroutine, which closes the connection: the agent sees the
call closed.

A failure of the connection or of what the agent sent becomes the task's error with a fixed
message, the exception's text logged with the task's id: the text names the agent's address
(``Cannot connect to host 127.0.0.1:1 ...``), which tenants are never shown.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from broker import jsoncodec
from broker.errors import AgentFailure, BadRequest, Retryable
from broker.remote.connections import (
    MAX_ANSWER_BYTES,
    MAX_ANSWER_ELEMENTS,
    JsonElements,
    read_body,
    undecodable,
)
from broker.timestamps import agent_retry_after
from broker.webhooks import signing
from workers.sdk.context import PROGRESS_MESSAGE_MAX, Context
from workers.sdk.session import SessionConflict

log = logging.getLogger("reach.bridge")

RETRIED_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))
ACCEPT = "text/event-stream, application/json"
# The lines of a stream that carry nothing (blank lines that end no event, comments) it may
# send in a row: a stream of 4 MiB of line ends held the bridge's loop, every tenant's calls
# with it, for 16 s (30 s gzipped, from 4 KiB on the wire). A keep-alive comment each 15 s
# sends 240 an hour.
MAX_EMPTY_LINES = 1_000
LINES_PER_TURN = 256  # lines read from what has arrived before the loop runs its other calls
_LINE_END = re.compile(rb"[\r\n]")
# A body whose Content-Encoding cannot be undone: the agent's answer, broken; not retried
_UNDECODABLE = "the agent's answer could not be decoded"


@dataclass(frozen=True)
class Endpoint:
    """Where and how to call one remote agent."""

    url: str
    secrets: tuple[str, ...]  # every secret that signs now: the newest first
    first_byte_timeout_s: float = 30.0


def request_body(ctx: Context, payload: Any) -> bytes:
    return jsoncodec.dumps(
        {
            "task_id": str(ctx.task_id),
            "capability": ctx.capability,
            "payload": payload,
            "attempt": ctx.attempt,
            "deadline_at": ctx.deadline_at.isoformat() if ctx.deadline_at else None,
            "session": _session_of(ctx),
            "metadata": ctx.metadata,
        }
    )


def _session_of(ctx: Context) -> dict[str, Any] | None:
    """The task's session as its claim read it (``ctx.session`` of a Python agent), or None."""
    if ctx.session is None:
        return None
    session = ctx.session
    return {"session_id": session.session_id, "revision": session.revision, "state": session.state}


def request_headers(endpoint: Endpoint, ctx: Context, body: bytes) -> dict[str, str]:
    message_id = signing.message_id()  # one per call: a retry is a new message
    return {
        "Content-Type": "application/json",
        "Accept": ACCEPT,
        "Idempotency-Key": str(ctx.task_id),
        **ctx.trace_headers(),
        **signing.headers(endpoint.secrets, message_id, int(time.time()), body),
    }


async def call(
    session: aiohttp.ClientSession, endpoint: Endpoint, ctx: Context, payload: Any
) -> Any:
    """The agent's result; raises ``Retryable`` or ``AgentFailure`` as the rules above say. A
    failure at the deadline (the agent may stop at the ``deadline_at`` it was sent) ends the
    task ``expired``: the runner's rule for every agent."""
    body = request_body(ctx, payload)
    headers = request_headers(endpoint, ctx, body)
    try:
        async with asyncio.timeout(endpoint.first_byte_timeout_s):  # no task of its own
            response = await session.post(
                endpoint.url, data=body, headers=headers, allow_redirects=False
            )
    except TimeoutError:
        raise Retryable(
            f"no answer within {endpoint.first_byte_timeout_s:g}s", code="agent_timeout"
        ) from None
    except aiohttp.ClientError as exc:
        _log(ctx, exc)
        if undecodable(exc):  # an encoding aiohttp cannot undo at all fails in the head
            raise AgentFailure(_UNDECODABLE, code="agent_protocol") from None
        raise Retryable("the agent could not be reached", code="agent_unreachable") from None
    async with response:
        if response.status != 200:
            await _refuse(response, endpoint.first_byte_timeout_s)
        kind = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if kind == "text/event-stream":
            return await _streamed(response, ctx)
        if kind != "application/json":
            raise AgentFailure(f"the agent answered {kind or 'no type'}", code="agent_protocol")
        try:
            answer = _parsed(await _read_all(response))
        except (aiohttp.ClientError, asyncio.IncompleteReadError) as exc:
            _log(ctx, exc)
            if undecodable(exc):
                raise AgentFailure(_UNDECODABLE, code="agent_protocol") from None
            raise Retryable("the agent's answer broke off", code="agent_unreachable") from None
        except ValueError as exc:
            _log(ctx, exc)
            raise AgentFailure("the agent's JSON is invalid", code="agent_protocol") from None
        result = _outcome(answer, streamed=False)
        if isinstance(answer, dict) and "session" in answer:
            await _write_session(ctx, answer["session"], streamed=False)
        return result


def _log(ctx: Context, exc: BaseException) -> None:
    """What the task's error does not say: the exception, with the agent's address."""
    log.warning("the call of task %s failed: %s: %s", ctx.task_id, type(exc).__name__, exc)


async def _refuse(response: aiohttp.ClientResponse, within_s: float) -> None:
    """Raise for an answer other than 200: retried for 408, 429 and 5xx only. Its text, the
    start of its body, is read within ``within_s``, and is none when the body breaks off or
    does not come: a 503 whose body broke off raised aiohttp's error (never retried), and one
    whose body never came held the call until the task's time limit."""
    try:
        async with asyncio.timeout(within_s):
            read = await response.content.read(2048)
    except (aiohttp.ClientError, asyncio.IncompleteReadError, TimeoutError):
        read = b""
    detail = read.decode("utf-8", "replace").strip()
    message = f"the agent answered {response.status}" + (f": {detail}" if detail else "")
    if response.status in RETRIED_STATUSES:
        delay = agent_retry_after(response.headers.get("Retry-After"))
        raise Retryable(message, code=f"agent_http_{response.status}", delay_s=delay)
    raise AgentFailure(message, code=f"agent_http_{response.status}")


async def _read_all(response: aiohttp.ClientResponse) -> bytes:
    """The whole body, up to ``MAX_ANSWER_BYTES``."""
    body = await read_body(response, MAX_ANSWER_BYTES)
    if len(body) > MAX_ANSWER_BYTES:
        raise AgentFailure("the agent's answer is too large", code="agent_protocol")
    return body


def _parsed(body: bytes) -> Any:
    """An answer's (or an event's) JSON, of at most ``MAX_ANSWER_ELEMENTS`` values, counted
    in C before it is parsed, as an A2A agent's answers are: a tenant's 1 MiB payload of
    ``[[],[],...]`` echoed back cost the bridge's loop 0.38-0.48 s a call to parse, check
    and store, and two such submits a second stalled every tenant's calls (an audit,
    2026-12-06)."""
    if JsonElements().add(body, most=MAX_ANSWER_ELEMENTS) > MAX_ANSWER_ELEMENTS:
        raise AgentFailure(
            f"the agent's answer holds more than {MAX_ANSWER_ELEMENTS} JSON values",
            code="agent_protocol",
        )
    return jsoncodec.loads(body)


def _outcome(answer: Any, *, streamed: bool) -> Any:
    """The result of a ``{"result"}`` answer; raises for an ``{"error"}`` one (an error of
    ``null`` beside a result, as many JSON APIs write them, is none)."""
    if isinstance(answer, dict) and answer.get("error") is not None:
        error = answer["error"] if isinstance(answer["error"], dict) else {}
        # text, cut and made storable (task_error); a code that is no text is none (it was
        # stored as its Python repr, ``{'a': [1]}``)
        code = error.get("code") if isinstance(error.get("code"), str) else None
        code = code or "agent_error"
        message = str(error.get("message") or "the agent failed")
        if error.get("retryable") is True and not streamed:
            raise Retryable(message, code=code)
        raise AgentFailure(message, code=code)
    if isinstance(answer, dict) and "result" in answer:
        return answer["result"]
    raise AgentFailure("the agent answered neither a result nor an error", code="agent_protocol")


async def _streamed(response: aiohttp.ClientResponse, ctx: Context) -> Any:
    """Read the agent's events: progress and output become the task's, the last one ends it."""
    streamed = False
    try:
        async for event, data in _events(response):
            if event == "progress" and isinstance(data, dict):
                percent = data.get("percent")
                if isinstance(percent, int | float) and not isinstance(percent, bool):
                    message = data.get("message")
                    await ctx.progress_async(
                        float(min(100.0, max(0.0, percent))),
                        str(message)[:PROGRESS_MESSAGE_MAX] if message is not None else None,
                    )
            elif event == "output":
                try:
                    await ctx.emit_async(data)
                except (BadRequest, ValueError) as exc:  # NaN, a NUL, a lone surrogate
                    raise AgentFailure(
                        f"the agent's output event cannot be stored: {exc}", code="agent_protocol"
                    ) from None
                streamed = True
            elif event == "session":
                await _write_session(ctx, data, streamed=streamed)
                # written: a retry would send the next revision, and the agent apply its turn
                # to it again; as output sent, nothing after it is retried
                streamed = streamed or data is not None
            elif event == "result":
                return _outcome({"result": data}, streamed=streamed)
            elif event == "error":
                return _outcome({"error": data}, streamed=streamed)
    except (aiohttp.ClientError, asyncio.IncompleteReadError) as exc:
        _log(ctx, exc)
        if undecodable(exc):
            raise AgentFailure(_UNDECODABLE, code="agent_protocol") from None
        if streamed:
            raise AgentFailure("the stream broke off", code="agent_stream_broken") from None
        raise Retryable("the stream broke off", code="agent_unreachable") from None
    if streamed:
        raise AgentFailure("the stream ended without a result", code="agent_stream_broken")
    raise Retryable("the stream ended without a result", code="agent_unreachable")


async def _write_session(ctx: Context, written: Any, *, streamed: bool) -> None:
    """Write the task's session as the agent answered (``{"state": {...}}``), at the revision
    it was sent: ``ctx.session.update`` of a Python agent. A session that moved meanwhile (a
    ``PUT`` through the API) is ``session_conflict``: retried, a fresh read sent, unless
    output was streamed. ``null`` writes nothing (as an answer without ``session``)."""
    if written is None:
        return
    if not (isinstance(written, dict) and isinstance(written.get("state"), dict)):
        raise AgentFailure('the agent\'s "session" is not {"state": {...}}', code="agent_protocol")
    if ctx.session is None:
        raise AgentFailure("the agent wrote a session; its task has none", code="agent_protocol")
    try:
        await ctx.session.update_async(written["state"])
    except SessionConflict as exc:
        if streamed:
            raise AgentFailure(exc.message, code=exc.code) from None
        raise


async def _events(response: aiohttp.ClientResponse) -> Any:
    """``(event, data)`` for each event of a text/event-stream body; data parsed as JSON. As
    the format has it: a line ends with CRLF, LF or a lone CR, and a leading BOM is dropped
    (read as a field's name, it hid the stream's first event)."""
    event, size, empty = "message", 0, 0
    data: list[str] = []
    lines = _Lines(response)
    while True:
        line = await lines.next(MAX_ANSWER_BYTES - size)
        if line is None:
            return
        size += len(line) + 1
        text = line.decode("utf-8", "replace")
        if lines.count == 1:
            text = text.removeprefix("\ufeff")
        if not text or text.startswith(":"):
            empty = 0 if data and not text else empty + 1
            if empty > MAX_EMPTY_LINES:
                raise AgentFailure(
                    f"the agent's stream sent more than {MAX_EMPTY_LINES} empty lines or "
                    "comments in a row",
                    code="agent_protocol",
                )
        if not text:
            if data:
                try:
                    yield event, _parsed("\n".join(data).encode())
                except ValueError:
                    raise AgentFailure(
                        f"the agent's {event} event holds no JSON", code="agent_protocol"
                    ) from None
            event, data, size = "message", [], 0
            continue
        if text.startswith(":"):
            continue
        field, _, value = text.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            event = value
        elif field == "data":
            data.append(value)


class _Lines:
    """An event stream's lines as they arrive, each without its end (CRLF, LF or CR). A CR
    that ends what has arrived waits for the next byte: it may be a CRLF's."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.content = response.content
        self.buffer = bytearray()
        self.ended = False
        self.count = 0
        self._since_turn = 0  # lines served from the buffer since the loop last ran others

    async def next(self, left: int) -> bytes | None:
        """The next line, of at most ``left`` bytes (what is left of its event's budget),
        else the task fails; None at the stream's end. Every ``LINES_PER_TURN`` lines taken
        from what had arrived, the loop runs its other calls first: a chunk of 600 KiB holds
        that many lines, and reading them held every other tenant's calls meanwhile."""
        self._since_turn += 1
        if self._since_turn >= LINES_PER_TURN:
            self._since_turn = 0
            await asyncio.sleep(0)
        searched = 0
        while True:
            end = _line_end(self.buffer, searched)
            if end >= 0 and (self.buffer[end] == 0x0A or end + 1 < len(self.buffer) or self.ended):
                line = bytes(self.buffer[:end])
                del self.buffer[: end + (2 if self.buffer[end : end + 2] == b"\r\n" else 1)]
                return self._counted(line, left)
            if (end if end >= 0 else len(self.buffer)) > left:
                raise _event_too_large()
            if self.ended:
                if not self.buffer:
                    return None
                line = bytes(self.buffer)
                self.buffer.clear()
                return self._counted(line, left)
            searched = len(self.buffer) if end < 0 else end
            self._since_turn = 0  # the read below lets the loop run its other calls
            chunk = await self.content.readany()
            self.ended = not chunk
            self.buffer += chunk

    def _counted(self, line: bytes, left: int) -> bytes:
        if len(line) > left:
            raise _event_too_large()
        self.count += 1
        return line


def _line_end(buffer: bytearray, start: int) -> int:
    """Where the first CR or LF from ``start`` is, or -1. One search that stops at the first:
    a search for each of them went on to the buffer's end for the one not there (CR, in a
    stream of LF-ended lines), for every line of it."""
    found = _LINE_END.search(buffer, start)
    return found.start() if found else -1


def _event_too_large() -> AgentFailure:
    return AgentFailure("an event of the agent's stream is too large", code="agent_protocol")
