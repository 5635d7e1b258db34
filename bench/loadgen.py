"""A lean HTTP/1.1 client for every Agent-Reach figure: submits, round trips, streams.

httpx costs the client 3 ms of CPU per request with 8 connections and 8 ms with 64 on a
two-core machine (against a FastAPI endpoint that itself needs 0.35 ms), so it would take
the CPU the API needs and measure itself. This client writes a prepared request on a
keep-alive connection and parses only the status line, the headers and the body (0.2 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from bench.stats import latency_ms, rate

HOST = "127.0.0.1"
REQUEST_TIMEOUT_S = 30.0  # a request slower than this counts as a timeout: an error
OPEN_AT_ONCE = 100  # connections or streams being opened concurrently


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def post(port: int, path: str, token: str, document: dict[str, Any]) -> bytes:
    """A keep-alive ``POST`` with a JSON body, ready to be written as is."""
    body = json.dumps(document).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    headers = {}
    for line in head[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def read_response(reader: asyncio.StreamReader) -> Response:
    status, headers = await read_head(reader)
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body = await _read_chunked(reader)
    else:
        body = await reader.read()
    return Response(status, headers, body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        body += await reader.readexactly(size)
        await reader.readexactly(2)
    await reader.readuntil(b"\r\n")  # the empty trailer
    return bytes(body)


class Connection:
    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> Connection:
        await self.close()
        self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
        return self

    async def request(self, raw: bytes) -> Response:
        if self.writer is None or self.reader is None:
            await self.open()
        assert self.writer is not None and self.reader is not None
        self.writer.write(raw)
        response = await read_response(self.reader)
        if response.headers.get("connection", "").lower() == "close":
            await self.close()
        return response

    async def stream(self, raw: bytes) -> AsyncIterator[tuple[float, dict[str, Any]]]:
        """Send ``raw`` and yield each SSE frame of the chunked answer as it completes, with
        its arrival time (``time.time()``); comments (pings) are skipped."""
        if self.writer is None:
            await self.open()
        assert self.writer is not None and self.reader is not None
        self.writer.write(raw)
        status, headers = await read_head(self.reader)
        if status != 200 or headers.get("transfer-encoding", "").lower() != "chunked":
            raise ConnectionError(f"not an event stream: {status} {headers}")
        buffer = b""
        while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
            buffer += await self.reader.readexactly(size)
            await self.reader.readexactly(2)
            while b"\n\n" in buffer:
                block, buffer = buffer.split(b"\n\n", 1)
                frame = parse_frame(block.decode())
                if frame:
                    yield time.time(), frame
        await self.close()

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
        self.reader = self.writer = None


class Caller:
    """Calls one after another on one keep-alive connection, for code that is not async: the
    round-trip figures. Each call's answer is read whole before the next is sent.

    The model and remote phases timed their round trips with ``httpx.Client`` until
    2026-12-03. On the same stack, alternating call by call, it added about 2 ms to a sync
    ``llm.complete`` call against this client or ``http.client`` (``docs/performance.md``,
    "The caller's own client"): the client's work, not the broker's."""

    def __init__(self, port: int, token: str) -> None:
        self.port, self.token = port, token
        self._loop = asyncio.new_event_loop()
        self._conn = Connection(port)

    def post(self, path: str, document: dict[str, Any]) -> Response:
        raw = post(self.port, path, self.token, document)
        run = self._loop.run_until_complete
        try:
            return run(self._conn.request(raw))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if isinstance(exc, asyncio.IncompleteReadError) and exc.partial:
                raise
            # The server closed the connection while it sat idle (uvicorn's keep-alive
            # timeout) and nothing of an answer came: send it again on a new one, as httpx does.
            run(self._conn.open())
            return run(self._conn.request(raw))

    def close(self) -> None:
        self._loop.run_until_complete(self._conn.close())
        self._loop.close()

    def __enter__(self) -> Caller:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def parse_frame(block: str) -> dict[str, Any]:
    """``{"event": ..., "id": ..., "data": <parsed JSON>}``; empty for a comment."""
    frame: dict[str, Any] = {}
    for line in block.split("\n"):
        if line and not line.startswith(":"):
            name, _, value = line.partition(": ")
            frame[name] = json.loads(value) if name == "data" else value
    return frame


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)  # the problem code of each non-2xx
    timeouts: int = 0
    connection_errors: int = 0
    latencies: list[float] = field(default_factory=list)

    def record(self, response: Response, latency_s: float) -> None:
        self.statuses[response.status] += 1
        self.latencies.append(latency_s)
        if response.status >= 300:
            try:
                self.codes[str(json.loads(response.body).get("code"))] += 1
            except ValueError:
                self.codes["<not json>"] += 1


async def open_all(count: int, opener: Callable[[], Any]) -> list[Any]:
    gate = asyncio.Semaphore(OPEN_AT_ONCE)

    async def one() -> Any:
        async with gate:
            return await opener()

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def accept_rate(
    port: int, token: str, document: dict[str, Any], *, connections: int, requests: int
) -> dict[str, Any]:
    """``requests`` POSTs over ``connections`` keep-alive connections, each sending its next
    request as soon as the last one is answered; connections are opened before the clock.
    ``started_at``: this process's ``perf_counter`` as the first request went, for a clock
    that runs on past the POSTs (``sent_from``)."""
    raw = post(port, "/tasks", token, document)
    pool = await open_all(connections, lambda: Connection(port).open())
    tally = Tally()
    remaining = requests

    async def drive(conn: Connection) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            sent = time.perf_counter()
            try:
                response = await asyncio.wait_for(conn.request(raw), REQUEST_TIMEOUT_S)
            except TimeoutError:
                tally.timeouts += 1
                await conn.close()
                continue
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
                tally.connection_errors += 1
                await conn.close()
                continue
            tally.record(response, time.perf_counter() - sent)

    started = time.perf_counter()
    await asyncio.gather(*(drive(conn) for conn in pool))
    elapsed = time.perf_counter() - started
    await asyncio.gather(*(conn.close() for conn in pool))
    accepted = tally.statuses[202]
    answered = sum(tally.statuses.values())
    back_pressure = tally.statuses[503]
    other_http = answered - accepted - back_pressure
    return {
        "connections": connections,
        "requests": requests,
        "elapsed_s": round(elapsed, 3),
        "accepted": accepted,
        "accepted_per_s": rate(accepted, elapsed),
        "answered_per_s": rate(answered, elapsed),
        "latency": latency_ms(tally.latencies) if tally.latencies else None,
        "back_pressure_503": back_pressure,
        "other_http_errors": other_http,
        "timeouts": tally.timeouts,
        "connection_errors": tally.connection_errors,
        # Back-pressure (503) is an answer; a timeout, a dropped connection or another status
        # is an error.
        "errors": other_http + tally.timeouts + tally.connection_errors,
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "codes": dict(tally.codes),
        "started_at": started,
    }


def sent_from(submitted: dict[str, Any]) -> float:
    """Seconds from ``accept_rate``'s first request to now: one clock from the first send to
    whatever the caller waited for after the POSTs, with no gap left out between them. The
    reading is taken out of ``submitted``: a ``perf_counter`` means nothing in a report."""
    return time.perf_counter() - float(submitted.pop("started_at"))
