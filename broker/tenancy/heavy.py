"""A tenant's costly work, one at a time per kind in this process, before it takes a pooled
database connection: reads whose cost grows with its history (lists, series), and writes that
wait on a lock of the tenant's (a session's or a webhook's creation) or of one session (its
next turn), where
every waiter held a connection blocked on that lock until one tenant held the whole pool.

A list filtered by the key's patterns (a key that sees ``invoice.*`` of a tenant that ran
mostly other capabilities) reads the tenant's tasks newest first until a page is full: every
one of them when none matches, 0.18-0.27 s for 40,000 tasks here, and more as the TTL keeps
more. A series aggregates up to a day of them. At a tenant's request rate each such read took a
Postgres backend of its own, so one tenant could take every core. With a turn per (tenant,
kind), its reads of a kind wait for the one in progress (within the tenant's share of the
waiting requests, ``REACH_MAX_REQUESTS_WAITING_PER_TENANT``): one tenant keeps at most one
backend per kind busy in each API process, and other tenants' reads never wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class OneAtATime:
    def __init__(self) -> None:
        # (tenant, kind) -> (its lock, how many requests hold or wait for it): gone when none
        self._turns: dict[tuple[str, str], tuple[asyncio.Lock, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def turn(self, tenant: str, kind: str) -> AsyncIterator[None]:
        """Held while the tenant's work of ``kind`` runs; the next one waits for it."""
        key = (tenant, kind)
        lock, users = self._turns.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._turns[key]

    @property
    def in_progress(self) -> int:
        """How many (tenant, kind) have work running or waiting."""
        return len(self._turns)
