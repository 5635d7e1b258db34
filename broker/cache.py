"""Values read from Postgres or Redis, trusted for a while: routing, the door and the bounds
on a submit must not query per request."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger("reach.api")
K = TypeVar("K", bound=Hashable)


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
            # Shared by every request that waits for it: in a context of its own, so that
            # what it logs carries no one request's trace id.
            alone = contextvars.Context()
            loop = asyncio.get_running_loop()
            running = loop.create_task(self._compute(key, compute), context=alone)
            self._computing[key] = running
            running.add_done_callback(lambda done: self._computed(key, done), context=alone)
        return await asyncio.shield(running)

    async def _compute(self, key: Any, compute: Callable[[], Awaitable[Any]]) -> Any:
        return self.put(key, await compute())

    def _computed(self, key: Any, done: asyncio.Future[Any]) -> None:
        if self._computing.get(key) is done:
            del self._computing[key]
        if not done.cancelled():
            done.exception()  # retrieved: every reader may have gone


@dataclass
class RecentFigures(Generic[K]):
    """A number per key (a queue's depth, the bytes a tenant's tasks hold), read from a store
    at most once per ``refresh_s``, so a burst of requests costs one read, with one read per
    key out at a time. A figure older than that but not ``stale_s`` answers once more while
    the next is read beside the request, so a request does not wait on the store for it (0:
    read first); so does any figure while a read of its key started by an earlier request is
    out. What this process admits meanwhile (``add``) counts in the figure until the next
    read. Past ``max_tracked`` keys, those older than ``refresh_s`` with no read out are
    forgotten: no stream of names grows the process's memory.

    The owner gives ``refresh_s`` and ``stale_s`` with each request: they are its policy."""

    read: Callable[[K], Awaitable[int]]
    what: str = "a figure"
    max_tracked: int = 4096
    _known: dict[K, tuple[float, int]] = field(default_factory=dict)  # when read, the figure
    _reads: dict[K, asyncio.Future[int]] = field(default_factory=dict)

    async def get(self, key: K, *, refresh_s: float, stale_s: float) -> int:
        known = self._known.get(key)
        age = time.monotonic() - known[0] if known is not None else math.inf
        if known is not None and age <= refresh_s:
            return known[1]
        read = self._reads.get(key)
        out = read is not None
        if read is None:
            if len(self._known.keys() | self._reads.keys()) >= self.max_tracked:
                self._forget_older_than(refresh_s)
            alone = contextvars.Context()  # shared: its warning is no one request's
            read = asyncio.get_running_loop().create_task(self._read(key), context=alone)
            self._reads[key] = read
            read.add_done_callback(functools.partial(self._read_done, key), context=alone)
        if known is not None and (out or age <= stale_s):
            return known[1]  # the read goes on beside this request
        return await asyncio.shield(read)

    def add(self, key: K, amount: int) -> None:
        """Count what this process admitted (or gave back) in the figure until the next read."""
        known = self._known.get(key)
        if known is not None:
            self._known[key] = (known[0], known[1] + amount)

    def forget(self, key: K) -> None:
        """Drop the figure: the next request reads it first."""
        self._known.pop(key, None)

    async def _read(self, key: K) -> int:
        figure = await self.read(key)
        self._known[key] = (time.monotonic(), figure)
        return figure

    def _read_done(self, key: K, done: asyncio.Future[int]) -> None:
        if self._reads.get(key) is done:
            del self._reads[key]
        if not done.cancelled() and done.exception() is not None:
            # The store away: the next request past ``stale_s`` reads it, and fails.
            log.warning("reading %s failed: %r", self.what, done.exception())

    def _forget_older_than(self, age_s: float) -> None:
        cutoff = time.monotonic() - age_s
        for key, (at, _) in list(self._known.items()):
            if at <= cutoff and key not in self._reads:
                del self._known[key]

    async def close(self) -> None:
        """Wait for the reads made beside requests (before their clients close)."""
        await asyncio.gather(*self._reads.values(), return_exceptions=True)

    @property
    def tracked(self) -> int:
        """How many keys this holds a figure or a read for."""
        return len(self._known.keys() | self._reads.keys())
