"""The MCP facade at /mcp, driven by the `mcp` SDK's own client over streamable HTTP against
the real API and worker: both the 2026-07-28 protocol (what the client picks by default) and
the handshake era (what most hosts still speak)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import httpx2
import pytest
import sqlalchemy.exc
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, TextContent
from sqlalchemy import Engine, text

from api.app import create_app
from api.deps import SMALL_BODY_BYTES
from api.errors import BUG_MESSAGE
from broker.registry import cards
from broker.settings import Settings
from broker.tasks import queries
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import CeleryProcess, ServedApp

MODES = ["auto", "legacy"]  # auto: the client probes and speaks 2026-07-28 to us
TASK_TOOLS = {"reach_get_task", "reach_cancel_task"}
THREE_SENTENCES = (
    "Agent-Reach brokers tasks for agents. It routes each capability to a live worker. "
    "Results come back through polling, waiting, streams or webhooks."
)


@asynccontextmanager
async def connected(api: ServedApp, token: str | None, mode: str = "auto") -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = httpx2.Timeout(30, read=60)
    async with httpx2.AsyncClient(headers=headers, timeout=timeout) as http:
        transport = streamable_http_client(f"{api.url}/mcp", http_client=http)
        async with Client(transport, mode=mode) as client:
            yield client


def call(
    api: ServedApp, token: str, name: str, arguments: dict[str, Any], mode: str = "auto"
) -> CallToolResult:
    async def one() -> CallToolResult:
        async with connected(api, token, mode) as client:
            return await client.call_tool(name, arguments)

    return asyncio.run(one())


def tool_names(api: ServedApp, token: str) -> set[str]:
    async def listed() -> set[str]:
        async with connected(api, token) as client:
            return {tool.name for tool in (await client.list_tools()).tools}

    return asyncio.run(listed())


def text_json(result: CallToolResult) -> Any:
    first = result.content[0]
    assert isinstance(first, TextContent)
    return json.loads(first.text)


@pytest.fixture(scope="module")
def impatient_api(settings: Settings) -> Iterator[ServedApp]:
    """An API whose MCP calls wait half a second for their task."""
    with ServedApp(create_app(settings.model_copy(update={"mcp_wait_s": 0.5}))) as served:
        yield served


def started_sleeper(api: ServedApp, token: str, sleep_s: float) -> str:
    """A test.sleepy task, called through MCP, that outlasts the call's wait: its task id."""
    answer = call(api, token, "test.sleepy", {"sleep_s": sleep_s})
    assert not answer.is_error
    assert answer.structured_content is not None
    assert set(answer.structured_content) == {"task_id", "status"}
    assert answer.structured_content["status"] in {"queued", "running"}
    task_id: str = answer.structured_content["task_id"]
    return task_id


def polled(api: ServedApp, token: str, task_id: str, status: str) -> dict[str, Any]:
    def read() -> dict[str, Any]:
        found = call(api, token, "reach_get_task", {"task_id": task_id}).structured_content
        assert isinstance(found, dict)
        return found

    return eventually(read, f"task {task_id} {status}", until=lambda t: t["status"] == status)


@pytest.mark.parametrize("mode", MODES)
def test_the_tools_are_the_capabilities_and_echo_answers_its_payload(
    api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess, mode: str
) -> None:
    payload = {"greeting": "hello over MCP", "n": 3, "nested": {"ok": True}}

    async def session() -> tuple[str, dict[str, Any], CallToolResult]:
        async with connected(api, tenant[1], mode) as client:
            listed = {tool.name: tool for tool in (await client.list_tools()).tools}
            answer = await client.call_tool("echo", payload)
            return client.protocol_version, listed, answer

    version, listed, answer = asyncio.run(session())

    assert (version == "2026-07-28") == (mode == "auto")
    assert {"echo", "text.summarize", *TASK_TOOLS} <= set(listed)
    summarize = listed["text.summarize"]
    assert summarize.input_schema["required"] == ["text"]
    assert summarize.description is not None and "summar" in summarize.description.lower()
    assert not answer.is_error
    assert answer.structured_content == payload
    assert text_json(answer) == payload


def test_a_key_limited_to_echo_sees_one_capability_tool(api: ServedApp, make_key: KeyMaker) -> None:
    _, token = make_key(["echo"])

    assert tool_names(api, token) == {"echo", *TASK_TOOLS}


