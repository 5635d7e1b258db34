"""The capabilities a bridge serves: one spec per remote agent's card, replaced as the
registrations change. Its handlers call the agent (``http_agent.call``)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from broker.registry.model import capability_of
from broker.remote.registration import RemoteAgent
from broker.webhooks.ssrf import Guard
from workers.bridge import http_agent
from workers.sdk.agent import AgentRegistry, CapabilitySpec, Handler
from workers.sdk.context import Context

CONNECT_TIMEOUT_S = 5.0


class GuardedResolver(AbstractResolver):
    """Host names resolve only to addresses agents may reach (``REACH_AGENT_NETWORKS`` and
    public ones), checked on the connection's own lookup: a name that resolved to an allowed
    address when it was registered cannot be pointed at another one later (DNS rebinding).
    Addresses written in the URL were checked at registration and are checked again by each
    health check."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self._resolver = ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._resolver.resolve(host, port, family)
        allowed = [r for r in found if self.guard.address_allowed(r["host"])]
        if not allowed:
            raise OSError(f"{host} resolves only to addresses agents may not reach")
        return allowed

    async def close(self) -> None:
        await self._resolver.close()


class Sessions:
    """One aiohttp session per event loop (the process has one): no limit on connections,
    the worker's concurrency is the limit. aiohttp, not httpx: see ``docs/performance.md``."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def get(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(
                limit=0, ttl_dns_cache=60, resolver=GuardedResolver(self.guard)
            )
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
            session = self._sessions[loop] = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=True
            )
        return session


class RemoteRegistry(AgentRegistry):
    """Specs by card queue (``capability@agent@version``), and by capability for tasks sent
    to the capability's own queue."""

    def __init__(self, guard: Guard, first_byte_timeout_s: float = 30.0) -> None:
        super().__init__()
        self.first_byte_timeout_s = first_byte_timeout_s
        self.sessions = Sessions(guard)
        self._lock = threading.Lock()
        self._agents: dict[str, tuple[RemoteAgent, list[CapabilitySpec]]] = {}

    def serve(self, agent: RemoteAgent) -> list[CapabilitySpec]:
        """Serve the agent as registered now (replacing what it was); its specs."""
        endpoint = http_agent.Endpoint(
            agent.url, (agent.secret,), first_byte_timeout_s=self.first_byte_timeout_s
        )
        specs = [CapabilitySpec(card, self._handler(endpoint)) for card in agent.cards]
        with self._lock:
            self._agents[agent.agent_id] = (agent, specs)
        return specs

    def forget(self, agent_id: str) -> None:
        with self._lock:
            self._agents.pop(agent_id, None)

    def agents(self) -> dict[str, RemoteAgent]:
        with self._lock:
            return {agent_id: agent for agent_id, (agent, _) in self._agents.items()}

    def _handler(self, endpoint: http_agent.Endpoint) -> Handler:
        sessions = self.sessions

        async def call_remote(ctx: Context, payload: Any) -> Any:
            return await http_agent.call(sessions.get(), endpoint, ctx, payload)

        return call_remote

    def for_queue(self, queue: str) -> CapabilitySpec | None:
        specs = self._specs_now()
        for spec in specs:
            if spec.card.ref().queue() == queue:
                return spec
        name = capability_of(queue)
        return next((s for s in specs if s.name == name), None)

    def get(self, name: str) -> CapabilitySpec | None:
        return next((s for s in self._specs_now() if s.name == name), None)

    def __iter__(self) -> Iterator[CapabilitySpec]:
        return iter(self._specs_now())

    def _specs_now(self) -> list[CapabilitySpec]:
        with self._lock:
            return [spec for _, specs in self._agents.values() for spec in specs]
