"""A stand-in for a model API, for trying async agents, the tests and the benchmark:
``python -m reach.fakemodel --port 8700 --delay 0.5``.

It answers the OpenAI-compatible ``POST /v1/chat/completions`` after ``--delay`` seconds:
a JSON completion, or with ``"stream": true`` the same text as server-sent chunks spread over
the delay, ending with ``data: [DONE]``. The reply repeats the last user message's words.
A request for the model named ``instant`` is answered without the delay: the benchmark
times the same calls with the model answering at once, to tell the broker's own work from
what half a second of quiet costs every process on the path.
It is also a remote agent of the ``http`` protocol (``POST /run``): after the same delay (or
the payload's ``delay_s``, at most 60) it answers ``{"result": {"payload": <the payload>}}``.
``GET /healthz`` answers at once; ``GET /stats`` tells the calls of each kind, how many are in
flight now and the most at once (completions and runs alike), and when the first call came and
the last answer went (``POST /stats/reset`` starts them again). Plain asyncio, HTTP/1.1 with
keep-alive, no dependencies: thousands of calls may wait at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

MAX_BODY = 1 << 20
INSTANT = "instant"  # the model answered without the delay


def reply_words(request: dict[str, Any]) -> list[str]:
    messages = request.get("messages") or [{}]
    prompt = str(messages[-1].get("content", ""))
    limit = int(request.get("max_tokens") or 16)
    return (prompt.split() or ["ok"])[:limit]


def _head(status: str, content_type: str, length: int | None) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Type: {content_type}"]
    lines.append(
        f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    )
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class FakeModel:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0
        self.reset()

    def reset(self) -> None:
        self.runs, self.completions = 0, 0
        self.in_flight, self.in_flight_max = 0, 0
        self.first_at: float | None = None
        self.last_done_at: float | None = None

    def stats(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "runs": self.runs,
            "completions": self.completions,
            "in_flight": self.in_flight,
            "in_flight_max": self.in_flight_max,
            "first_at": self.first_at,
            "last_done_at": self.last_done_at,
        }

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, path, _ = request_line.split(" ", 2)
        headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (h.partition(":") for h in header_lines if h)
        }
        length = min(int(headers.get("content-length", "0")), MAX_BODY)
        body = await reader.readexactly(length) if length else b""
        if method == "GET" and path == "/healthz":
            writer.write(_head("200 OK", "text/plain", 2) + b"ok")
        elif method == "POST" and path == "/v1/chat/completions":
            self.calls += 1
            self.completions += 1
            # Held from the request read to the answer written: the benchmark's RSS target
            # is for a number of calls in flight, and this is where it is seen.
            with self._held():
                await self._complete(json.loads(body or b"{}"), writer)
        elif method == "POST" and path == "/run":
            await self._run(json.loads(body or b"{}"), writer)
        elif method == "GET" and path == "/stats":
            answer = json.dumps(self.stats()).encode()
            writer.write(_head("200 OK", "application/json", len(answer)) + answer)
        elif method == "POST" and path == "/stats/reset":
            self.reset()
            writer.write(_head("200 OK", "text/plain", 2) + b"ok")
        else:
            writer.write(_head("404 Not Found", "text/plain", 9) + b"not found")
        await writer.drain()
        return headers.get("connection", "").lower() != "close"

    async def _run(self, call: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        """One call of the ``http`` remote-agent protocol, answered as JSON after the delay."""
        self.runs += 1
        payload = call.get("payload")
        asked = payload.get("delay_s") if isinstance(payload, dict) else None
        delay_s = min(float(asked), 60.0) if isinstance(asked, int | float) else self.delay_s
        with self._held():
            await asyncio.sleep(max(0.0, delay_s))
        answer = json.dumps({"result": {"payload": call.get("payload")}}).encode()
        writer.write(_head("200 OK", "application/json", len(answer)) + answer)
        self.last_done_at = time.time()

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """One call in flight while the block runs."""
        self.in_flight += 1
        self.in_flight_max = max(self.in_flight_max, self.in_flight)
        if self.first_at is None:
            self.first_at = time.time()
        try:
            yield
        finally:
            self.in_flight -= 1

    async def _complete(self, request: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        words = reply_words(request)
        delay_s = 0.0 if request.get("model") == INSTANT else self.delay_s
        if not request.get("stream"):
            if delay_s:
                await asyncio.sleep(delay_s)
            message = {"role": "assistant", "content": " ".join(words)}
            answer = json.dumps({"object": "chat.completion", "choices": [{"message": message}]})
            writer.write(_head("200 OK", "application/json", len(answer)) + answer.encode())
            return
        writer.write(_head("200 OK", "text/event-stream", None))
        for i, word in enumerate(words):
            if delay_s:
                await asyncio.sleep(delay_s / len(words))
            delta = {"content": word if i == 0 else f" {word}"}
            event = {"object": "chat.completion.chunk", "choices": [{"delta": delta}]}
            writer.write(_chunk(f"data: {json.dumps(event)}\n\n".encode()))
            await writer.drain()
        writer.write(_chunk(b"data: [DONE]\n\n") + _chunk(b""))


async def serve(host: str, port: int, delay_s: float) -> None:
    model = FakeModel(delay_s)
    server = await asyncio.start_server(model.handle, host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m reach.fakemodel", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--delay", type=float, default=0.5, help="seconds before each answer")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port, args.delay))


if __name__ == "__main__":
    main()