def test_a_call_outlasting_its_wait_answers_the_task_id_to_poll(
    impatient_api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess
) -> None:
    task_id = started_sleeper(impatient_api, tenant[1], sleep_s=2)

    task = polled(impatient_api, tenant[1], task_id, "succeeded")

    assert task["task_id"] == task_id
    assert task["capability"] == "test.sleepy"
    assert task["result"]["slept"] is True


@pytest.mark.parametrize("mode", MODES)
def test_progress_events_arrive_as_progress_notifications(
    api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess, mode: str
) -> None:
    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, total, message))

    async def session() -> CallToolResult:
        async with connected(api, tenant[1], mode) as client:
            payload = {"text": THREE_SENTENCES, "max_sentences": 3, "delay_s": 0.3}
            return await client.call_tool("text.summarize", payload, progress_callback=progress)

    answer = asyncio.run(session())

    assert not answer.is_error
    assert answer.structured_content is not None
    assert len(answer.structured_content["sentences"]) == 3
    assert [message for _, _, message in seen] == [f"sentence {i} of 3" for i in (1, 2, 3)]
    assert [(value, total) for value, total, _ in seen] == [(33, 100), (67, 100), (100, 100)]


def test_a_calls_meta_sets_its_tasks_session_key_and_options(
    api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess
) -> None:
    """A tool call's task took its card's defaults alone: it could be no session's turn (an
    agent that needs one, as ``chat.reply`` does, failed every call), and carried no key, so
    a host that sent it again ran it again."""
    with client_for(api, tenant[1]) as http:
        session_id = http.post("/sessions", json={}).json()["session_id"]
    key = f"mcp-{uuid.uuid4().hex}"
    meta = {
        "session_id": session_id,
        "idempotency_key": key,
        "metadata": {"from": "mcp"},
        "deadline_ms": 60_000,
    }

    async def twice() -> tuple[CallToolResult, CallToolResult]:
        async with connected(api, tenant[1]) as client:
            first = await client.call_tool("test.context", {}, meta=meta)  # type: ignore[arg-type]
            again = await client.call_tool("test.context", {}, meta=meta)  # type: ignore[arg-type]
            return first, again

    first, again = asyncio.run(twice())
    assert not first.is_error, first
    told = first.structured_content
    assert told is not None
    assert (told["session_id"], told["session"], told["metadata"]) == (
        session_id,
        1,
        {"from": "mcp"},
    )
    assert 0 < told["time_left_s"] <= 60
    assert again.structured_content == told  # the same task, run once
    with client_for(api, tenant[1]) as http:
        turns = http.get("/tasks", params={"session_id": session_id}).json()["tasks"]
    assert [t["task_id"] for t in turns] == [told["task_id"]]


@pytest.mark.parametrize(
    ("meta", "code"),
    [
        ({"session_id": "sess_nobody"}, "session_not_found"),
        ({"deadline_ms": -1}, "envelope_invalid"),
        ({"idempotency_key": "clé"}, "envelope_invalid"),
        ({"metadata": {"k": "a\u0000b"}}, "invalid_string"),
    ],
)
def test_a_calls_meta_is_checked_as_a_post_body_is(
    api: ServedApp, tenant: tuple[str, str], meta: dict[str, Any], code: str
) -> None:
    async def one() -> CallToolResult:
        async with connected(api, tenant[1]) as client:
            return await client.call_tool("echo", {}, meta=meta)  # type: ignore[arg-type]

    answer = asyncio.run(one())
    assert answer.is_error
    assert answer.structured_content is not None
    assert answer.structured_content["error"]["code"] == code


def test_reach_cancel_task_cancels_a_running_task(
    impatient_api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess
) -> None:
    task_id = started_sleeper(impatient_api, tenant[1], sleep_s=20)
    polled(impatient_api, tenant[1], task_id, "running")

    cancelled = call(impatient_api, tenant[1], "reach_cancel_task", {"task_id": task_id})

    assert not cancelled.is_error
    assert cancelled.structured_content is not None
    assert cancelled.structured_content["status"] == "cancelled"
    assert polled(impatient_api, tenant[1], task_id, "cancelled")["error"]["code"] == "cancelled"


def test_a_failed_task_is_a_tool_error_carrying_its_error(
    api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess
) -> None:
    answer = call(api, tenant[1], "echo", {"fail": "bad_invoice", "message": "no total"})

    assert answer.is_error
    assert answer.structured_content is not None
    assert answer.structured_content["status"] == "failed"
    assert answer.structured_content["error"]["code"] == "bad_invoice"


