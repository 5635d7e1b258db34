"""The bridge's calls of A2A agents that misbehave, or that many tasks call at once: every
tenant's calls share one event loop, so what one agent sends, or leaves unanswered, must cost
that loop a bounded amount. The agents are loopback servers speaking JSON-RPC; the calls are
the bridge's own handlers (``workers.bridge.registry``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from broker.errors import AgentFailure, Retryable
from broker.observability.logs import bound, capture_context
from broker.remote.connections import MAX_ANSWER_ELEMENTS, AnswerTooLarge, JsonElements
from tests.unit.test_bridge_calls import GUARD, card_with, remote
from tests.unit.test_remote_connections import read_through_the_transport
from workers.bridge import a2a_agent
from workers.bridge.registry import RemoteRegistry
from workers.sdk.agent import CapabilitySpec
from workers.sdk.context import Context

# (status, content type, body), or None: the request is never answered.
Reply = tuple[int, str, bytes] | tuple[int, str, bytes, dict[str, str]] | None  # headers
Answer = Callable[[str, dict[str, Any]], Reply]  # (JSON-RPC method, request) -> reply


@dataclass
class Seen:
    """What a loopback agent saw: each request (``card`` or the JSON-RPC method), and the
    methods of the requests it never answered whose connection the bridge closed."""

    requests: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)

    def count(self, what: str) -> int:
        return self.requests.count(what)


@contextlib.asynccontextmanager
async def a2a_agent_at(
    answer: Answer, seen: Seen, *, interface: str | None = None
) -> AsyncIterator[str]:
    """A loopback A2A agent: its card (not streaming) at ``/card`` names ``/rpc``, or
    ``interface``, where ``answer`` gives each JSON-RPC request's reply. Its card's URL."""
    origin = ""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            pairs = (line.partition(":") for line in head[1:])
            headers = {k.strip().lower(): v.strip() for k, _, v in pairs}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if head[0].split()[1] == "/card":
                seen.requests.append("card")
                card = card_with(
                    {"url": interface or f"{origin}/rpc", "protocolBinding": "JSONRPC"}
                )
                reply: Reply = (200, "application/json", json.dumps(card).encode())
            else:
                request = json.loads(body)
                seen.requests.append(request["method"])
                reply = answer(request["method"], request)
            if reply is None:
                await reader.read()  # until the bridge closes the connection
                seen.closed.append(request["method"])
                return
            status, kind, content, *more = reply
            extra = "".join(f"\r\n{name}: {value}" for name, value in (more or [{}])[0].items())
            writer.write(
                f"HTTP/1.1 {status} X\r\nContent-Type: {kind}\r\nContent-Length: {len(content)}"
                f"{extra}\r\nConnection: close\r\n\r\n".encode()
                + content
            )
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        origin = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        yield f"{origin}/card"
        server.close()


def rpc(request: dict[str, Any], result: dict[str, Any]) -> Reply:
    answered = {"jsonrpc": "2.0", "id": request["id"], "result": result}
    return 200, "application/json", json.dumps(answered).encode()


def a_message(request: dict[str, Any]) -> Reply:
    reply = {"messageId": "m1", "role": "ROLE_AGENT", "parts": [{"text": "done"}]}
    return rpc(request, {"message": reply})


def working(request: dict[str, Any]) -> Reply:
    task = {"id": "t1", "contextId": "c1", "status": {"state": "TASK_STATE_WORKING"}}
    return rpc(request, task if request["method"] == "GetTask" else {"task": task})


def ctx() -> Context:
    return Context(task_id=uuid.uuid4(), capability="travel.echo", trace_id="t" * 32, attempt=1)


async def calls_at_once(spec: CapabilitySpec, count: int) -> list[Any]:
    """The outcomes of ``count`` calls of the agent started together: results or failures."""
    calls = [spec.handler(ctx(), {"text": "hi"}) for _ in range(count)]
    return await asyncio.gather(*calls, return_exceptions=True)


async def until(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    """Until ``check`` holds, the loop running meanwhile; the timeout only bounds a hang."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


def in_a_bridge(scenario: Callable[[RemoteRegistry], Awaitable[Any]]) -> Any:
    """``scenario`` with a bridge's registry of its own, its session closed at the end."""

    async def run() -> Any:
        registry = RemoteRegistry(GUARD)
        try:
            return await scenario(registry)
        finally:
            await registry.sessions.get().close()

    return asyncio.run(run())


