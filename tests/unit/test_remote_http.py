"""The ``http`` protocol's rules that need no network (``workers.bridge.http_agent``)."""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import aiohttp
import pytest

from broker.errors import AgentFailure, Retryable
from broker.remote.connections import GuardedResolver, guarded_session
from broker.timestamps import agent_retry_after
from broker.webhooks.ssrf import Guard
from workers.bridge import http_agent
from workers.bridge.health_checks import health_url
from workers.bridge.http_agent import RETRIED_STATUSES, _outcome
from workers.sdk.context import Context


def test_a_result_answer_gives_its_result_even_when_null() -> None:
    assert _outcome({"result": {"text": "HI"}}, streamed=False) == {"text": "HI"}
    assert _outcome({"result": None}, streamed=False) is None


def test_a_retryable_error_is_retried_only_before_any_output() -> None:
    error = {"error": {"code": "busy", "message": "later", "retryable": True}}
    with pytest.raises(Retryable) as before:
        _outcome(error, streamed=False)
    assert before.value.code == "busy"
    with pytest.raises(AgentFailure) as after:
        _outcome(error, streamed=True)
    assert not isinstance(after.value, Retryable)
    assert after.value.code == "busy"


def test_an_error_without_retryable_fails_for_good() -> None:
    with pytest.raises(AgentFailure) as failed:
        _outcome({"error": {"code": "bad_input", "message": "no"}}, streamed=False)
    assert not isinstance(failed.value, Retryable)
    assert failed.value.code == "bad_input"


@pytest.mark.parametrize("code", [{"a": [1]}, 7, ["x"], True, ""])
def test_an_error_code_that_is_no_text_is_agent_error(code: object) -> None:
    """It was stored as its Python repr: ``{'a': [1]}``."""
    with pytest.raises(AgentFailure) as failed:
        _outcome({"error": {"code": code, "message": "no"}}, streamed=False)
    assert (failed.value.code, failed.value.message) == ("agent_error", "no")


def test_an_answer_with_neither_is_a_protocol_error() -> None:
    with pytest.raises(AgentFailure) as failed:
        _outcome({"something": 1}, streamed=False)
    assert failed.value.code == "agent_protocol"


def test_retried_statuses_are_408_429_and_5xx_only() -> None:
    assert {408, 429, 500, 502, 503, 504, 599} <= RETRIED_STATUSES
    assert not {400, 401, 403, 404, 409, 413, 422} & RETRIED_STATUSES


def test_retry_after_is_seconds_or_an_http_date() -> None:
    """RFC 9110 10.2.3: a date was taken for no wait, and the 429 retried at once."""
    assert agent_retry_after("2.5") == 2.5
    in_a_minute = format_datetime(datetime.now(UTC) + timedelta(seconds=60), usegmt=True)
    assert 55 <= (agent_retry_after(in_a_minute) or 0) <= 60
    assert agent_retry_after("soon") is None
    assert agent_retry_after(None) is None
    # No wait is none asked for: the usual back-off, not a retry at once
    assert agent_retry_after("nan") is None
    assert agent_retry_after("-5") is None
    assert agent_retry_after("0") == 0.0


def test_the_health_check_is_the_origins_healthz_never_the_business_path() -> None:
    assert health_url("http://10.0.0.7:9000/run?x=1") == "http://10.0.0.7:9000/healthz"
    assert health_url("https://agent.example/api/v1/run") == "https://agent.example/healthz"


def test_a_host_name_resolves_only_to_addresses_agents_may_reach() -> None:
    async def resolve(allow: list[str]) -> list[str]:
        resolver = GuardedResolver(Guard(allow=allow))
        try:
            return [r["host"] for r in await resolver.resolve("localhost", 80, socket.AF_INET)]
        finally:
            await resolver.close()

    assert asyncio.run(resolve(["127.0.0.0/8"])) == ["127.0.0.1"]
    with pytest.raises(OSError, match="may not reach"):
        asyncio.run(resolve([]))  # loopback is refused unless listed


def test_a_host_name_listed_by_name_resolves_as_its_registration_was_checked() -> None:
    """``REACH_AGENT_NETWORKS`` may list a host name (``Guard``): registration lets it
    resolve to any address, so the bridge's connections must too, or an agent registered
    under it could never be called."""

    async def resolve(allow: list[str]) -> list[str]:
        resolver = GuardedResolver(Guard(allow=allow))
        try:
            return [r["host"] for r in await resolver.resolve("LocalHost", 80, socket.AF_INET)]
        finally:
            await resolver.close()

    allow = ["localhost", "10.0.0.0/8"]
    assert Guard(allow=allow, resolver=lambda host, port: ["127.0.0.1"]).check(
        "http://localhost:9/run"
    ).addresses == ("127.0.0.1",)
    assert asyncio.run(resolve(allow)) == ["127.0.0.1"]


