"""An HTTP agent's event stream as the bridge reads it (``workers.bridge.http_agent``): lines
ended by CRLF, LF or CR; a run of lines that carry nothing bounded; and the bridge's event loop
left to its other calls while a long chunk's lines are read."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from broker.errors import AgentFailure
from tests.unit.loop_turns import counted
from workers.bridge.http_agent import LINES_PER_TURN, MAX_EMPTY_LINES, _events


class Content:
    """What the bridge reads of a response: its chunks, then the end."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)

    async def readany(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


class Answer:
    def __init__(self, *chunks: bytes) -> None:
        self.content = Content(*chunks)


async def events_of(*chunks: bytes) -> list[tuple[str, Any]]:
    return [event async for event in _events(Answer(*chunks))]  # type: ignore[arg-type]


def test_lines_end_with_crlf_lf_or_a_lone_cr() -> None:
    body = b"event: output\r\ndata: 1\r\n\r\nevent: output\rdata: 2\r\revent: result\ndata: 3\n\n"
    assert asyncio.run(events_of(body)) == [("output", 1), ("output", 2), ("result", 3)]
    # split anywhere, a CRLF across two chunks included
    for cut in range(1, len(body)):
        assert asyncio.run(events_of(body[:cut], body[cut:]))[-1] == ("result", 3)


def test_a_stream_of_line_ends_fails_at_its_empty_lines_not_at_its_end() -> None:
    """4 MiB of line ends (4 KiB gzipped) held the bridge's loop for 16 s, every tenant's
    calls with it; it ended only as the stream did, with no result."""
    with pytest.raises(AgentFailure) as refused:
        asyncio.run(events_of(b"\n" * (4 << 20)))
    assert refused.value.code == "agent_protocol"
    assert f"more than {MAX_EMPTY_LINES} empty lines" in refused.value.message


def test_comments_and_blank_lines_between_events_are_fine_below_the_bound() -> None:
    quiet = b": keep-alive\n\n" * (MAX_EMPTY_LINES // 2 - 1)
    body = quiet + b"event: output\ndata: 1\n\n" + quiet + b"event: result\ndata: 2\n\n"
    assert asyncio.run(events_of(body)) == [("output", 1), ("result", 2)]


def test_the_loop_runs_its_other_calls_while_a_long_chunks_lines_are_read() -> None:
    """One chunk of 200,000 lines was read without the loop running anything else."""
    body = b"event: output\ndata: 1\n\n" * 100_000

    async def read_beside_a_ticker() -> tuple[int, int]:
        async with counted() as turns:
            read = await events_of(body)
        return len(read), turns.count

    read, ticks = asyncio.run(read_beside_a_ticker())
    assert read == 100_000
    assert ticks >= 300_000 // LINES_PER_TURN - 2
