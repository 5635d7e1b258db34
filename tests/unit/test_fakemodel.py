"""The stand-in model (``reach.fakemodel``): the ``instant`` model skips the delay every other
request waits, so the benchmark can time the same calls with and without the model's quiet."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest

from reach.fakemodel import INSTANT, FakeModel

DELAY_S = 60.0  # far longer than the test is allowed to run: only a skipped delay answers


class Watched(FakeModel):
    """The model, telling when a completion has begun."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(delay_s)
        self.began = asyncio.Event()

    async def _complete(self, request: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        self.began.set()
        await super()._complete(request, writer)


async def complete(port: int, model: str, stream: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "one two"}], "stream": stream}
    ).encode()
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        return await reader.read()
    finally:  # cancelled too: an unclosed stream is a ResourceWarning at the loop's end
        writer.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
def test_the_instant_model_answers_while_a_waited_call_is_still_waiting(stream: bool) -> None:
    async def scenario() -> tuple[bytes, bool]:
        model = Watched(DELAY_S)
        server = await asyncio.start_server(model.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            waited = asyncio.create_task(complete(port, "default", stream))
            await model.began.wait()  # the waited call is in, and sleeping
            answer = await complete(port, INSTANT, stream)
            still_waiting = not waited.done()
            waited.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waited
            return answer, still_waiting

    answer, still_waiting = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 200 OK")
    assert b"one" in answer and b"two" in answer
    if stream:
        assert answer.rstrip().endswith(b"0") and b"data: [DONE]" in answer
    assert still_waiting
