"""The session the bridge calls agents with (``broker.remote.connections``), against a
loopback HTTP server."""

from __future__ import annotations

import asyncio
import contextlib

from broker.remote.connections import guarded_session
from broker.webhooks.ssrf import Guard


def test_a_cookie_an_agent_sets_never_goes_out_with_a_later_call() -> None:
    """One session makes every tenant's calls: nothing of one answer may ride on the next."""
    seen: list[str | None] = []

    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")[1:]
                pairs = (line.partition(":") for line in lines)
                headers = {k.strip().lower(): v.strip() for k, _, v in pairs}
                await reader.readexactly(int(headers.get("content-length", "0")))
                seen.append(headers.get("cookie"))
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Set-Cookie: tenant=first; Path=/\r\nContent-Length: 2\r\n\r\n{}"
                )
                await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(agent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, guarded_session(Guard(allow=["127.0.0.0/8"])) as session:
            for _ in range(2):
                async with session.post(f"http://localhost:{port}/run", data=b"{}") as answer:
                    assert answer.status == 200
                    assert answer.headers["Set-Cookie"].startswith("tenant=first")
            server.close()

    asyncio.run(scenario())
    assert seen == [None, None]
