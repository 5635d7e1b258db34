"""Agent-Reach as an A2A server, driven by ``a2a-sdk``'s own client against the running stack:
the card and the extended card per key, blocking and non-blocking messages, a streamed
summary, reads, lists, cancel and resubscribe, and JSON-RPC's error codes."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import httpx
import pytest
import redis
from a2a.client import A2ACardResolver, ClientCallContext, ClientConfig, ClientFactory
from a2a.client.auth import AuthInterceptor, CredentialService
from a2a.client.client import Client
from a2a.client.errors import A2AClientError
from a2a.types import (
    AgentCard,
    AuthenticationInfo,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import InvalidParamsError, TaskNotFoundError
from google.protobuf import struct_pb2
from google.protobuf.json_format import ParseDict
from sqlalchemy import Engine, text
from standardwebhooks import Webhook

from api.a2a import DISPATCHER_LOG, JSON_PARSE_ERROR
from api.app import create_app
from api.deps import SMALL_BODY_BYTES
from broker.remote.a2a_json import to_json
from broker.settings import Settings
from tests.agents import GATE_KEY
from tests.integration.conftest import KeyMaker
from tests.integration.receiver import Receiver
from tests.integration.stack import CeleryProcess, ServedApp

TEXT = (
    "Agents advertise capabilities to the broker. The broker routes tasks to queues. "
    "Workers consume queues and run agents. Results land in Postgres with a TTL. "
    "Streams show progress and partial output. Callers resume streams after a drop."
)
A2A_VERSION = {"A2A-Version": "1.0"}


class Key(CredentialService):
    """The API key for the card's bearer scheme: the SDK's auth interceptor adds it."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def get_credentials(self, scheme: str, context: ClientCallContext | None) -> str | None:
        return self.token if scheme == "bearer" else None


def message(
    capability: str, *, data: Any = None, text: str | None = None, context: str = ""
) -> Message:
    parts = [Part(text=text)] if text is not None else []
    if data is not None:
        parts.append(Part(data=ParseDict(data, struct_pb2.Value())))
    sent = Message(
        message_id=str(uuid.uuid4()), role=Role.ROLE_USER, parts=parts, context_id=context
    )
    sent.metadata.update({"capability": capability})
    return sent


def as_json(value: Any) -> Any:
    return to_json(value)


class Clients:
    """Opens the SDK's clients, each for a fresh tenant (or the key patterns given), and
    closes them all with the test's event loop."""

    def __init__(self, api: ServedApp, make_key: KeyMaker) -> None:
        self.api, self.make_key = api, make_key
        self.opened: list[httpx.AsyncClient] = []

    async def __call__(
        self,
        patterns: list[str] | None = None,
        *,
        streaming: bool = False,
        binding: str = "JSONRPC",
        tenant: str | None = None,
    ) -> tuple[Client, AgentCard]:
        _, token = self.make_key(patterns, tenant)
        http = httpx.AsyncClient(timeout=30)
        self.opened.append(http)
        card = await A2ACardResolver(http, self.api.url).get_agent_card()
        config = ClientConfig(
            streaming=streaming, httpx_client=http, supported_protocol_bindings=[binding]
        )
        client = ClientFactory(config).create(card, interceptors=[AuthInterceptor(Key(token))])
        return client, card

    def run(self, test: Callable[[], Coroutine[Any, Any, None]]) -> None:
        async def then_close() -> None:
            try:
                await test()
            finally:
                for http in self.opened:
                    await http.aclose()

        asyncio.run(then_close())


@pytest.fixture
def a2a(api: ServedApp, make_key: KeyMaker, worker: CeleryProcess) -> Clients:
    return Clients(api, make_key)


async def collect(stream: AsyncIterator[StreamResponse]) -> list[StreamResponse]:
    return [event async for event in stream]


async def sent_at_once(client: Client, sent: Message) -> str:
    """Send with ``return_immediately`` (a non-streaming client): the new task's id."""
    request = SendMessageRequest(
        message=sent, configuration=SendMessageConfiguration(return_immediately=True)
    )
    return (await collect(client.send_message(request)))[-1].task.id


def data_of(artifact: Any) -> Any:
    return as_json(artifact)["parts"][0]["data"]


def test_the_public_card_names_both_bindings_and_requires_a_bearer_key(api: ServedApp) -> None:
    card = httpx.get(f"{api.url}/.well-known/agent-card.json").json()
    bindings = {i["protocolBinding"]: i["url"] for i in card["supportedInterfaces"]}
    assert bindings == {
        "JSONRPC": f"{api.url}/a2a/jsonrpc",
        "HTTP+JSON": f"{api.url}/a2a/rest",
    }
    assert card["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"] == "Bearer"
    assert card["securityRequirements"] == [{"schemes": {"bearer": {}}}]
    assert card["capabilities"]["extendedAgentCard"] is True
    # one, saying the skills are per key, on the extended card
    assert [s["id"] for s in card["skills"]] == ["capabilities"]


def test_a_card_named_after_a_forged_host_is_never_kept_by_a_shared_cache(api: ServedApp) -> None:
    # Given no REACH_PUBLIC_URL: the card names the endpoints under the request's Host
    card = httpx.get(f"{api.url}/.well-known/agent-card.json", headers={"Host": "evil.example"})
    urls = [i["url"] for i in card.json()["supportedInterfaces"]]
    assert all(u.startswith("http://evil.example/") for u in urls), urls
    # Then it says no cache may keep it: a proxy's cache would hand it to every client,
    # each sending its key to that host
    assert card.headers["cache-control"] == "no-store"


