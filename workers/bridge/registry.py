"""The capabilities a bridge serves: one spec per remote agent's card, replaced as the
registrations change. Its handlers call the agent (``http_agent.call``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp

from broker.registry.model import capability_of
from broker.remote.registration import RemoteAgent
from workers.bridge import http_agent
from workers.sdk.agent import AgentRegistry, CapabilitySpec, Handler
from workers.sdk.context import Context

CONNECT_TIMEOUT_S = 5.0


class Sessions:
    """One aiohttp session per event loop (the process has one): no limit on connections,
    the worker's concurrency is the limit. aiohttp, not httpx: see ``docs/performance.md``."""

    def __init__(self) -> None:
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def get(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
            session = self._sessions[loop] = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=True
            )
        return session


class RemoteRegistry(AgentRegistry):
    """Specs by card queue (``capability@agent@version``), and by capability for tasks sent
    to the capability's own queue."""

    def __init__(self, first_byte_timeout_s: float = 30.0) -> None:
        super().__init__()
        self.first_byte_timeout_s = first_byte_timeout_s
        self.sessions = Sessions()
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