def test_calls_at_once_read_the_card_once_and_once_again_after_they_failed() -> None:
    """Each of N first calls read and parsed the card (N requests to the agent); then each
    failure forgot it, and each next call read it again."""
    seen = Seen()
    failing = True

    def answer(method: str, request: dict[str, Any]) -> Reply:
        return (503, "text/plain", b"busy") if failing else a_message(request)

    async def scenario(registry: RemoteRegistry) -> tuple[list[Any], list[Any]]:
        nonlocal failing
        async with a2a_agent_at(answer, seen) as card_url:
            (spec,) = registry.serve(remote("a2a", card_url))
            first = await calls_at_once(spec, 20)
            failing = False
            return first, await calls_at_once(spec, 20)

    first, then = in_a_bridge(scenario)
    assert [type(f) for f in first] == [Retryable] * 20
    assert {f.code for f in first} == {"agent_http_503"}
    assert [r["text"] for r in then] == ["done"] * 20
    assert seen.count("card") == 2


@pytest.mark.parametrize("status", [429, 503])
def test_a_busy_agents_retry_after_is_the_wait_before_the_next_attempt(status: int) -> None:
    """As an ``http`` agent's is: it was dropped, and the next attempt came after the usual
    back-off (a fraction of a second) whatever the agent asked for."""

    def answer(method: str, request: dict[str, Any]) -> Reply:
        return (status, "text/plain", b"busy", {"Retry-After": "7"})

    async def scenario(registry: RemoteRegistry) -> list[Any]:
        async with a2a_agent_at(answer, Seen()) as card_url:
            (spec,) = registry.serve(remote("a2a", card_url))
            return await calls_at_once(spec, 1)

    [failure] = in_a_bridge(scenario)
    assert isinstance(failure, Retryable)
    assert (failure.code, failure.delay_s) == (f"agent_http_{status}", 7.0)