def test_a_payload_the_card_refuses_is_a_tool_error(
    api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess
) -> None:
    answer = call(api, tenant[1], "text.summarize", {"max_sentences": 2})

    assert answer.is_error
    assert answer.structured_content is not None
    assert answer.structured_content["error"]["code"] == "payload_invalid"


def test_arguments_meet_the_checks_a_request_body_meets(
    api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess
) -> None:
    answer = call(api, tenant[1], "echo", {"text": "a\x00b"})

    assert answer.is_error
    assert answer.structured_content is not None
    assert answer.structured_content["error"]["code"] == "invalid_string"


def test_another_tenants_task_is_not_found(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    _, owner = make_key()
    _, stranger = make_key()
    with client_for(api, owner) as http:
        task_id = http.post("/tasks", json={"capability": "echo", "payload": {}}).json()["task_id"]

    for tool in ("reach_get_task", "reach_cancel_task"):
        answer = call(api, stranger, tool, {"task_id": task_id})
        assert answer.is_error
        assert answer.structured_content == {
            "error": {"code": "task_not_found", "message": "no such task"}
        }
    with client_for(api, owner) as http:
        assert http.get(f"/tasks/{task_id}").json()["status"] != "cancelled"


def test_tool_calls_take_the_tenants_rate_tokens(
    settings: Settings, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    slow = settings.model_copy(update={"rate_limit_per_s": 0.001, "rate_limit_burst": 1})
    _, token = make_key()
    with ServedApp(create_app(slow)) as api:
        first = call(api, token, "echo", {"i": 1})
        second = call(api, token, "echo", {"i": 2})
        reading = call(api, token, "reach_get_task", {"task_id": str(uuid.uuid4())})

    assert first.structured_content == {"i": 1}
    assert second.is_error
    assert second.structured_content is not None
    assert second.structured_content["error"]["code"] == "rate_limited"
    assert reading.structured_content is not None
    assert reading.structured_content["error"]["code"] == "task_not_found"  # not rate_limited


def test_a_body_over_4_kib_takes_a_token_before_it_is_read_whatever_its_method(
    settings: Settings, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    """An MCP body was read and parsed twice (ours, then the SDK's) with no token taken:
    notifications and ``tools/list`` never took one, ``tools/call`` only after the parse.
    A tenant out of tokens sending 1 MiB notifications from four connections took another
    tenant's reads from 7 ms to 0.9-1.9 s (an audit, 2026-12-06). A call that large is
    charged its one token, not two."""
    one_token = settings.model_copy(update={"rate_limit_per_s": 0.001, "rate_limit_burst": 1})
    _, token = make_key()
    _, other = make_key()
    filler = "x" * (4 * SMALL_BODY_BYTES)
    notification = {
        "jsonrpc": "2.0",
        "method": "notifications/initialized",
        "params": {"f": filler},
    }
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    with ServedApp(create_app(one_token)) as api:
        with client_for(api, token) as http:
            taken = http.post("/mcp", json=notification, headers=headers)
            refused = http.post("/mcp", json=notification, headers=headers)
        large_call = call(api, other, "echo", {"f": filler})
    assert taken.status_code == 202, taken.text
    assert refused.status_code == 429, refused.text
    assert refused.headers["content-type"].startswith("application/problem+json")
    assert refused.json()["code"] == "rate_limited"
    assert large_call.structured_content == {"f": filler}  # its one token, not two


@pytest.mark.parametrize("token", [None, "rk_nosuchkey_secret", "not-a-key"])
def test_no_key_or_a_bad_key_is_401(api: ServedApp, token: str | None) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    with client_for(api, token) as http:
        answer = http.post("/mcp", json=body, headers={"Accept": "application/json"})

    assert answer.status_code == 401
    assert answer.headers["www-authenticate"] == "Bearer"
    assert answer.json()["code"] == "unauthenticated"


BAD_BODIES = [
    b"{",
    b"[]",
    b'"tools/list"',
    b'{"jsonrpc":"2.0","id":1,"method":"no/such/method"}',
    b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"no.such.tool"}}',
    b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"reach_get_task"}}',
    b'{"jsonrpc":"2.0","id":1,"method":"tools/call",'
    b'"params":{"name":"reach_get_task","arguments":{"task_id":"../../etc"}}}',
    b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":[1]}}',
]