def test_with_a_public_url_both_cards_name_it_whatever_the_host(
    settings: Settings, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    public = settings.model_copy(update={"public_url": "https://reach.example.com/base/"})
    with ServedApp(create_app(public)) as api:
        _, token = make_key()
        forged = {"Host": "evil.example", "Authorization": f"Bearer {token}", **A2A_VERSION}
        # When the public card and the extended card are asked for with a forged Host
        card = httpx.get(f"{api.url}/.well-known/agent-card.json", headers=forged)
        extended = httpx.post(
            f"{api.url}/a2a/jsonrpc",
            headers=forged,
            json={"jsonrpc": "2.0", "id": 1, "method": "GetExtendedAgentCard", "params": {}},
        )
    # Then both name the endpoints under REACH_PUBLIC_URL
    want = {
        "JSONRPC": "https://reach.example.com/base/a2a/jsonrpc",
        "HTTP+JSON": "https://reach.example.com/base/a2a/rest",
    }
    for answer in (card.json(), extended.json()["result"]):
        assert {i["protocolBinding"]: i["url"] for i in answer["supportedInterfaces"]} == want
    assert "cache-control" not in card.headers


def test_a_key_limited_to_echo_sees_one_skill(a2a: Clients) -> None:
    async def run() -> None:
        client, _ = await a2a(["echo"])
        extended = await client.get_extended_agent_card(GetExtendedAgentCardRequest())
        assert [s.id for s in extended.skills] == ["echo"]
        everything, _ = await a2a()
        skills = {
            s.id
            for s in (
                await everything.get_extended_agent_card(GetExtendedAgentCardRequest())
            ).skills
        }
        assert {"echo", "text.summarize", "invoice.extract"} <= skills

    a2a.run(run)


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
def test_blocking_and_non_blocking_messages_to_echo(a2a: Clients, binding: str) -> None:
    async def run() -> None:
        client, _ = await a2a(binding=binding)
        payload = {"order": 7731, "items": ["tea", "rice"]}
        events = await collect(
            client.send_message(SendMessageRequest(message=message("echo", data=payload)))
        )
        task = events[-1].task
        assert task.status.state == TaskState.TASK_STATE_COMPLETED
        assert data_of(task.artifacts[0]) == payload

        later = await collect(
            client.send_message(
                SendMessageRequest(
                    message=message("echo", text="hello"),
                    configuration=SendMessageConfiguration(return_immediately=True),
                )
            )
        )
        first = later[-1].task
        assert first.status.state in (
            TaskState.TASK_STATE_SUBMITTED,
            TaskState.TASK_STATE_WORKING,
            TaskState.TASK_STATE_COMPLETED,
        )
        for _ in range(100):
            got = await client.get_task(GetTaskRequest(id=first.id))
            if got.status.state == TaskState.TASK_STATE_COMPLETED:
                break
            await asyncio.sleep(0.1)
        assert got.status.state == TaskState.TASK_STATE_COMPLETED
        assert data_of(got.artifacts[0]) == {"text": "hello"}

        listed = await client.list_tasks(ListTasksRequest(status=TaskState.TASK_STATE_COMPLETED))
        assert {t.id for t in listed.tasks} == {task.id, first.id}

    a2a.run(run)


def test_a_streamed_summary_arrives_as_artifact_updates_in_order(
    a2a: Clients,
) -> None:
    async def run() -> None:
        client, _ = await a2a(streaming=True)
        events = await collect(
            client.send_message(
                SendMessageRequest(
                    message=message("text.summarize", data={"text": TEXT, "max_sentences": 3})
                )
            )
        )
        assert events[0].HasField("task")
        outputs = [
            data_of(e.artifact_update.artifact)
            for e in events
            if e.HasField("artifact_update") and e.artifact_update.artifact.artifact_id == "output"
        ]
        assert [o["index"] for o in outputs] == [1, 2, 3]
        result = next(
            e.artifact_update.artifact
            for e in events
            if e.HasField("artifact_update") and e.artifact_update.artifact.artifact_id == "result"
        )
        assert data_of(result)["sentences"] == [o["sentence"] for o in outputs]
        last = events[-1]
        assert last.status_update.status.state == TaskState.TASK_STATE_COMPLETED

    a2a.run(run)


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
def test_cancel_a_running_task_and_resubscribe_mid_stream(a2a: Clients, binding: str) -> None:
    """Over both bindings: REST's SubscribeToTask is a POST without a body, which the body
    check refused (400) before the SDK ran."""

    async def run() -> None:
        client, _ = await a2a(streaming=True, binding=binding)
        stream = client.send_message(
            SendMessageRequest(
                message=message(
                    "text.summarize", data={"text": TEXT, "max_sentences": 4, "delay_s": 0.5}
                )
            )
        )
        first = await anext(stream)
        task_id = first.task.id
        seen = []
        async for event in stream:
            if event.HasField("artifact_update"):
                seen.append(data_of(event.artifact_update.artifact)["index"])
                break
        await stream.aclose()

        resumed = await collect(client.subscribe(SubscribeToTaskRequest(id=task_id)))
        assert resumed[0].HasField("task")
        indexes = [
            data_of(e.artifact_update.artifact)["index"]
            for e in resumed
            if e.HasField("artifact_update") and e.artifact_update.artifact.artifact_id == "output"
        ]
        assert seen == [1]
        # No output the client saw before it dropped comes again, and none is missing.
        assert indexes and indexes[-1] == 4
        assert indexes == list(range(indexes[0], 5))
        assert resumed[-1].status_update.status.state == TaskState.TASK_STATE_COMPLETED

        blocking, _ = await a2a(binding=binding)
        sleepy_id = await sent_at_once(blocking, message("test.sleepy", data={"sleep_s": 20}))
        for _ in range(100):
            if (await blocking.get_task(GetTaskRequest(id=sleepy_id))).status.state == (
                TaskState.TASK_STATE_WORKING
            ):
                break
            await asyncio.sleep(0.1)
        cancelled = await blocking.cancel_task(CancelTaskRequest(id=sleepy_id))
        assert cancelled.status.state == TaskState.TASK_STATE_CANCELED

    a2a.run(run)


def test_another_tenants_task_is_not_found(a2a: Clients) -> None:
    async def run() -> None:
        mine, _ = await a2a()
        theirs, _ = await a2a()
        events = await collect(
            mine.send_message(SendMessageRequest(message=message("echo", data={"a": 1})))
        )
        task_id = events[-1].task.id
        # Its own tenant finds it; another, the same not found as an unknown task's
        assert (await mine.get_task(GetTaskRequest(id=task_id))).id == task_id
        with pytest.raises(TaskNotFoundError):
            await theirs.get_task(GetTaskRequest(id=task_id))

    a2a.run(run)


def send_message_body(
    parts: list[dict[str, Any]], *, metadata: dict[str, Any] | None = None, **configuration: Any
) -> dict[str, Any]:
    """A JSON-RPC ``SendMessage`` of ``parts`` to echo (``metadata`` adds to the message's),
    with a fresh ``messageId`` and the ``configuration`` given."""
    message = {
        "messageId": str(uuid.uuid4()),
        "role": "ROLE_USER",
        "parts": parts,
        "metadata": {"capability": "echo", **(metadata or {})},
    }
    params: dict[str, Any] = {"message": message}
    if configuration:
        params["configuration"] = configuration
    return {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": params}


def rpc(api: ServedApp, token: str | None, body: Any, **headers: str) -> httpx.Response:
    sent = {"Content-Type": "application/json", **A2A_VERSION, **headers}
    if token:
        sent["Authorization"] = f"Bearer {token}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{api.url}/a2a/jsonrpc", content=content, headers=sent, timeout=30)


def test_a_message_sets_the_envelopes_options_in_its_metadata_or_the_requests(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess, engine: Engine
) -> None:
    """``deadline_ms``, ``result_ttl_s``, ``priority``, ``max_attempts`` and the task's
    ``metadata``, named as ``POST /tasks`` names them. They were dropped with no word: an A2A
    task had no deadline and kept its result a day, whatever its caller asked."""
    # Given the options, in a message's metadata or in its request's
    _, token = make_key()
    options = {
        "deadline_ms": 600_000,
        "result_ttl_s": 120,
        "priority": 9,
        "max_attempts": 1,
        "metadata": {"order": "7731", "line": 2**53 + 1},
    }
    in_message = send_message_body(
        [{"data": {}}], metadata={"capability": "test.context", **options}
    )
    in_request = send_message_body([{"data": {}}], metadata={"capability": "test.context"})
    in_request["params"]["metadata"] = options
    for body in (in_message, in_request):
        # When the message is sent
        answer = rpc(api, token, body).json()
        task = answer["result"]["task"]
        # Then its agent saw the deadline and the metadata, and the task keeps the rest
        seen = task["artifacts"][0]["parts"][0]["data"]
        assert 0 < seen["time_left_s"] <= 600 and seen["metadata"]["order"] == "7731"
        kept = text(
            "SELECT priority, max_attempts, result_ttl_s, metadata FROM tasks WHERE id = :id"
        )
        with engine.connect() as conn:
            row = conn.execute(kept, {"id": task["id"]}).one()
        # its metadata as sent (protobuf, under the SDK, made 2**53 + 1 a double)
        assert tuple(row) == (9, 1, 120, {"order": "7731", "line": 2**53 + 1})
    # And an option the API would refuse is refused here, naming the field
    bad = send_message_body([{"data": {}}], metadata={"priority": 99})
    error = rpc(api, token, bad).json()["error"]
    [info, _] = error["data"]  # the SDK's ErrorInfo, then its BadRequest
    assert (error["code"], info["metadata"]["code"]) == (-32602, "envelope_invalid")
    assert [e["field"] for e in info["metadata"]["errors"]] == ["priority"]


def test_bad_json_rpc_gets_the_spec_codes_never_a_500(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    _, token = make_key()
    cases = [
        (b"{not json", -32700),
        ({"jsonrpc": "2.0", "id": 1}, -32600),
        ({"jsonrpc": "1.0", "id": 1, "method": "GetTask", "params": {}}, -32600),
        ({"jsonrpc": "2.0", "id": 1, "method": "NoSuchMethod", "params": {}}, -32601),
        ({"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": 5}}, -32602),
        (
            {"jsonrpc": "2.0", "id": 2, "method": "GetTask", "params": {"id": str(uuid.uuid4())}},
            -32001,
        ),
        (
            {
                "jsonrpc": "2.0",
                "id": 3,
                "method": "SendMessage",
                "params": {
                    "message": {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
                },
            },
            -32602,  # no capability named
        ),
    ]
    for body, code in cases:
        answer = rpc(api, token, body)
        assert answer.status_code == 200, (body, answer.text)
        assert answer.json()["error"]["code"] == code, (body, answer.text)


def test_bad_json_rpc_is_logged_without_a_traceback_and_cut_short(
    api: ServedApp, make_key: KeyMaker, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK's dispatcher logged each request it could not read at ERROR, with a traceback,
    and then a warning, each holding the input: a tenant could write as much to the log as
    its rate let it send."""
    _, token = make_key()
    marker = "x" * 5_000
    cases = [
        {"jsonrpc": "2.0", "id": {"k": marker}, "method": "GetTask", "params": {}},
        {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": marker},
        {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": {"x": marker}}},
        {"jsonrpc": "2.0", "id": 1, "method": "ListTasks", "params": {"pageSize": marker}},
    ]
    with caplog.at_level(logging.INFO, logger=DISPATCHER_LOG):
        answers = [rpc(api, token, body) for body in cases]

    assert [a.json()["error"]["code"] for a in answers] == [-32600, -32600, -32602, -32602]
    dispatched = [r for r in caplog.records if r.name == DISPATCHER_LOG]
    read = [r for r in dispatched if r.getMessage().startswith("Failed to")]
    assert len(read) == len(cases)
    assert [r for r in read if r.levelno >= logging.WARNING or r.exc_info] == []
    assert [r for r in dispatched if marker in r.getMessage()] == []


@pytest.mark.parametrize("binding", ["jsonrpc", "rest"])
def test_an_overlong_a2a_version_is_a_version_not_served(
    api: ServedApp, make_key: KeyMaker, binding: str
) -> None:
    """A version of more than 4,300 digits broke the SDK's parse of it: JSON-RPC's internal
    error carrying Python's text, REST's 500."""
    _, token = make_key()
    task_id = str(uuid.uuid4())

    def asked(version: str) -> httpx.Response:
        if binding == "rest":
            headers = {"Authorization": f"Bearer {token}", "A2A-Version": version}
            return httpx.get(f"{api.url}/a2a/rest/tasks/{task_id}", headers=headers, timeout=30)
        body = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": task_id}}
        return rpc(api, token, body, **{"A2A-Version": version})

    overlong, unserved = asked("1." + "9" * 4_400), asked("9.0")

    assert unserved.status_code in (200, 400)  # JSON-RPC's errors come with a 200
    assert overlong.status_code == unserved.status_code, overlong.text
    if binding == "jsonrpc":
        assert overlong.json()["error"]["code"] == unserved.json()["error"]["code"]
    else:
        assert overlong.json()["error"]["status"] == unserved.json()["error"]["status"]
    assert "digits" not in overlong.text


def sent_message(api: ServedApp, token: str, message_id: str, data: Any) -> str:
    """``SendMessage`` to echo with ``returnImmediately``: the task's id, or the error."""
    body = send_message_body([{"data": data}], returnImmediately=True)
    body["params"]["message"]["messageId"] = message_id
    answer = rpc(api, token, body).json()
    assert "error" not in answer, (message_id[:40], answer["error"])
    task_id: str = answer["result"]["task"]["id"]
    return task_id


def test_each_message_id_is_its_own_task_and_a_resent_one_replays_it(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    """The idempotency key was ``a2a:<messageId>`` cut to 255 characters, and a key must be
    printable ASCII: two ids alike in their first 251 characters were one task (or -32602
    "used with a different payload"), and an id with a space, a tab or an é was refused."""
    # Given a tenant, and ids that differ only past their 251st character or hold any text
    _, token = make_key()
    unique = uuid.uuid4().hex
    long_a, long_b = "L" * 251 + "A" + unique, "L" * 251 + "B" + unique
    spaced, tabbed, accented = f"msg {unique}", f"msg\t{unique}", f"msgé{unique}"
    # When each is sent with the same data
    ids = [long_a, long_b, spaced, tabbed, accented]
    tasks = {mid: sent_message(api, token, mid, {"t": "one"}) for mid in ids}
    # Then each is a task of its own
    assert len(set(tasks.values())) == 5
    # And each resent is its first task again
    for mid, task_id in tasks.items():
        assert sent_message(api, token, mid, {"t": "one"}) == task_id


def test_without_a_key_it_is_401_problem_json(api: ServedApp) -> None:
    answer = rpc(api, None, {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {}})
    assert answer.status_code == 401
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.json()["code"] == "unauthenticated"
    rest = httpx.get(f"{api.url}/a2a/rest/tasks/{uuid.uuid4()}", headers=A2A_VERSION)
    assert rest.status_code == 401


def test_a_body_past_the_limits_is_refused_before_the_sdk_reads_it(
    api: ServedApp, make_key: KeyMaker, settings: Settings
) -> None:
    _, token = make_key()
    deep: Any = {}
    for _ in range(200):
        deep = {"a": deep}
    answer = rpc(api, token, {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": deep})
    assert answer.status_code == 200
    assert answer.json()["error"]["code"] == -32600
    assert answer.json()["error"]["data"] == {"code": "json_too_deep"}
    huge = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "GetTask",
        "params": {"id": "x" * (settings.max_body_bytes + 1)},
    }
    too_large = rpc(api, token, huge)
    assert too_large.status_code == 413
    assert too_large.json()["code"] == "body_too_large"


REST = "/a2a/rest"


def rest_get(api: ServedApp, token: str, path: str, **params: str) -> httpx.Response:
    headers = {**A2A_VERSION, "Authorization": f"Bearer {token}"}
    return httpx.get(f"{api.url}{REST}{path}", params=params, headers=headers, timeout=30)


def test_a_tenant_out_of_tokens_has_its_body_refused_before_it_is_parsed(
    settings: Settings, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    """A body past ``SMALL_BODY_BYTES`` takes its tenant's token before it is read, as for
    ``POST /tasks``: once the bucket is empty, 64 KiB that are not even JSON get 429
    ``rate_limited`` on both bindings, not -32700 (what their parse answered while a token
    was left). A message that large is sent for its one token, not charged twice."""
    _, token = make_key()
    _, sender = make_key()
    large_message = send_message_body(
        [{"text": "x" * (4 * SMALL_BODY_BYTES)}], returnImmediately=True
    )
    not_json = b"{" + b"x" * (16 * SMALL_BODY_BYTES)
    one_token = settings.model_copy(update={"rate_limit_per_s": 0.001, "rate_limit_burst": 1})
    with ServedApp(create_app(one_token)) as api:
        parsed = rpc(api, token, not_json)
        refused = rpc(api, token, not_json)
        rest_refused = httpx.post(
            f"{api.url}{REST}/message:send",
            content=not_json,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
            timeout=30,
        )
        sent = rpc(api, sender, large_message)
    assert parsed.status_code == 200
    assert parsed.json()["error"]["code"] == JSON_PARSE_ERROR
    for answer in (refused, rest_refused):
        assert answer.status_code == 429, answer.text
        assert answer.headers["content-type"].startswith("application/problem+json")
        assert answer.json()["code"] == "rate_limited"
        assert int(answer.headers["retry-after"]) >= 1
    assert sent.status_code == 200
    assert "result" in sent.json(), sent.text
    assert sent.json()["result"]["task"]["id"], sent.text


def rpc_in_one_write(api: ServedApp, token: str, body: Any) -> tuple[int, Any]:
    """A JSON-RPC call whose head and body go out in one write (httpx writes them apart):
    (status, the answer's JSON). A small body already here whole is read before its token
    is taken (``read_metered_body``): the handler takes it then."""
    content = json.dumps(body).encode()
    head = (
        f"POST /a2a/jsonrpc HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"A2A-Version: 1.0\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(content)}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as sock:
        sock.sendall(head.encode() + content)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    status_line, _, rest = received.partition(b"\r\n")
    _, _, answer = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(answer)


def test_push_config_writes_take_a_token_of_the_tenants_rate(
    settings: Settings, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    """Creating or deleting a push config writes the task's row: a small one, here whole
    before its token was due, took none (an audit, 2026-12-06: at 2 a second, 153 of 200
    creations written in 1.8 s after the tenant's submits were refused 429). Refused, it is
    429 problem+json as a large body out of tokens is: it was JSON-RPC's internal error."""
    _, token = make_key()
    one_token = settings.model_copy(update={"rate_limit_per_s": 0.001, "rate_limit_burst": 1})
    with ServedApp(create_app(one_token)) as api:
        task_id = sent_message(api, token, str(uuid.uuid4()), {"a": 1})  # the one token
        config = {"taskId": task_id, "id": "p", "url": "https://example.com/hook"}
        calls = [
            ("CreateTaskPushNotificationConfig", config),
            ("DeleteTaskPushNotificationConfig", {"taskId": task_id, "id": "p"}),
        ]
        answers = [
            rpc_in_one_write(api, token, {"jsonrpc": "2.0", "id": 1, "method": m, "params": p})
            for m, p in calls
        ]
    for status, answer in answers:
        assert status == 429, answer
        assert answer["code"] == "rate_limited", answer


def test_a_rest_list_whose_status_names_no_task_state_is_invalid_params(
    api: ServedApp, make_key: KeyMaker
) -> None:
    """The SDK reads query parameters ignoring what it cannot read: ``status=BOGUS`` listed
    every task of the key's, as no filter."""
    _, token = make_key()

    refused = [rest_get(api, token, "/tasks", status=s) for s in ("BOGUS", "working", "99")]
    listed = [rest_get(api, token, "/tasks", status=s) for s in ("TASK_STATE_SUBMITTED", "1", "")]

    assert [(a.status_code, a.json()["error"]["status"]) for a in refused] == [
        (400, "INVALID_ARGUMENT")
    ] * 3, [a.text for a in refused]
    assert [a.status_code for a in listed] == [200] * 3, [a.text for a in listed]


def test_a_negative_page_size_is_invalid_params_not_a_500_naming_the_sql(
    api: ServedApp, make_key: KeyMaker
) -> None:
    _, token = make_key()

    listed = {"jsonrpc": "2.0", "id": 1, "method": "ListTasks", "params": {"pageSize": -5}}
    json_rpc = rpc(api, token, listed)
    rest = rest_get(api, token, "/tasks", pageSize="-5")

    assert json_rpc.status_code == 200, json_rpc.text
    assert json_rpc.json()["error"]["code"] == -32602, json_rpc.text
    assert rest.status_code == 400, rest.text
    for answer in (json_rpc, rest):
        assert "SELECT" not in answer.text and "psycopg" not in answer.text, answer.text


def test_a_nul_in_a_query_or_path_parameter_is_refused_never_a_500(
    api: ServedApp, make_key: KeyMaker
) -> None:
    """GET parameters never pass the body checks: a NUL that reached Postgres was a 500."""
    _, token = make_key()

    refused = [
        rest_get(api, token, "/tasks", contextId="\x00"),
        rest_get(api, token, "/tasks", contextId="a\x00b", pageSize="5"),
        rest_get(api, token, "/tasks", pageToken="\x00"),
        rest_get(api, token, "/tasks", status="\x00"),
    ]
    not_found = [
        rest_get(api, token, "/tasks/%00"),
        rest_get(api, token, "/tasks/%00/pushNotificationConfigs"),
        rest_get(api, token, "/tasks/%00/pushNotificationConfigs/%00"),
    ]
    in_a_body = rpc(
        api,
        token,
        {"jsonrpc": "2.0", "id": 1, "method": "ListTasks", "params": {"contextId": "\x00"}},
    )

    assert [(a.status_code, a.json()["error"]["status"]) for a in refused] == [
        (400, "INVALID_ARGUMENT")
    ] * len(refused), [a.text for a in refused]
    assert [a.status_code for a in not_found] == [404] * len(not_found), [a.text for a in not_found]
    assert in_a_body.json()["error"]["data"] == {"code": "invalid_string"}


class Broken:
    """Stands in for a service with a bug: each call raises with SQL in its message."""

    def __getattr__(self, name: str) -> Any:
        def raises(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("(psycopg.errors.Bug) [SQL: SELECT secret FROM tasks]")

        return raises


def test_an_unexpected_error_is_an_internal_error_naming_no_detail_of_it(
    settings: Settings, make_key: KeyMaker, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK's JSON-RPC dispatcher answers an unexpected exception with its text as the
    message: ours are logged with their traceback and answered in general terms."""
    _, token = make_key()
    app = create_app(settings)
    app.state.services.canceller = Broken()
    app.state.services.streams = Broken()
    with ServedApp(app) as served:
        cancelled = rpc(
            served,
            token,
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "CancelTask",
                "params": {"id": str(uuid.uuid4())},
            },
        )
        streamed = rpc(
            served,
            token,
            {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "SendStreamingMessage",
                "params": {
                    "message": {
                        "messageId": str(uuid.uuid4()),
                        "role": "ROLE_USER",
                        "parts": [{"text": "hi"}],
                        "metadata": {"capability": "echo"},
                    }
                },
            },
        )
        rest = httpx.post(
            f"{served.url}{REST}/tasks/{uuid.uuid4()}:cancel",
            json={},
            headers={**A2A_VERSION, "Authorization": f"Bearer {token}"},
            timeout=30,
        )

    for answer in (cancelled, streamed):
        assert answer.json()["error"]["code"] == -32603, answer.text
    assert rest.status_code == 500, rest.text
    for answer in (cancelled, streamed, rest):
        assert "SELECT" not in answer.text and "psycopg" not in answer.text, answer.text
    # and the server's log has it all, traceback included
    logged = [r.exc_info[1] for r in caplog.records if r.name == "reach.api" and r.exc_info]
    assert len([exc for exc in logged if "SELECT secret" in str(exc)]) == 3


@pytest.fixture
def signed_tenant(api: ServedApp, make_key: KeyMaker) -> tuple[str, str]:
    """A fresh tenant with its callback secret (its tenant admin made it): (tenant, secret)."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    _, admin = make_key(tenant=tenant, tenant_admin=True)
    answer = httpx.post(f"{api.url}/callbacks/secret", headers={"Authorization": f"Bearer {admin}"})
    assert answer.status_code == 201, answer.text
    return tenant, answer.json()["secret"]


def test_a_push_config_sent_with_the_message_delivers_the_finished_task_signed(
    a2a: Clients, signed_tenant: tuple[str, str]
) -> None:
    tenant, secret = signed_tenant

    async def run() -> None:
        client, _ = await a2a(tenant=tenant)
        with Receiver() as receiver:
            push = TaskPushNotificationConfig(url=receiver.url, token="tok-1")
            push.authentication.CopyFrom(AuthenticationInfo(scheme="Bearer", credentials="c-1"))
            sent = await collect(
                client.send_message(
                    SendMessageRequest(
                        message=message("echo", data={"a": 1}),
                        configuration=SendMessageConfiguration(
                            return_immediately=True, task_push_notification_config=push
                        ),
                    )
                )
            )
            task_id = sent[-1].task.id
            [call] = await asyncio.to_thread(receiver.wait_for, 1)
        body = json.loads(call.body)
        assert body["task"]["id"] == task_id
        assert body["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
        assert body["task"]["artifacts"][0]["parts"][0]["data"] == {"a": 1}
        assert call.headers["x-a2a-notification-token"] == "tok-1"
        assert call.headers["authorization"] == "Bearer c-1"
        Webhook(secret).verify(call.body, call.headers)  # raises unless signed by the tenant

    a2a.run(run)


def test_push_configs_are_created_read_listed_and_deleted_on_a_running_task(
    a2a: Clients, signed_tenant: tuple[str, str]
) -> None:
    tenant, _ = signed_tenant

    async def run() -> None:
        client, _ = await a2a(tenant=tenant)
        with Receiver() as receiver:
            task_id = await sent_at_once(client, message("test.sleepy", data={"sleep_s": 1.5}))
            created = await client.create_task_push_notification_config(
                TaskPushNotificationConfig(task_id=task_id, id="mine", url=receiver.url)
            )
            assert (created.id, created.task_id, created.url) == ("mine", task_id, receiver.url)
            got = await client.get_task_push_notification_config(
                GetTaskPushNotificationConfigRequest(task_id=task_id, id="mine")
            )
            assert got.url == receiver.url
            listed = await client.list_task_push_notification_configs(
                ListTaskPushNotificationConfigsRequest(task_id=task_id)
            )
            assert [c.id for c in listed.configs] == ["mine"]
            [call] = await asyncio.to_thread(receiver.wait_for, 1)
            assert json.loads(call.body)["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
        await client.delete_task_push_notification_config(
            DeleteTaskPushNotificationConfigRequest(task_id=task_id, id="mine")
        )
        empty = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task_id)
        )
        assert list(empty.configs) == []

    a2a.run(run)


def test_a_push_config_to_a_refused_address_is_invalid_params(
    a2a: Clients, signed_tenant: tuple[str, str]
) -> None:
    tenant, _ = signed_tenant

    async def run() -> None:
        client, _ = await a2a(tenant=tenant)
        sent = await collect(
            client.send_message(SendMessageRequest(message=message("echo", data={})))
        )
        with pytest.raises(InvalidParamsError) as refused:
            await client.create_task_push_notification_config(
                TaskPushNotificationConfig(
                    task_id=sent[-1].task.id, url="http://169.254.169.254/latest/meta-data"
                )
            )
        assert (refused.value.data or {}).get("code") == "url_not_allowed"

    a2a.run(run)


@pytest.mark.parametrize(
    "config",
    [
        {"token": "a" * 20_000},
        {"token": "ok\r\nX-Injected: yes"},
        {"id": "i" * 65},
        {"authentication": AuthenticationInfo(scheme="Bearer", credentials="c" * 20_000)},
        {"authentication": AuthenticationInfo(scheme="Bear er", credentials="c")},
    ],
    ids=[
        "a 20 KB token",
        "a token with a line break",
        "a long id",
        "long credentials",
        "a bad scheme",
    ],
)
def test_a_push_config_too_large_or_unfit_for_a_header_is_invalid_params_and_not_kept(
    a2a: Clients, signed_tenant: tuple[str, str], config: dict[str, Any]
) -> None:
    """Its fields are kept in the task's row, which the tenant's quota counts as 1 KiB, and go
    out as header values with every push: a 1 MiB token on each of a tenant's tasks held a
    thousand times what was counted."""
    tenant, _ = signed_tenant

    async def run() -> None:
        client, _ = await a2a(tenant=tenant)
        sent = await collect(
            client.send_message(SendMessageRequest(message=message("echo", data={})))
        )
        task_id = sent[-1].task.id
        with Receiver() as receiver:
            await refused(task_id, receiver.url)
        listed = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task_id)
        )
        assert list(listed.configs) == []

    async def refused(task_id: str, url: str) -> None:
        client, _ = await a2a(tenant=tenant)
        with pytest.raises(InvalidParamsError) as created:
            await client.create_task_push_notification_config(
                TaskPushNotificationConfig(task_id=task_id, url=url, **config)
            )
        assert "push config" in str(created.value.message), created.value
        with pytest.raises(InvalidParamsError) as sent:
            await collect(
                client.send_message(
                    SendMessageRequest(
                        message=message("echo", data={}),
                        configuration=SendMessageConfiguration(
                            task_push_notification_config=TaskPushNotificationConfig(
                                url=url, **config
                            )
                        ),
                    )
                )
            )
        assert "push config" in str(sent.value.message), sent.value

    a2a.run(run)


def test_the_context_id_is_the_session_and_lists_filter_by_it(
    a2a: Clients, api: ServedApp, make_key: KeyMaker
) -> None:
    tenant, token = make_key()
    answer = httpx.post(
        f"{api.url}/sessions", json={}, headers={"Authorization": f"Bearer {token}"}
    )
    assert answer.status_code == 201, answer.text
    session_id = answer.json()["session_id"]

    async def run() -> None:
        client, _ = await a2a(tenant=tenant)
        in_session = message("echo", data={"turn": 1}, context=session_id)
        done = await collect(client.send_message(SendMessageRequest(message=in_session)))
        await collect(client.send_message(SendMessageRequest(message=message("echo", data={}))))
        assert done[-1].task.context_id == session_id
        listed = await client.list_tasks(ListTasksRequest(context_id=session_id))
        assert [t.id for t in listed.tasks] == [done[-1].task.id]

    a2a.run(run)


def test_the_a2a_routes_show_in_the_openapi_document_as_they_answer(
    api: ServedApp, make_key: KeyMaker
) -> None:
    paths = httpx.get(f"{api.url}/openapi.json").json()["paths"]
    assert {"/.well-known/agent-card.json", "/a2a/jsonrpc", "/a2a/rest/message:send"} <= set(paths)
    # Each REST route answers in the media type the document gives it (FastAPI's
    # application/json before), wants the key it says, and refuses a missing one as said
    listed = paths["/a2a/rest/tasks"]["get"]
    assert listed["security"] == [{"bearer": []}]
    _, token = make_key()
    url = f"{api.url}/a2a/rest/tasks"
    ok = httpx.get(url, headers={**A2A_VERSION, "Authorization": f"Bearer {token}"})
    assert ok.status_code == 200, ok.text
    assert list(listed["responses"]["200"]["content"]) == [ok.headers["content-type"]]
    refused = httpx.get(url, headers=A2A_VERSION)
    assert refused.status_code == 401
    assert list(listed["responses"]["401"]["content"]) == [refused.headers["content-type"]]
    assert "security" not in paths["/.well-known/agent-card.json"]["get"]


def test_a_task_sent_through_one_api_process_is_streamed_and_read_through_another(
    a2a: Clients, settings: Settings, make_key: KeyMaker, redis_url: str
) -> None:
    """A2A tasks live in our tables and event log, not in an API process's memory."""
    with ServedApp(create_app(settings)) as other:
        elsewhere = Clients(other, make_key)

        async def run() -> None:
            tenant = f"t-{uuid.uuid4().hex[:8]}"
            here, _ = await a2a(tenant=tenant)
            there, _ = await elsewhere(tenant=tenant, streaming=True)
            # A task that waits at a gate until the other process has subscribed: one that ran
            # a while on its own had ended, on a loaded machine, before the subscribe came in
            # (refused: "the task is already succeeded").
            gate = uuid.uuid4().hex
            gated = {"gate": gate, "sleep_s": 0}
            task_id = await sent_at_once(here, message("test.sleepy", data=gated))
            subscribed = there.subscribe(SubscribeToTaskRequest(id=task_id))
            first = await anext(subscribed)
            assert first.HasField("task") and first.task.status.state in (
                TaskState.TASK_STATE_SUBMITTED,
                TaskState.TASK_STATE_WORKING,
            )
            redis.Redis.from_url(redis_url).set(GATE_KEY.format(gate), 1, ex=300)
            streamed = [first, *await collect(subscribed)]
            assert streamed[-1].status_update.status.state == TaskState.TASK_STATE_COMPLETED
            read = await there.get_task(GetTaskRequest(id=task_id))
            assert read.status.state == TaskState.TASK_STATE_COMPLETED
            for http in elsewhere.opened:
                await http.aclose()

        a2a.run(run)


def test_a_tenant_holding_its_most_streams_is_refused_another_before_a_task_is_written(
    settings: Settings, make_key: KeyMaker, worker: CeleryProcess, engine: Engine
) -> None:
    """The stream slots of ``POST /tasks`` (``api.sse.StreamSlots``) hold for A2A streams
    too: a streamed message past them is refused, with no task written, 429 problem+json
    with ``Retry-After`` on both bindings, as ``POST /tasks`` answers (it was JSON-RPC's
    internal error, and REST's 500)."""
    tenant, token = make_key()

    def tasks_of_tenant() -> int:
        with engine.connect() as conn:
            found = conn.execute(
                text("SELECT count(*) FROM tasks WHERE tenant = :t"), {"t": tenant}
            )
            return int(found.scalar_one())

    with ServedApp(create_app(settings.model_copy(update={"max_streams_per_tenant": 1}))) as api:
        clients = Clients(api, make_key)

        async def run() -> None:
            client, _ = await clients(streaming=True, tenant=tenant)
            sleepy = message("test.sleepy", data={"sleep_s": 3})
            held = client.send_message(SendMessageRequest(message=sleepy))
            first = await anext(held)  # the task: its stream is open
            written = await asyncio.to_thread(tasks_of_tenant)
            with pytest.raises(A2AClientError, match="429"):
                await collect(client.send_message(SendMessageRequest(message=sleepy)))
            refused = await asyncio.to_thread(streamed_on_both_bindings, api, token)
            assert await asyncio.to_thread(tasks_of_tenant) == written
            for answer in refused:
                assert answer.status_code == 429, answer.text
                assert answer.headers["content-type"].startswith("application/problem+json")
                assert answer.json()["code"] == "too_many_streams"
                assert int(answer.headers["retry-after"]) >= 1
            # Its own stream goes on to the end, and frees the slot for the next
            rest = await collect(held)
            assert first.task.id and rest[-1].status_update.status.state == (
                TaskState.TASK_STATE_COMPLETED
            )
            nxt = message("test.sleepy", data={"sleep_s": 0.1})  # a new message: a new task
            again = await collect(client.send_message(SendMessageRequest(message=nxt)))
            assert again[0].task.id != first.task.id
            assert again[-1].status_update.status.state == TaskState.TASK_STATE_COMPLETED

        clients.run(run)


def streamed_on_both_bindings(api: ServedApp, token: str) -> list[httpx.Response]:
    """A streamed message to echo over JSON-RPC, then over REST: the answers, unread past
    their head when they stream."""
    body = send_message_body([{"text": "hi"}])
    body["method"] = "SendStreamingMessage"
    headers = {**A2A_VERSION, "Authorization": f"Bearer {token}"}
    answers = []
    with httpx.Client(timeout=30, headers=headers) as http:
        for url, sent in [
            (f"{api.url}/a2a/jsonrpc", body),
            (f"{api.url}{REST}/message:stream", body["params"]),
        ]:
            with http.stream("POST", url, json=sent) as answer:
                if answer.status_code != 200:
                    answer.read()
                answers.append(answer)
    return answers


def _states(events: list[StreamResponse]) -> list[str]:
    found = []
    for event in events:
        if event.HasField("task"):
            found.append(TaskState.Name(event.task.status.state))
        elif event.HasField("status_update"):
            found.append(TaskState.Name(event.status_update.status.state))
    return found


def test_a_resent_stream_of_a_finished_task_is_that_task_and_nothing_more(a2a: Clients) -> None:
    async def run() -> None:
        client, _ = await a2a(streaming=True)
        # Given a streamed message whose task completed
        sent = message("echo", data={"n": 1})
        first = await collect(client.send_message(SendMessageRequest(message=sent)))
        assert _states(first)[-1] == "TASK_STATE_COMPLETED"
        # When the same message (its messageId) is streamed again
        again = await collect(client.send_message(SendMessageRequest(message=sent)))
        # Then the stream is the same task, completed, and ends there: no state after a
        # terminal one (its whole log again went back to SUBMITTED and WORKING)
        assert again[0].task.id == first[0].task.id
        assert _states(again) == ["TASK_STATE_COMPLETED"], _states(again)

    a2a.run(run)


def test_a_resent_stream_of_a_running_task_goes_on_from_where_it_stands(a2a: Clients) -> None:
    async def run() -> None:
        client, _ = await a2a(streaming=True)
        # Given a streamed message whose task is working
        sent = message("test.sleepy", data={"sleep_s": 2})
        stream = client.send_message(SendMessageRequest(message=sent))
        async for event in stream:
            if event.HasField("status_update") and (
                event.status_update.status.state == TaskState.TASK_STATE_WORKING
            ):
                break
        # When the same message is streamed again
        again = await collect(client.send_message(SendMessageRequest(message=sent)))
        await stream.aclose()
        # Then it starts at WORKING and goes on to COMPLETED, never back to SUBMITTED
        states = _states(again)
        assert states[0] == "TASK_STATE_WORKING" and states[-1] == "TASK_STATE_COMPLETED", states
        assert "TASK_STATE_SUBMITTED" not in states, states

    a2a.run(run)