def test_a_cancel_task_the_agent_never_answers_is_given_up_with_its_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancel sends the agent CancelTask; the wait for it gave up after CANCEL_TIMEOUT_S,
    but the request went on (the SDK's client has no timeout), holding its connection."""
    monkeypatch.setattr(a2a_agent, "CANCEL_TIMEOUT_S", 0.5)
    seen = Seen()

    def answer(method: str, request: dict[str, Any]) -> Reply:
        return None if method == "CancelTask" else working(request)

    async def scenario(registry: RemoteRegistry) -> None:
        async with a2a_agent_at(answer, seen) as card_url:
            (spec,) = registry.serve(remote("a2a", card_url))
            calls = [asyncio.ensure_future(spec.handler(ctx(), {})) for _ in range(3)]
            await until(lambda: seen.count("GetTask") >= 3, "the calls to poll their tasks")
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            await until(lambda: len(seen.closed) == 3, "the CancelTask requests to be closed")

    in_a_bridge(scenario)
    assert seen.count("CancelTask") == 3
    assert seen.closed == ["CancelTask"] * 3


def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("payload", [{"n": 10**400}, {"deep": nested(150)}])
def test_a_payload_an_a2a_message_cannot_carry_fails_payload_invalid_before_any_request(
    payload: Any,
) -> None:
    """An integer beyond a double (the API takes 4,300 digits) raised OverflowError, nesting
    past protobuf's 100 levels ParseError: the runner logged a traceback for each, and the
    task failed ``agent_error``, after the card was read."""
    seen = Seen()

    async def scenario(registry: RemoteRegistry) -> Any:
        async with a2a_agent_at(lambda m, r: a_message(r), seen) as card_url:
            (spec,) = registry.serve(remote("a2a", card_url))
            try:
                return await spec.handler(ctx(), payload)
            except Exception as exc:  # the outcome under test
                return exc

    outcome = in_a_bridge(scenario)
    assert type(outcome) is AgentFailure, repr(outcome)
    assert outcome.code == "payload_invalid"
    assert seen.requests == []


@pytest.mark.parametrize("fails", ["card", "interface"])
def test_a_failure_of_the_bridges_own_tells_the_tenant_no_address(
    fails: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A card that could not be read, or an interface that could not be reached: the
    task's error named the address (``Cannot connect to host 127.0.0.1:<port>``)."""
    closed_port = _closed_port()
    seen = Seen()

    async def scenario(registry: RemoteRegistry) -> Any:
        interface = f"http://127.0.0.1:{closed_port}/rpc"
        async with a2a_agent_at(lambda m, r: a_message(r), seen, interface=interface) as url:
            card_url = f"http://127.0.0.1:{closed_port}/card" if fails == "card" else url
            (spec,) = registry.serve(remote("a2a", card_url))
            (outcome,) = await calls_at_once(spec, 1)
            return outcome

    outcome = in_a_bridge(scenario)
    assert isinstance(outcome, Retryable), repr(outcome)
    assert outcome.code == "agent_unreachable"
    assert str(closed_port) not in outcome.message and "127.0.0.1" not in outcome.message
    assert f"127.0.0.1:{closed_port}" in caplog.text  # the bridge's log has it


def _closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def elements_of(count: int) -> bytes:
    """A JSON array of ``count`` zeros: ``count`` elements (its ``[`` and its commas)."""
    return json.dumps([0] * count).encode()


def test_an_answer_or_event_past_the_element_cap_is_refused_however_few_its_bytes() -> None:
    """The a2a-sdk parses each answer and event into protobuf in Python, on the loop every
    tenant's calls share: 16 MiB of ``[0,0,...]`` took it 12 s. Strings count once, whatever
    they hold; an event stream's events count each on its own."""
    past = MAX_ANSWER_ELEMENTS + 1
    refused = [
        ("application/json", elements_of(past)),
        ("text/event-stream", b"data: " + elements_of(past) + b"\n\n"),
        # A line that is not JSON cannot hide the next one's structure in a string it opens.
        ("text/event-stream", b'event: "\ndata: ' + elements_of(past) + b"\n\n"),
    ]
    for kind, body in refused:
        with pytest.raises(AnswerTooLarge, match=f"more than {MAX_ANSWER_ELEMENTS} elements"):
            read_through_the_transport(kind, body)
    commas = json.dumps({"text": "a, b: [c] {d}" * past}).encode()
    event = b"data: " + elements_of(MAX_ANSWER_ELEMENTS // 2) + b"\n\n"
    read = [
        ("application/json", elements_of(MAX_ANSWER_ELEMENTS)),
        ("application/json", commas),
        ("text/event-stream", event * 3),
    ]
    for kind, body in read:
        assert read_through_the_transport(kind, body) == len(body)


def test_elements_are_counted_alike_however_the_text_is_cut() -> None:
    """Strings and what they hold (escaped quotes, backslashes, a line end that ends one),
    cut anywhere into pieces as they arrive."""
    text = b'{"a": [1, "x,\\"y:[", {"b\\\\": "\\u00e9,"}], "c": "\\\\", "d": "\xc3\xa9,"}'
    broken = b'["a\\\nb,c"]'  # the line end ends the string: ``b,c"]`` is not in it
    rng = random.Random(7)
    for whole, expected in [(text, 19), (broken, 4)]:
        for _ in range(200):
            cuts = sorted(rng.sample(range(len(whole) + 1), rng.randint(0, 4)))
            counted = JsonElements()
            for start, end in zip([0, *cuts], [*cuts, len(whole)], strict=True):
                counted.add(whole, start, end)
            assert counted.count == expected, cuts


def test_the_cards_read_shared_by_every_caller_logs_in_no_callers_context(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The read that every waiting call shares ran in the first caller's context: its log
    lines (and spans) carried that tenant's trace id, task and tenant for all of them."""
    capture_context()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        card_url = f"http://127.0.0.1:{listener.getsockname()[1]}/card"  # closed after

    async def scenario(registry: RemoteRegistry) -> list[Any]:
        (spec,) = registry.serve(remote("a2a", card_url))

        async def call_of(tenant: str) -> Any:
            with bound(tenant=tenant, trace_id=tenant * 16):
                return await spec.handler(ctx(), {"text": "hi"})

        return await asyncio.gather(call_of("aa"), call_of("bb"), return_exceptions=True)

    with caplog.at_level("WARNING", logger="reach.bridge"):
        failures = in_a_bridge(scenario)
    assert {f.code for f in failures} == {"agent_unreachable"}
    (record,) = [r for r in caplog.records if r.getMessage().startswith("A2A agent card")]
    assert getattr(record, "reach_context", None) == {}
