"""A value read from Postgres, trusted for a while: routing and the door must not query per
request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TimedCache:
    """Values read from Postgres, trusted for ``ttl_s``: routing must not query per request."""

    ttl_s: float
    _entries: dict[Any, tuple[float, Any]] = field(default_factory=dict)
    _computing: dict[Any, asyncio.Future[Any]] = field(default_factory=dict)

    def get(self, key: Any) -> tuple[bool, Any]:
        hit = self._entries.get(key)
        if hit is not None and hit[0] > time.monotonic():
            return True, hit[1]
        return False, None

    def forget(self, key: Any) -> None:
        """Drop ``key``: the next reader reads it again (after this process wrote it)."""
        self._entries.pop(key, None)

    def put(self, key: Any, value: Any) -> Any:
        if len(self._entries) > 10_000:
            self._entries.clear()
        self._entries[key] = (time.monotonic() + self.ttl_s, value)
        return value

    async def computed(self, key: Any, compute: Callable[[], Awaitable[Any]]) -> Any:
        """The value of ``key``, ``compute()``d when it is not fresh, once for every reader
        that asks meanwhile: at expiry, the requests arriving together wait for one query
        instead of each sending its own. A reader that goes away (its request cancelled)
        leaves the computation to the others."""
        found, value = self.get(key)
        if found:
            return value
        running = self._computing.get(key)
        if running is None:
            running = self._computing[key] = asyncio.ensure_future(self._compute(key, compute))
            running.add_done_callback(lambda done: self._computed(key, done))
        return await asyncio.shield(running)

    async def _compute(self, key: Any, compute: Callable[[], Awaitable[Any]]) -> Any:
        return self.put(key, await compute())

    def _computed(self, key: Any, done: asyncio.Future[Any]) -> None:
        if self._computing.get(key) is done:
            del self._computing[key]
        if not done.cancelled():
            done.exception()  # retrieved: every reader may have gone
