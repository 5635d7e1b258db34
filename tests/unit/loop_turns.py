"""How often an event loop ran something else while a coroutine worked: a test of fairness
that counts turns, never times them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Turns:
    count = 0


@contextlib.asynccontextmanager
async def counted() -> AsyncIterator[Turns]:
    """The turns the loop gave a task of its own while the block ran: each is a point where
    the block let the loop run its other calls."""
    turns = Turns()

    async def tick() -> None:
        while True:
            await asyncio.sleep(0)
            turns.count += 1

    ticker = asyncio.create_task(tick())
    try:
        yield turns
    finally:
        ticker.cancel()
