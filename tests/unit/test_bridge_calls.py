"""The bridge's own handlers (``workers.bridge.registry``) calling loopback agents at
127.0.0.1, the one address the guard allows. Where the calls go: only to addresses agents may
reach, whatever URL made them (an A2A card's interface, an IP address written in a
registration); a canary at 127.0.0.2 counts the connections that should never come. And what
an answer the a2a-sdk cannot read comes to."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from broker.errors import AgentFailure, Retryable
from broker.registry.model import Card
from broker.remote.registration import RemoteAgent
from broker.webhooks.ssrf import Guard
from workers.bridge.registry import RemoteRegistry
from workers.sdk.context import Context

GUARD = Guard(allow=["127.0.0.1/32"])  # 127.0.0.2 is loopback: refused as anything local
Answer = Callable[[str, bytes], tuple[str, bytes]]  # (path, body) -> (content type, body)


@contextlib.asynccontextmanager
async def listening(host: str, answer: Answer, seen: list[str]) -> AsyncIterator[str]:
    """A loopback server at ``host`` answering each request with ``answer`` and noting its
    path in ``seen`` (a connection without a request as ``"connected"``); its origin."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append("connected")
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            pairs = (line.partition(":") for line in head[1:])
            headers = {k.strip().lower(): v.strip() for k, _, v in pairs}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            seen[-1] = path = head[0].split()[1]
            kind, content = answer(path, body)
            writer.write(
                f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {len(content)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + content
            )
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, host, 0)
    async with server:
        yield f"http://{host}:{server.sockets[0].getsockname()[1]}"
        server.close()


def nothing(path: str, body: bytes) -> tuple[str, bytes]:
    return "application/json", b"{}"


def a2a_agent(card: dict[str, Any]) -> Answer:
    """An A2A agent with ``card`` at ``/card``, answering JSON-RPC's SendMessage at ``/rpc``
    with a message."""

    def answer(path: str, body: bytes) -> tuple[str, bytes]:
        if path == "/card":
            return "application/json", json.dumps(card).encode()
        reply = {"messageId": "m1", "role": "ROLE_AGENT", "parts": [{"text": "from /rpc"}]}
        answered = {"jsonrpc": "2.0", "id": json.loads(body)["id"], "result": {"message": reply}}
        return "application/json", json.dumps(answered).encode()

    return answer


def card_with(*interfaces: dict[str, str]) -> dict[str, Any]:
    return {
        "name": "Travel",
        "description": "Books trips.",
        "version": "1",
        "supportedInterfaces": list(interfaces),
        "capabilities": {"streaming": False},
        "skills": [{"id": "echo", "name": "Echo", "description": ""}],
    }


def remote(protocol: str, url: str) -> RemoteAgent:
    card = Card.declare("travel.echo", agent_id="travel", version="1.0.0")
    return RemoteAgent(
        agent_id="travel",
        version="1.0.0",
        protocol=protocol,
        url=url,
        capability_prefix="travel" if protocol == "a2a" else None,
        cards=(card,),
        secret="whsec_" + "A" * 32,
        skills={"travel.echo": "echo"},
    )


def called_by_the_bridge(protocol: str, url: str) -> Any:
    """What the bridge's handler for the agent at ``url`` comes to: its result, or the
    failure it raised."""

    async def scenario() -> Any:
        registry = RemoteRegistry(GUARD)
        (spec,) = registry.serve(remote(protocol, url))
        ctx = Context(task_id=uuid.uuid4(), capability="travel.echo", trace_id="t" * 32, attempt=1)
        try:
            return await spec.handler(ctx, {"text": "hi"})
        except Exception as exc:  # the outcome under test
            return exc
        finally:
            await registry.sessions.get().close()

    return asyncio.run(scenario())


def with_agent_and_canary(
    card: Callable[[str, str], dict[str, Any]],
) -> tuple[Any, list[str], list[str]]:
    """Call an A2A agent whose card is ``card(agent's origin, canary's origin)``: the
    outcome, the paths the agent was asked for, and what reached the canary."""
    at_agent: list[str] = []
    at_canary: list[str] = []

    async def scenario() -> Any:
        served: dict[str, Any] = {}
        async with (
            listening("127.0.0.2", nothing, at_canary) as canary,
            listening("127.0.0.1", a2a_agent(served), at_agent) as origin,
        ):
            served.update(card(origin, canary))
            return await asyncio.to_thread(called_by_the_bridge, "a2a", f"{origin}/card")

    return asyncio.run(scenario()), at_agent, at_canary


def test_the_bridge_calls_the_interface_it_checked_not_the_one_the_sdk_prefers() -> None:
    """The a2a-sdk, given the whole card, calls an interface of protocol version 1.0 before
    the card's first, the one registration checked: here an address agents may not reach."""
    outcome, at_agent, at_canary = with_agent_and_canary(
        lambda agent, canary: card_with(
            {"url": f"{agent}/rpc", "protocolBinding": "JSONRPC"},
            {"url": f"{canary}/rpc", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"},
        )
    )
    assert at_canary == []
    assert at_agent == ["/card", "/rpc"]
    assert outcome["text"] == "from /rpc"


def test_a_card_whose_interface_may_not_be_reached_fails_the_call_before_any_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As a card changed after registration would: it is read again after a failure. The
    tenant is not told the address; the bridge's log is."""
    outcome, at_agent, at_canary = with_agent_and_canary(
        lambda agent, canary: card_with(
            {"url": f"{canary}/rpc", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
        )
    )
    assert at_canary == []
    assert at_agent == ["/card"]
    assert isinstance(outcome, Retryable)
    assert outcome.code == "endpoint_not_allowed"
    assert "127.0.0.2" not in outcome.message
    assert "127.0.0.2 is an address agents may not reach" in caplog.text


@pytest.mark.parametrize("protocol", ["http", "a2a"])
def test_an_ip_address_agents_may_not_reach_is_refused_like_a_name_resolving_there(
    protocol: str, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp asks no resolver for an address written in the URL: the guard on lookups
    never saw it. An ``http`` agent's URL, an ``a2a`` agent's card URL. The tenant is not
    told the address; the bridge's log is."""
    at_canary: list[str] = []

    async def scenario() -> Any:
        async with listening("127.0.0.2", nothing, at_canary) as canary:
            return await asyncio.to_thread(called_by_the_bridge, protocol, f"{canary}/run")

    outcome = asyncio.run(scenario())
    assert at_canary == []
    assert isinstance(outcome, Retryable)
    assert outcome.code == "agent_unreachable"
    assert "127.0.0.2" not in outcome.message
    assert "127.0.0.2 is an address agents may not reach" in caplog.text


def test_an_a2a_answer_nested_too_deep_for_json_fails_agent_protocol() -> None:
    """The a2a-sdk reads an answer with ``json``, which raises RecursionError past about 1,000
    levels: it went through, and the task failed ``agent_error`` with a logged traceback."""
    served: dict[str, Any] = {}

    def answer(path: str, body: bytes) -> tuple[str, bytes]:
        if path == "/card":
            return "application/json", json.dumps(served).encode()
        return "application/json", b"[" * 10_000

    async def scenario() -> Any:
        async with listening("127.0.0.1", answer, []) as origin:
            served.update(card_with({"url": f"{origin}/rpc", "protocolBinding": "JSONRPC"}))
            return await asyncio.to_thread(called_by_the_bridge, "a2a", f"{origin}/card")

    outcome = asyncio.run(scenario())
    assert isinstance(outcome, AgentFailure), outcome
    assert outcome.code == "agent_protocol"
