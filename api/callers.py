"""Who is calling: keys looked up in Postgres and kept in memory for a while, the tenant of
each key already verified, per-address and per-tenant budgets (lookups that find nothing,
requests), and the key of a long answer (a stream, a wait) looked at again while it lasts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import Scope

from broker.errors import Unauthenticated
from broker.observability import metrics
from broker.tasks.backpressure import RateLimited
from broker.tenancy import key_store
from broker.tenancy.keys import split_token


class TenantOfKey:
    """The tenant of each key id already verified here: fixed for a key's life, so it may be
    kept as long as memory allows (bounded)."""

    MAX = 100_000

    def __init__(self) -> None:
        self._tenants: dict[str, str] = {}

    def remember(self, key_id: str, tenant: str) -> None:
        if len(self._tenants) >= self.MAX:
            self._tenants.clear()
        self._tenants[key_id] = tenant

    def of_request(self, scope: Scope) -> str:
        """The tenant the request's key belongs to when known, else a name for its key."""
        for name, value in scope["headers"]:
            if name == b"authorization":
                _, _, token = value.decode("latin-1").partition(" ")
                parts = split_token(token.strip())
                if parts is None:
                    break
                return self._tenants.get(parts[0]) or f"key:{parts[0]}"
        return "anonymous"


@dataclass
class KeyCache:
    """Keys looked up in Postgres, kept for ``ttl_s`` so a busy caller costs no query per
    request; a key id that is not there is remembered as missing for as long. Revocation
    therefore takes effect within ``ttl_s``.

    Lookups that find no key are bounded per client address (``lookups``): random key ids
    sent in a loop cost at most that many queries a second, then 429 without a query. A valid
    key is refused only while its address is over that budget."""

    ttl_s: float
    lookups: Budget
    _entries: dict[str, tuple[float, dict[str, Any] | None]] = field(default_factory=dict)

    async def get(
        self, engine: AsyncEngine, key_id: str, *, client: str | None
    ) -> dict[str, Any] | None:
        """The key's row (None: no such key or revoked). A lookup is charged to ``client``'s
        budget; None for a key verified already and looked at again (``KeyWatch``): its
        address must not keep a revoked key alive by spending its budget on junk keys."""
        now = time.monotonic()
        hit = self._entries.get(key_id)
        if hit is not None and hit[0] > now:
            return hit[1]
        if client is not None:
            self.lookups.check(client)
        row = await key_store.get_key(engine, key_id)
        if row is None and client is not None:
            self.lookups.spend(client)
        if self.ttl_s > 0:
            if len(self._entries) > 10_000:  # bound memory against many distinct keys
                self._entries.clear()
            self._entries[key_id] = (now + self.ttl_s, row)
        return row


@dataclass
class KeyWatch:
    """The key of an answer that lasts (an SSE or A2A stream, a sync or MCP wait), looked at
    again while it lasts: ``check``, before each event is passed on and at each quiet spell,
    raises ``Unauthenticated`` once the key is revoked, as a new request with it would be.

    Through the cache ``authenticate`` uses, so watching costs what requests do: Postgres is
    asked about a key at most once per ``ttl_s``, however many answers watch it (with a cache
    of 0 s, by each answer at most once per ``EVERY_S``). So nothing is passed on more than
    ``ttl_s`` plus ``EVERY_S`` after the key was revoked. A lookup an outage failed raises
    the outage and counts as no check: the next ``check`` looks again."""

    # With a cache of 0 s, a stream replaying its log would otherwise query once per event.
    EVERY_S = 0.1

    cache: KeyCache
    engine: AsyncEngine
    key_id: str
    _checked_at: float = field(default_factory=time.monotonic)  # ``authenticate`` just did

    async def check(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self.EVERY_S:
            return
        row = await self.cache.get(self.engine, self.key_id, client=None)
        self._checked_at = now  # after the lookup: one an outage failed checked nothing
        if row is None:
            raise Unauthenticated("the API key is not valid")


@dataclass
class Budget:
    """A token bucket per name (a client address, a tenant), in this process: ``rate_per_s``
    with a burst of twice that. ``check`` refuses (429 ``rate_limited``, counted under
    ``reason``) when the name has none left; ``spend`` takes one; ``take`` does both. Bounded
    memory: the table is cleared when it is full."""

    rate_per_s: float
    reason: str
    refusal: str
    MAX_NAMES = 10_000
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)

    def check(self, name: str) -> None:
        tokens = self._tokens(name)[0]
        if tokens < 1:
            metrics.rejections.labels(self.reason).inc()
            wait_s = (1 - tokens) / self.rate_per_s
            raise RateLimited(self.refusal, retry_after_s=max(1, round(wait_s + 0.5)))

    def spend(self, name: str) -> None:
        tokens, now = self._tokens(name)
        if len(self._buckets) >= self.MAX_NAMES and name not in self._buckets:
            self._buckets.clear()
        self._buckets[name] = (tokens - 1, now)

    def take(self, name: str) -> None:
        self.check(name)
        self.spend(name)

    def _tokens(self, name: str) -> tuple[float, float]:
        burst, now = 2 * self.rate_per_s, time.monotonic()
        tokens, at = self._buckets.get(name, (burst, now))
        return min(burst, tokens + (now - at) * self.rate_per_s), now