@pytest.mark.parametrize("version", [None, "2025-11-25", "2026-07-28", "1999-01-01"])
def test_bad_requests_never_get_a_500(
    api: ServedApp, tenant: tuple[str, str], version: str | None
) -> None:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if version is not None:
        headers["MCP-Protocol-Version"] = version
    with client_for(api, tenant[1]) as http:
        answers = [http.post("/mcp", content=body, headers=headers) for body in BAD_BODIES]
        answers.append(http.post("/mcp", content=b"{}", headers={"Content-Type": "text/plain"}))
        answers.append(http.get("/mcp", headers=headers))  # stateless: no stream to open
        answers.append(http.delete("/mcp", headers=headers))

    assert [a.status_code for a in answers if a.status_code >= 500] == []


@pytest.mark.parametrize("request_id", [None, 1.5, 1e400, True, {"a": 1}, [1]])
def test_a_request_whose_id_is_not_a_string_or_an_integer_is_invalid_and_runs_nothing(
    api: ServedApp, tenant: tuple[str, str], engine: Engine, request_id: Any
) -> None:
    """The transport took such a request for a notification: 202, and the tool never ran."""
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    call = {"name": "echo", "arguments": {"i": 1}}
    body = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": call}
    listing = {**body, "method": "tools/list", "params": {}}
    with client_for(api, tenant[1]) as http:
        answer = http.post("/mcp", content=_with_huge_numbers(body), headers=headers)
        listed = http.post("/mcp", content=_with_huge_numbers(listing), headers=headers)

    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == -32600
    assert answer.json()["id"] is None
    assert listed.status_code == 400
    with engine.connect() as conn:
        tasks = conn.execute(text("SELECT count(*) FROM tasks WHERE tenant = :t"), {"t": tenant[0]})
        assert tasks.scalar_one() == 0


def _with_huge_numbers(body: dict[str, Any]) -> bytes:
    """``body`` as JSON, an infinite float written as 1e400 (JSON has no Infinity)."""
    return json.dumps(body).replace("Infinity", "1e400").encode()


def test_a_body_that_does_not_arrive_in_time_is_answered_408_holding_no_stream_slot(
    settings: Settings, tenant: tuple[str, str]
) -> None:
    """The body is read as ``POST /tasks`` reads one, before the SDK's transport, which
    waited for it without end, sees the request."""
    app = create_app(settings.model_copy(update={"body_read_timeout_s": 0.5}))

    async def slow_body(port: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Accept: application/json, text/event-stream\r\n"
            + f"Authorization: Bearer {tenant[1]}\r\nContent-Length: 1000\r\n\r\n{{".encode()
        )
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), 30)  # bounds a hang only
        writer.close()
        return answer

    with ServedApp(app) as api:
        answer = asyncio.run(slow_body(api.port))
        held = app.state.services.streams.open.get(tenant[0])

    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"application/problem+json" in answer
    assert b'"code":"body_timeout"' in answer.replace(b" ", b"")
    assert not held


def test_a_body_past_the_size_limit_is_413_problem_json(
    api: ServedApp, tenant: tuple[str, str], settings: Settings
) -> None:
    padding = "x" * settings.max_body_bytes
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"padding": padding}}
    accept = {"Accept": "application/json, text/event-stream"}
    with client_for(api, tenant[1]) as http:
        answer = http.post("/mcp", json=body, headers=accept)

    assert answer.status_code == 413
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["code"] == "body_too_large"


@pytest.mark.parametrize("content_type", ["text/plain", "application/merge-patch+json", None])
def test_a_body_not_sent_as_application_json_is_415_problem_json(
    api: ServedApp, tenant: tuple[str, str], content_type: str | None
) -> None:
    headers = {"Accept": "application/json, text/event-stream"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    body = b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{}}'
    with client_for(api, tenant[1]) as http:
        answer = http.post("/mcp", content=body, headers=headers)

    assert answer.status_code == 415, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["code"] == "unsupported_media_type"


@pytest.mark.parametrize("content_type", ["Application/JSON", "application/JSON; charset=UTF-8"])
def test_json_named_in_any_case_is_json(
    api: ServedApp, tenant: tuple[str, str], content_type: str
) -> None:
    """Media type names are case-insensitive (RFC 9110): the transport compared them as
    written and answered a bare 400."""
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": content_type}
    body = b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{}}'
    with client_for(api, tenant[1]) as http:
        answer = http.post("/mcp", content=body, headers=headers)

    assert answer.status_code == 200, answer.text
    assert "reach_get_task" in answer.text


def test_allowed_hosts_keep_out_other_host_names(
    settings: Settings, tenant: tuple[str, str]
) -> None:
    guarded = settings.model_copy(update={"mcp_allowed_hosts": ["reach.example:*"]})
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    accept = {"Accept": "application/json, text/event-stream"}
    with ServedApp(create_app(guarded)) as api, client_for(api, tenant[1]) as http:
        other = http.post("/mcp", json=body, headers=accept)
        named = http.post(
            "/mcp", json=body, headers={**accept, "Host": f"reach.example:{api.port}"}
        )

    assert other.status_code == 421
    assert named.status_code == 200


