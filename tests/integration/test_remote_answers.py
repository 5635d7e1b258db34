"""How the bridge reads an ``http`` agent's answer off a real loopback connection."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from broker.errors import AgentFailure
from broker.remote.connections import MAX_ANSWER_BYTES
from workers.bridge import http_agent


async def _answered_in_pieces(pieces: list[bytes], length: int | None = None) -> bytes:
    """What ``http_agent._read_all`` reads of an answer whose body comes in ``pieces``, a
    pause between each, with their total as its Content-Length (or ``length``)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        size = sum(map(len, pieces)) if length is None else length
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {size}\r\nConnection: close\r\n\r\n".encode()
        )
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        url = f"http://127.0.0.1:{port}/run"
        async with aiohttp.ClientSession() as session, session.post(url, data=b"{}") as response:
            return await http_agent._read_all(response)
    finally:
        server.close()


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
