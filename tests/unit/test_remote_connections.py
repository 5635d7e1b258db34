"""The clients the bridge calls agents with (``broker.remote.connections``), against a
loopback HTTP server that sets a cookie on every answer. One client makes every tenant's
calls to an agent: nothing of one answer may ride on the next call."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from broker.remote.connections import (
    MAX_ANSWER_BYTES,
    MAX_EMPTY_EVENTS,
    STREAM_PIECE_BYTES,
    AiohttpTransport,
    AnswerTooLarge,
    address_refused,
    guarded_session,
    no_cookies,
)
from broker.webhooks.ssrf import Guard
from tests.unit.loop_turns import counted

GUARD = Guard(allow=["127.0.0.0/8"])


@contextlib.asynccontextmanager
async def agent_setting_cookies(seen: list[str | None]) -> AsyncIterator[str]:
    """An agent at a host name (aiohttp's jar would keep no cookie of an IP address), that
    notes each request's ``Cookie`` header in ``seen``; its URL."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield f"http://localhost:{server.sockets[0].getsockname()[1]}/run"
        server.close()


async def cookies_sent(post: Callable[[str], Awaitable[str]]) -> list[str | None]:
    """The ``Cookie`` header of two calls in a row made with ``post`` (which answers the
    ``Set-Cookie`` it got)."""
    seen: list[str | None] = []
    async with agent_setting_cookies(seen) as url:
        for _ in range(2):
            assert (await post(url)).startswith("tenant=first")
    return seen


def test_the_aiohttp_session_sends_no_cookie_an_agent_set() -> None:
    """The session of the ``http`` protocol's calls."""

    async def scenario() -> list[str | None]:
        async with guarded_session(GUARD) as session:

            async def post(url: str) -> str:
                async with session.post(url, data=b"{}") as answer:
                    return answer.headers["Set-Cookie"]

            return await cookies_sent(post)

    assert asyncio.run(scenario()) == [None, None]


def test_an_httpx_client_with_no_cookies_sends_none_an_agent_set() -> None:
    """The A2A SDK's client, over the same session (``AiohttpTransport``): httpx keeps
    cookies itself, whatever its transport."""

    async def scenario() -> list[str | None]:
        async with guarded_session(GUARD) as session:
            transport = AiohttpTransport(lambda: session)
            async with httpx.AsyncClient(transport=transport, cookies=no_cookies()) as client:

                async def post(url: str) -> str:
                    return (await client.post(url, content=b"{}")).headers["Set-Cookie"]

                return await cookies_sent(post)

    assert asyncio.run(scenario()) == [None, None]


@contextlib.asynccontextmanager
async def agent_answering(kind: str, body: bytes, lines: str = "") -> AsyncIterator[str]:
    """An agent that answers every request with ``body`` of type ``kind`` (and the header
    lines ``lines``, each ending with CRLF); its URL."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                await reader.readuntil(b"\r\n\r\n")
                head = (
                    f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\n{lines}Connection: close\r\n\r\n"
                )
                writer.write(head.encode() + body)
                await writer.drain()
        finally:  # cancelled too (a refused answer's reader gone): else a ResourceWarning
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/rpc"
        server.close()


def read_through_the_transport(
    kind: str, body: bytes, accept: str = "text/event-stream", head: str = ""
) -> int:
    """How many bytes of the agent's answer an httpx client over ``AiohttpTransport`` read,
    asking for ``accept`` (as the a2a-sdk's streaming calls ask)."""

    async def scenario() -> int:
        async with (
            guarded_session(GUARD) as session,
            agent_answering(kind, body, head) as url,
        ):
            transport = AiohttpTransport(lambda: session)
            async with httpx.AsyncClient(transport=transport) as client:
                answer = await client.post(url, content=b"{}", headers={"Accept": accept})
                return len(answer.content)

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("application/json", b'"' + b"x" * MAX_ANSWER_BYTES + b'"'),
        # One event whose data lines go on and on: the SDK keeps them all until it ends.
        ("text/event-stream", b"data: x\n" * (MAX_ANSWER_BYTES // 8 + 1) + b"\n"),
    ],
)
def test_an_answer_or_event_larger_than_the_cap_is_refused(kind: str, body: bytes) -> None:
    """The A2A SDK reads a whole answer, and a whole event, into memory: an agent's answer
    stops at ``MAX_ANSWER_BYTES``, as the ``http`` protocol's does."""
    with pytest.raises(AnswerTooLarge):
        read_through_the_transport(kind, body)


@pytest.mark.parametrize("accept", ["text/event-stream", "application/json"])
def test_an_answer_whose_encoding_cannot_be_undone_is_a_decoding_error(accept: str) -> None:
    """The agent's answer is broken, as one that is not JSON is (the A2A door makes that
    ``agent_protocol``, never retried); it was a ``ReadError``, as a connection that broke
    off is, and retried as ``agent_unreachable``."""
    kind = "text/event-stream" if accept == "text/event-stream" else "application/json"
    gzipped = "Content-Encoding: gzip\r\n"
    with pytest.raises(httpx.DecodingError):
        read_through_the_transport(kind, b"\x1f\x8bnot gzip at all", accept, gzipped)
    with pytest.raises(httpx.DecodingError):  # refused in the head: no Brotli here
        read_through_the_transport(kind, b"not br", accept, "Content-Encoding: br\r\n")
    good = gzip.compress(b"data: x\n\n")
    assert read_through_the_transport(kind, good, accept, gzipped) == len(b"data: x\n\n")


@pytest.mark.parametrize("head", ["", "Content-Encoding: gzip\r\n"], ids=["plain", "gzip"])
def test_an_answer_that_breaks_off_is_a_read_error(head: str) -> None:
    body = gzip.compress(b'{"result": 1}') if head else b'{"result": 1}'
    with pytest.raises(httpx.ReadError):
        read_through_the_transport(
            "application/json", body[:-3], "application/json", f"Content-Length: 100\r\n{head}"
        )


def test_a_stream_of_events_may_add_up_to_more_than_the_cap() -> None:
    body = b"data: x\r\n\r\n" * (MAX_ANSWER_BYTES // 11 + 1)
    assert read_through_the_transport("text/event-stream", body) == len(body)


@pytest.mark.parametrize("empty", [b"\n", b":\n\n", b"event: x\n\n"])
def test_a_stream_of_events_without_data_is_refused_at_its_bound(empty: bytes) -> None:
    """4 MiB of line ends held the bridge's loop for 2.5 s in the a2a-sdk's reader, each
    blank line an event's end and so never too large."""
    with pytest.raises(AnswerTooLarge, match=f"more than {MAX_EMPTY_EVENTS} events without"):
        read_through_the_transport("text/event-stream", empty * ((4 << 20) // len(empty)))


def test_keep_alives_between_events_are_read_below_the_bound() -> None:
    quiet = b":\n\n" * (MAX_EMPTY_EVENTS - 1)
    body = (quiet + b"data: x\n\n") * 3
    assert read_through_the_transport("text/event-stream", body) == len(body)


def test_an_event_stream_reaches_its_reader_in_pieces_with_the_loop_run_between() -> None:
    """The a2a-sdk's reader parses each piece's lines without a pause: a piece of 600 KiB
    held every other call on the loop meanwhile."""
    body = b"data: x\n\n" * 200_000

    async def scenario() -> tuple[list[int], int]:
        async with (
            guarded_session(GUARD) as session,
            agent_answering("text/event-stream", body) as url,
        ):
            transport = AiohttpTransport(lambda: session)
            async with httpx.AsyncClient(transport=transport) as client:
                headers = {"Accept": "text/event-stream"}
                async with (
                    client.stream("POST", url, content=b"{}", headers=headers) as answer,
                    counted() as turns,
                ):
                    pieces = [len(piece) async for piece in answer.aiter_raw()]
        return pieces, turns.count

    pieces, ticks = asyncio.run(scenario())
    assert sum(pieces) == len(body)
    assert max(pieces) <= STREAM_PIECE_BYTES
    assert ticks >= len(pieces) // 2


@pytest.mark.parametrize(
    ("kind", "accept"),
    [
        ("text/event-stream", "application/json"),  # a one-answer call (GetTask, CancelTask)
        ("Text/Event-Stream", "text/event-stream"),  # the SDK reads this type whole
    ],
)
def test_events_a_client_reads_whole_add_up_to_the_cap_at_most(kind: str, accept: str) -> None:
    """An agent answering a one-answer call with an endless stream of events, read whole by
    the SDK, was held to the cap event by event: it grew in memory until the deadline."""
    body = b":\n\n" * (MAX_ANSWER_BYTES // 3 + 1)
    with pytest.raises(AnswerTooLarge):
        read_through_the_transport(kind, body, accept)


@pytest.mark.parametrize(
    ("host", "refused"),
    [
        ("127.0.0.1", False),
        ("10.1.2.3", True),
        ("169.254.169.254", True),
        ("::ffff:169.254.169.254", True),  # judged by its IPv4 form too
        ("[::1]", True),
        ("fe80::1%25eth0", True),
        ("93.184.216.34", False),  # public
        ("agent.example.com", False),  # a name: its lookup is the resolver's to judge
    ],
)
def test_an_address_written_in_a_url_is_judged_as_a_resolved_one(host: str, refused: bool) -> None:
    """aiohttp asks no resolver for an IP address: the session checks it before each request
    (``tests/unit/test_bridge_calls.py`` sees no connection made)."""
    assert address_refused(Guard(allow=["127.0.0.1/32"]), host) is refused