def test_the_openapi_document_shows_the_mcp_endpoint(api: ServedApp) -> None:
    with httpx.Client(base_url=api.url) as http:
        spec = http.get("/openapi.json").json()

    post = spec["paths"]["/mcp"]["post"]
    assert "mcp" in post["tags"]
    assert "401" in post["responses"]
    for status in ("408", "413", "415"):  # the API's body reader answers these, not the SDK
        assert list(post["responses"][status]["content"]) == ["application/problem+json"]


def test_a_tenant_holding_its_most_streams_is_refused_another_request_and_others_are_not(
    settings: Settings, make_key: KeyMaker, worker: CeleryProcess, engine: Engine
) -> None:
    """A tool call holds its answer open for its whole wait, so it takes one of the tenant's
    stream slots (``REACH_MAX_STREAMS_PER_TENANT``) until it ends."""
    tenant, token = make_key()
    _, other = make_key()
    accept = {"Accept": "application/json, text/event-stream"}

    def rpc(method: str, **params: Any) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}

    async def post(http: httpx.AsyncClient, key: str) -> httpx.Response:
        headers = {**accept, "Authorization": f"Bearer {key}"}
        return await http.post("/mcp", json=rpc("tools/list"), headers=headers)

    def running() -> int:
        with engine.connect() as conn:
            found = conn.execute(
                text("SELECT count(*) FROM tasks WHERE tenant = :t AND status = 'running'"),
                {"t": tenant},
            )
            return int(found.scalar_one())

    app = create_app(settings.model_copy(update={"max_streams_per_tenant": 1}))
    with ServedApp(app) as api:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
                call = rpc("tools/call", name="test.sleepy", arguments={"sleep_s": 4})
                headers = {**accept, "Authorization": f"Bearer {token}"}
                async with http.stream("POST", "/mcp", json=call, headers=headers) as held:
                    assert held.status_code == 200
                    for _ in range(200):  # until the call is in and its task started
                        if await asyncio.to_thread(running):
                            break
                        await asyncio.sleep(0.05)
                    # While its call waits, the tenant's next request is refused; the other's
                    # is not
                    refused = await post(http, token)
                    assert refused.status_code == 429, refused.text
                    assert refused.json()["code"] == "too_many_streams"
                    assert (await post(http, other)).status_code != 429
                    answer = (await held.aread()).decode()
                assert '"isError":false' in answer.replace(" ", ""), answer
                # Once the call has ended, the slot is free again
                for _ in range(100):
                    if not app.state.services.streams.open.get(tenant):
                        break
                    await asyncio.sleep(0.02)
                assert (await post(http, token)).status_code != 429

        asyncio.run(scenario())


SECRET = "QueuePool limit of size 20 overflow 10 reached; SELECT * FROM cards at db:5432"
FAILURES = {
    "outage": (sqlalchemy.exc.TimeoutError(SECRET), "a backing service cannot be reached"),
    "bug": (RuntimeError(SECRET), BUG_MESSAGE),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_an_unexpected_failure_answers_without_its_text_on_either_protocol(
    api: ServedApp,
    tenant: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    failure: str,
) -> None:
    """The SDK's older protocol path answered any exception with its text: a pool's limits,
    a host and port, SQL. Both handlers now answer an outage and a bug in words of their own."""
    exc, message = FAILURES[failure]

    async def failing(*args: Any, **kwargs: Any) -> Any:
        raise exc

    monkeypatch.setattr(cards, "latest_cards", failing)
    monkeypatch.setattr(queries, "visible_task", failing)

    async def session() -> tuple[str, CallToolResult | str]:
        async with connected(api, tenant[1], mode) as client:
            with pytest.raises(MCPError) as listed:
                await client.list_tools()
            try:
                called: CallToolResult | str = await client.call_tool(
                    "reach_get_task", {"task_id": str(uuid.uuid4())}
                )
            except MCPError as refused:
                called = refused.error.message
            return listed.value.error.message, called

    listed, called = asyncio.run(session())

    assert listed == message
    if failure == "outage":  # a refusal the model can read, as a submit's outage is
        assert isinstance(called, CallToolResult) and called.is_error
        assert called.structured_content == {
            "error": {"code": "service_unavailable", "message": message}
        }
    else:
        assert called == message
