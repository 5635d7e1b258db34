"""The bridge's health checks of remote agents: a round checks every agent at once, and no
agent's check can hold up or fail another's.

``HealthChecks.run(agents)`` gives each agent's outcome within one deadline. A check is
``GET <origin>/healthz`` for an ``http`` agent (200), the card for an ``a2a`` one (200, and a
card the bridge can call whose interface is no address agents may not reach: a name in it
is not looked up, each call's connection checks its own), and passes only if all of it
(connection, headers and the whole body, at most ``MAX_HEALTH_BYTES`` or
``a2a_card.MAX_CARD_BYTES``) comes within ``timeout_s``. A timeout on each read is not
enough: a server sending a byte every second never tripped one, and held a thread of the
check pool for as long as it liked.

The checks run as coroutines on an event loop of their own, over a guarded aiohttp session
like the calls' (``guarded_session``): each connection's addresses are checked on its own
lookup, so a name checked once cannot be pointed at another address before the connect.
An agent whose last check is still running gets no new one; that round counts as its failure.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import aiohttp
import httpx
from a2a.utils.constants import PROTOCOL_VERSION_CURRENT, VERSION_HEADER

from broker.remote import a2a_card
from broker.remote.connections import guarded_session, read_body
from broker.remote.registration import A2A, RegistrationInvalid, RemoteAgent
from broker.webhooks.ssrf import Guard

MAX_HEALTH_BYTES = 64 * 2**10  # a /healthz body: its status is what counts
# A round waits this long past the checks' own deadline, so that a check ending at its
# deadline is reported as what it was, not as one still running.
GRACE_S = 0.5
CLOSE_TIMEOUT_S = 5.0
CARD_HEADERS = {"Accept": "application/json", VERSION_HEADER: PROTOCOL_VERSION_CURRENT}

T = TypeVar("T")


class HealthChecks:
    """Checks of remote agents, each within ``timeout_s``. The lookups of their connections
    run on ``lookup_threads`` threads of their own; aiohttp makes at most one lookup of a name
    at a time, so a name server that never answers ties up one of them per name. Nothing
    else looks a name up here: a deadline ends the wait for a lookup, not its thread, so a
    lookup made at each round (as reading a card's interface made one) held one more thread
    each round until none was left for any agent."""

    def __init__(self, guard: Guard, timeout_s: float, lookup_threads: int) -> None:
        self.guard = guard
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        lookups = ThreadPoolExecutor(lookup_threads, thread_name_prefix="reach-health")
        self._loop.set_default_executor(lookups)
        self._thread = threading.Thread(target=self._serve, name="reach-health", daemon=True)
        self._thread.start()
        self._session = self._submit(_open(guard)).result()
        self._running: dict[str, Future[bool]] = {}

    def run(self, agents: Iterable[RemoteAgent]) -> dict[str, bool]:
        """Check each agent, all at once; whether each passed. Returns within ``timeout_s``
        (and ``GRACE_S``) whatever the agents do."""
        outcomes: dict[str, bool] = {}
        started: dict[str, Future[bool]] = {}
        running: dict[str, Future[bool]] = {}
        for agent in agents:
            last = self._running.get(agent.agent_id)
            if last is not None and not last.done():
                outcomes[agent.agent_id] = False
                running[agent.agent_id] = last
            else:
                started[agent.agent_id] = running[agent.agent_id] = self._submit(self.check(agent))
        self._running = running  # a removed agent's check ends by its deadline, unwatched
        wait(started.values(), timeout=self.timeout_s + GRACE_S)
        for agent_id, future in started.items():
            outcomes[agent_id] = _passed(future)
        return outcomes

    async def check(self, agent: RemoteAgent) -> bool:
        """One check of ``agent``, all of it within ``timeout_s``."""
        try:
            async with asyncio.timeout(self.timeout_s):
                if agent.protocol == A2A:
                    card = await self._read(agent.url, a2a_card.MAX_CARD_BYTES, CARD_HEADERS)
                    # the interface the bridge would call, where it may: else no call works
                    # (its form only: no lookup, see ``registration.check_endpoint``)
                    await a2a_card.checked(self.guard, a2a_card.parse(card))
                else:
                    await self._read(health_url(agent.url), MAX_HEALTH_BYTES, {})
        except (CheckFailed, RegistrationInvalid, aiohttp.ClientError, OSError):
            # OSError: TimeoutError (the deadline) is one
            return False
        return True

    async def _read(self, url: str, limit: int, headers: dict[str, str]) -> bytes:
        """The whole body of a 200 answer to ``GET url``."""
        async with self._session.get(url, headers=headers, allow_redirects=False) as answer:
            if answer.status != 200:
                raise CheckFailed(f"{url} answered {answer.status}")
            body = await read_body(answer, limit)
        if len(body) > limit:
            raise CheckFailed(f"{url} answered more than {limit} bytes")
        return body

    def close(self) -> None:
        for future in self._running.values():
            future.cancel()
        wait([self._submit(self._session.close())], timeout=CLOSE_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)

    def _serve(self) -> None:
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)


class CheckFailed(Exception):
    """The agent answered, but not 200, or more than the check reads."""


def _passed(future: Future[bool]) -> bool:
    """Whether a check ended, and passed (one that has not ended by now failed)."""
    return (
        future.done() and not future.cancelled() and future.exception() is None and future.result()
    )


async def _open(guard: Guard) -> aiohttp.ClientSession:
    return guarded_session(guard)  # on the loop that will use it


def health_url(endpoint_url: str) -> str:
    """``<origin>/healthz``: a path of its own, never the business path."""
    url = httpx.URL(endpoint_url)
    return str(url.copy_with(path="/healthz", query=None, fragment=None))
