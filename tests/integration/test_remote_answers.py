"""How the bridge reads an agent's answer off a real loopback connection: an ``http`` agent's
JSON or event stream, an A2A agent's card."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from a2a.types import AgentCard

from broker import jsonbody
from broker.errors import AgentFailure
from broker.remote import a2a_card
from broker.remote.connections import MAX_ANSWER_BYTES, MAX_ANSWER_ELEMENTS
from workers.bridge import http_agent
from workers.sdk.context import Context


@contextlib.asynccontextmanager
async def answering(
    pieces: list[bytes], kind: str = "application/json", length: int | None = None
) -> AsyncIterator[str]:
    """An agent whose answer's body comes in ``pieces``, a pause between each, with their
    total as its Content-Length (or ``length``); its URL."""

    handlers: list[asyncio.Task[Any]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.extend(filter(None, [asyncio.current_task()]))
        with contextlib.suppress(ConnectionError):
            await reader.readuntil(b"\r\n\r\n")
            size = sum(map(len, pieces)) if length is None else length
            writer.write(
                f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\n".encode()
                + f"Content-Length: {size}\r\nConnection: close\r\n\r\n".encode()
            )
            for i, piece in enumerate(pieces):
                await asyncio.sleep(0.05 if i else 0)
                writer.write(piece)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/run"
    finally:
        server.close()
        if handlers:  # not left to be cancelled (and logged) as the loop closes
            await asyncio.wait(handlers, timeout=5)


async def _answered_in_pieces(pieces: list[bytes], length: int | None = None) -> bytes:
    """What ``http_agent._read_all`` reads of an answer whose body comes in ``pieces``."""
    async with (
        answering(pieces, length=length) as url,
        aiohttp.ClientSession() as session,
        session.post(url, data=b"{}") as response,
    ):
        return await http_agent._read_all(response)


def test_an_answer_that_arrives_in_pieces_is_read_whole() -> None:
    """aiohttp's ``read(n)`` answers what has arrived, up to n bytes: an agent's result that
    came in several pieces was cut at the first, and the task failed ``agent_protocol``."""
    body = json.dumps({"result": {"text": "x" * 300_000}}).encode()
    pieces = [body[:1000], body[1000:150_000], body[150_000:]]
    assert asyncio.run(_answered_in_pieces(pieces)) == body


def test_an_answer_past_the_limit_in_pieces_is_refused() -> None:
    piece = b"x" * (4 * 1024 * 1024)
    count = MAX_ANSWER_BYTES // len(piece) + 1
    with pytest.raises(AgentFailure, match="too large"):
        asyncio.run(_answered_in_pieces([piece] * count))


def test_a_card_that_arrives_in_pieces_is_read_whole() -> None:
    """The card was read with one ``read(n)`` too: a 6 KB card in two writes was cut at the
    first, and its registration refused as no agent card."""
    card = {
        "name": "Travel",
        "description": "x" * 6000,
        "version": "1",
        "supportedInterfaces": [{"url": "http://127.0.0.1:9/rpc", "protocolBinding": "JSONRPC"}],
        "capabilities": {},
        "skills": [{"id": "book", "name": "Book", "description": ""}],
    }
    body = json.dumps(card).encode()

    async def fetched() -> AgentCard:
        async with answering([body[:3000], body[3000:]]) as url, aiohttp.ClientSession() as s:
            return await a2a_card.fetch(s, url, timeout_s=5)

    assert asyncio.run(fetched()).description == "x" * 6000


def called(kind: str, body: bytes) -> Any:
    """The outcome of a call to an ``http`` agent that answers ``body`` of type ``kind``."""

    async def call() -> Any:
        ctx = Context(task_id=uuid.uuid4(), capability="text.upper", trace_id="t" * 32, attempt=1)
        async with answering([body], kind) as url, aiohttp.ClientSession() as session:
            endpoint = http_agent.Endpoint(url, ("whsec_" + "A" * 32,))
            return await http_agent.call(session, endpoint, ctx, {})

    return asyncio.run(call())


def test_an_event_may_be_one_line_longer_than_aiohttps_limit() -> None:
    """aiohttp reads a line of at most 512 KiB: past it, ``LineTooLong`` (no ClientError)
    failed the task ``agent_error``, though an event may be 16 MiB."""
    text = "x" * 600_000
    body = f"event: result\ndata: {json.dumps({'text': text})}\n\n".encode()
    assert called("text/event-stream", body) == {"text": text}


def test_an_event_line_past_the_limit_of_an_event_fails_agent_protocol() -> None:
    body = b"event: result\ndata: " + b"x" * MAX_ANSWER_BYTES + b"\n\n"
    with pytest.raises(AgentFailure, match="too large") as failed:
        called("text/event-stream", body)
    assert failed.value.code == "agent_protocol"


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("application/json", b"[" * 10_000),
        ("text/event-stream", b"event: result\ndata: " + b"[" * 10_000 + b"\n\n"),
    ],
)
def test_json_nested_deeper_than_it_can_be_read_fails_agent_protocol(
    kind: str, body: bytes
) -> None:
    """json raised RecursionError, which no one caught: the task failed ``agent_error``, with
    a traceback logged."""
    with pytest.raises(AgentFailure) as failed:
        called(kind, body)
    assert failed.value.code == "agent_protocol"


@pytest.mark.parametrize("kind", ["application/json", "text/event-stream"])
def test_an_answer_of_more_values_than_the_bridge_reads_fails_agent_protocol(kind: str) -> None:
    """A tenant's 1 MiB payload of ``[[],[],...]``, echoed back by its agent, cost the
    bridge's loop 0.38-0.48 s a call (an audit, 2026-12-06); A2A answers were already
    capped at ``MAX_ANSWER_ELEMENTS``. Within it, the answer is read whole."""
    many = b"[" + b"[]," * MAX_ANSWER_ELEMENTS + b"[]]"
    fits = b"[" + b"[]," * (MAX_ANSWER_ELEMENTS // 3) + b"[]]"
    if kind == "text/event-stream":
        many, fits = (b"event: result\ndata: " + body + b"\n\n" for body in (many, fits))
    else:
        many, fits = (b'{"result": ' + body + b"}" for body in (many, fits))
    with pytest.raises(AgentFailure, match="JSON values") as failed:
        called(kind, many)
    assert failed.value.code == "agent_protocol"
    assert len(called(kind, fits)) == MAX_ANSWER_ELEMENTS // 3 + 1


@pytest.mark.parametrize(
    "events",
    [
        b'event: result\rdata: {"ok": true}\r\r',
        b'event: result\r\ndata: {"ok": true}\r\n\r\n',
        b'\xef\xbb\xbfevent: result\ndata: {"ok": true}\n\n',
        b': hi\r\n\revent: progress\r\ndata: {"percent": 5}\r\r'
        b'event: result\rdata: {"ok": true}\r\r',
    ],
    ids=["cr", "crlf", "bom", "mixed"],
)
def test_an_event_stream_is_read_with_any_line_end_and_a_leading_bom(events: bytes) -> None:
    """Lines split on LF alone: a stream ending its lines with CR never gave its result
    (``agent_unreachable`` after every attempt), and a leading BOM made the first line's
    field ``\\ufeffevent``, which hid the result event."""
    assert called("text/event-stream", events) == {"ok": True}


def test_a_result_beside_an_error_of_null_is_the_result() -> None:
    """``{"result": ..., "error": null}``, as many JSON APIs write both members, failed the
    task ``agent_error``: "the agent failed"."""
    assert called("application/json", b'{"result": {"ok": true}, "error": null}') == {"ok": True}
    with pytest.raises(AgentFailure) as failed:
        called("application/json", b'{"error": null}')
    assert failed.value.code == "agent_protocol"


def test_a_stream_of_line_ends_fails_agent_protocol_at_its_bound() -> None:
    """4 MiB of line ends, each a blank line that ends no event: the call read all of them,
    the loop held meanwhile (16 s), and ended without a result, ``agent_unreachable``,
    retried."""
    with pytest.raises(AgentFailure, match="empty lines or comments in a row") as failed:
        called("text/event-stream", b"\n" * (4 << 20))
    assert failed.value.code == "agent_protocol"


@pytest.mark.parametrize("data", [b'{"x": NaN}', b'"a\\u0000b"', b'"\\ud800"'])
def test_an_output_event_that_cannot_be_stored_fails_agent_protocol(data: bytes) -> None:
    """The runner's check of an output raised out of the call: the task failed
    ``agent_error``, with a traceback logged, for an agent answering out of protocol."""
    emitted: list[Any] = []

    async def stored(chunk: Any) -> None:  # as the runner's output sink checks it
        jsonbody.written(chunk, max_depth=64)
        emitted.append(chunk)

    async def call() -> Any:
        ctx = Context(
            task_id=uuid.uuid4(),
            capability="text.upper",
            trace_id="t" * 32,
            attempt=1,
            _async_output_sink=stored,
        )
        body = b"event: output\ndata: " + data + b'\n\nevent: result\ndata: {"ok": 1}\n\n'
        async with answering([body], "text/event-stream") as url, aiohttp.ClientSession() as s:
            endpoint = http_agent.Endpoint(url, ("whsec_" + "A" * 32,))
            return await http_agent.call(s, endpoint, ctx, {})

    with pytest.raises(AgentFailure, match="output event cannot be stored") as failed:
        asyncio.run(call())
    assert (failed.value.code, emitted) == ("agent_protocol", [])
