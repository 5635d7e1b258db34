"""The capabilities a bridge serves: one spec per remote agent's card, replaced as the
registrations change. Its handlers call the agent with its protocol (``http_agent.call``,
``a2a_agent.call``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import aiohttp

from broker.registry.model import home_queue
from broker.remote.connections import AiohttpTransport, guarded_session
from broker.remote.registration import A2A, RemoteAgent
from broker.webhooks.ssrf import Guard
from workers.bridge import a2a_agent, http_agent
from workers.sdk.agent import AgentRegistry, CapabilitySpec, Handler
from workers.sdk.context import Context


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
            session = self._sessions[loop] = guarded_session(self.guard)
        return session


class RemoteRegistry(AgentRegistry):
    """Specs by card queue (``capability@agent@version``, and an instance's queue under it),
    and by capability for tasks sent to the capability's own queue. Routing uses that queue
    when one agent is live for the capability (``routing._one_card``), so it goes to the first
    agent served that counts as up (``route``), and only while none does to the first served;
    a card of every tenant's before a private one.
    Both are looked up by every run message: they are dicts, rebuilt when the registrations
    or the agents up change."""

    def __init__(
        self, guard: Guard, first_byte_timeout_s: float = 30.0, card_timeout_s: float = 5.0
    ) -> None:
        super().__init__()
        self.first_byte_timeout_s = first_byte_timeout_s
        self.card_timeout_s = card_timeout_s
        self.sessions = Sessions(guard)
        # The a2a-sdk speaks httpx: its requests go out on the same sessions.
        self.transport = AiohttpTransport(self.sessions.get)
        self._lock = threading.Lock()
        self._agents: dict[str, tuple[RemoteAgent, list[CapabilitySpec]]] = {}
        self._by_queue: dict[str, CapabilitySpec] = {}
        self._by_agent: dict[tuple[str, str], CapabilitySpec] = {}
        self._by_name: dict[str, CapabilitySpec] = {}
        self._up: frozenset[str] = frozenset()

    def serve(self, agent: RemoteAgent) -> list[CapabilitySpec]:
        """Serve the agent as registered now (replacing what it was); its specs."""
        if agent.protocol == A2A:
            remote = a2a_agent.Agent(
                agent.url,
                (agent.secret,),
                self.sessions.guard,
                first_byte_timeout_s=self.first_byte_timeout_s,
                card_timeout_s=self.card_timeout_s,
            )
            specs = [
                CapabilitySpec(card, self._a2a_handler(remote, agent.skills[card.capability]))
                for card in agent.cards
            ]
        else:
            endpoint = http_agent.Endpoint(
                agent.url, (agent.secret,), first_byte_timeout_s=self.first_byte_timeout_s
            )
            specs = [CapabilitySpec(card, self._handler(endpoint)) for card in agent.cards]
        with self._lock:
            self._agents[agent.agent_id] = (agent, specs)
            self._index()
        return specs

    def forget(self, agent_id: str) -> None:
        with self._lock:
            self._agents.pop(agent_id, None)
            self._index()

    def route(self, up: Iterable[str]) -> None:
        """The agents that count as up now (healthy, their version not revoked): a
        capability's own queue is served by one of them."""
        now_up = frozenset(up)
        with self._lock:
            if now_up != self._up:
                self._up = now_up
                self._index()

    def _index(self) -> None:
        """The look-up dicts, from ``_agents`` (under the lock); readers take them without it."""
        by_queue: dict[str, CapabilitySpec] = {}
        by_agent: dict[tuple[str, str], CapabilitySpec] = {}
        by_name: dict[str, CapabilitySpec] = {}
        for agent_id, (_, specs) in self._agents.items():
            for spec in specs:
                by_queue[spec.card.ref().queue()] = spec
                by_agent[(agent_id, spec.name)] = spec
        # Every tenant's task may wait in a capability's own queue: a card of every tenant's
        # serves it before a private one, whose claim would put another tenant's task back
        # there (to come to it again, while a public agent that was up never got it).
        for public, up in ((True, True), (True, False), (False, True), (False, False)):
            for agent_id, (_, specs) in self._agents.items():
                if (agent_id in self._up) is up:
                    for spec in specs:
                        if (spec.card.tenants is None) is public:
                            by_name.setdefault(spec.name, spec)
        self._by_queue, self._by_agent, self._by_name = by_queue, by_agent, by_name

    def agents(self) -> dict[str, RemoteAgent]:
        with self._lock:
            return {agent_id: agent for agent_id, (agent, _) in self._agents.items()}

    def _handler(self, endpoint: http_agent.Endpoint) -> Handler:
        sessions = self.sessions

        async def call_remote(ctx: Context, payload: Any) -> Any:
            return await http_agent.call(sessions.get(), endpoint, ctx, payload)

        return call_remote

    def _a2a_handler(self, remote: a2a_agent.Agent, skill: str) -> Handler:
        transport = self.transport

        async def call_a2a(ctx: Context, payload: Any) -> Any:
            return await a2a_agent.call(remote, transport, skill, ctx, payload)

        return call_a2a

    def for_queue(self, queue: str) -> CapabilitySpec | None:
        """The spec of a card's queue (or an instance's under it); of a card the agent
        serves no more, the agent's spec of that capability now (a message taken before
        a new version replaced it); of a capability's own queue, ``_by_name``'s. Never
        another agent's for a card's queue: a target pinned the task to this agent."""
        home = home_queue(queue)
        spec = self._by_queue.get(home)
        if spec is not None:
            return spec
        parts = home.split("@")
        if len(parts) == 3:
            return self._by_agent.get((parts[1], parts[0]))
        return self._by_name.get(home)

    def get(self, name: str) -> CapabilitySpec | None:
        return self._by_name.get(name)

    def __iter__(self) -> Iterator[CapabilitySpec]:
        return iter(self._specs_now())

    def _specs_now(self) -> list[CapabilitySpec]:
        with self._lock:
            return [spec for _, specs in self._agents.values() for spec in specs]