def test_a_connection_that_fails_tells_the_tenant_no_address_and_logs_it_all(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The error's text became the task's message: ``ClientConnectorError: Cannot connect to
    host 127.0.0.1:<port> ...``, an agent's address a tenant is never otherwise shown."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]  # closed when the test calls it
    ctx = Context(task_id=uuid.uuid4(), capability="text.upper", trace_id="t" * 32, attempt=1)
    endpoint = http_agent.Endpoint(f"http://127.0.0.1:{port}/run", ("whsec_" + "A" * 32,))

    async def called() -> Retryable:
        async with guarded_session(Guard(allow=["127.0.0.0/8"])) as session:
            with pytest.raises(Retryable) as failed:
                await http_agent.call(session, endpoint, ctx, {"text": "hi"})
        return failed.value

    with caplog.at_level(logging.WARNING, logger="reach.bridge"):
        failure = asyncio.run(called())
    assert (failure.code, failure.message) == (
        "agent_unreachable",
        "the agent could not be reached",
    )
    (logged,) = [r.getMessage() for r in caplog.records if r.name == "reach.bridge"]
    assert str(ctx.task_id) in logged
    assert f"127.0.0.1:{port}" in logged


async def _answered_by(head: bytes, close: bool, url_of: Callable[[str], Awaitable[Any]]) -> Any:
    """``url_of`` the URL of an agent that answers ``head``, then hangs up (``close``) or
    sends nothing more."""
    release = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(head)
            await writer.drain()
            if not close:
                await release.wait()
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        try:
            return await url_of(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/run")
        finally:
            release.set()


def _called_within(first_byte_timeout_s: float) -> Callable[[str], Awaitable[Any]]:
    """A call of the agent at a URL, as the bridge makes it, given ``first_byte_timeout_s``."""

    async def called(url: str) -> Any:
        ctx = Context(task_id=uuid.uuid4(), capability="text.upper", trace_id="a" * 32, attempt=1)
        secrets = ("whsec_" + "A" * 32,)
        endpoint = http_agent.Endpoint(url, secrets, first_byte_timeout_s=first_byte_timeout_s)
        async with aiohttp.ClientSession() as session, asyncio.timeout(30):  # the test's bound
            return await http_agent.call(session, endpoint, ctx, {})

    return called


@pytest.mark.parametrize("stalls", [False, True], ids=["broken off", "never comes"])
def test_a_503_whose_body_breaks_off_or_never_comes_is_retried_within_the_first_byte_timeout(
    stalls: bool,
) -> None:
    """The 503's text was read with no bound: a body that broke off raised aiohttp's error,
    which the runner fails for good, and one that never came held the call until its task's
    time limit."""
    head = b"HTTP/1.1 503 Busy\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\n"

    with pytest.raises(Retryable) as refused:
        asyncio.run(_answered_by(head, not stalls, _called_within(0.5)))
    assert refused.value.code == "agent_http_503"


@pytest.mark.parametrize("kind", ["application/json", "text/event-stream"])
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_an_answer_whose_encoding_cannot_be_undone_fails_as_the_agents_fault(
    kind: str, encoding: str
) -> None:
    """Broken as JSON that is not JSON is: ``agent_protocol``, not retried. It was aiohttp's
    ``ClientPayloadError``, which a connection that breaks off raises too, and so was retried
    as ``agent_unreachable`` until the task's attempts ran out."""
    body = b"\x1f\x8b\x08\x00 this is not what it says it is"
    head = (
        f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Encoding: {encoding}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body

    with pytest.raises(AgentFailure) as failed:
        asyncio.run(_answered_by(head, True, _called_within(5)))
    assert not isinstance(failed.value, Retryable)
    assert (failed.value.code, failed.value.message) == (
        "agent_protocol",
        "the agent's answer could not be decoded",
    )


@pytest.mark.parametrize("kind", ["application/json", "text/event-stream"])
def test_an_answer_that_breaks_off_is_retried(kind: str) -> None:
    head = (
        f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: 100\r\n\r\n".encode()
        + b'{"resu'
    )

    with pytest.raises(Retryable) as failed:
        asyncio.run(_answered_by(head, True, _called_within(5)))
    assert failed.value.code == "agent_unreachable"
