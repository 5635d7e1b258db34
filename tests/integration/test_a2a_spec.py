"""What A2A 1.0 requires of the facade, through the running API and a worker: a resubscribe
that ends on the task's final event however close to it it comes, a context on every task,
a skill on the public card, the SDK's checks of a request's fields, pages and history, and
file parts refused as a content type not taken."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from a2a.types import (
    GetTaskRequest,
    ListTasksRequest,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskState,
)
from a2a.utils.errors import TaskNotFoundError
from sqlalchemy import Engine

from api.a2a import REST_PATH, ReachRequestHandler
from broker.tasks.eventhub import EventHub
from broker.tasks.resource import TaskRow
from broker.tenancy.keys import Principal
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import CeleryProcess, ServedApp, wait_for_task
from tests.integration.test_a2a_facade import (
    A2A_VERSION,
    Clients,
    collect,
    message,
    rest_get,
    rpc,
    send_message_body,
    sent_at_once,
)
from tests.integration.test_revoked_keys import SLEEP_S, revoked_while

CONTENT_TYPE_NOT_SUPPORTED, INVALID_PARAMS = -32005, -32602
ECHO = {"capability": "echo", "payload": {}}
# A task without a session has the context ``task_<its id>`` (the README's A2A section).
TASK_CONTEXT_PREFIX = "task_"


@pytest.fixture
def a2a(api: ServedApp, make_key: KeyMaker, worker: CeleryProcess) -> Clients:
    return Clients(api, make_key)


def rpc_error(api: ServedApp, token: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """The JSON-RPC error ``method`` answers with ``params`` (the test fails on a result)."""
    answer = rpc(api, token, {"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    assert answer.status_code == 200, answer.text
    assert "error" in answer.json(), answer.text
    error: dict[str, Any] = answer.json()["error"]
    return error


def test_a_task_that_ends_between_the_subscribes_reads_is_streamed_to_its_final_event(
    a2a: Clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SubscribeToTask read the task, then where its log stood: a task that ended between
    the two had its final event behind that place, and the stream ended on WORKING with
    nothing more. Here the task is cancelled right after the subscribe has read it (the
    second time: the first, before the log, only checks that the caller may see it)."""
    read_then_cancelled: set[str] = set()
    reads: dict[str, int] = {}
    read = ReachRequestHandler._visible

    async def cancelled_once_read(
        self: ReachRequestHandler, caller: Principal, task_id: str
    ) -> TaskRow:
        row = await read(self, caller, task_id)
        reads[task_id] = reads.get(task_id, 0) + 1
        if task_id in read_then_cancelled and reads[task_id] == 2:
            read_then_cancelled.discard(task_id)
            await self.svc.canceller.cancel_visible(caller, task_id)
        return row

    monkeypatch.setattr(ReachRequestHandler, "_visible", cancelled_once_read)

    async def run() -> None:
        tenant = f"t-{uuid.uuid4().hex[:8]}"
        sender, _ = await a2a(tenant=tenant)
        task_id = await sent_at_once(sender, message("test.sleepy", data={"sleep_s": 20}))
        read_then_cancelled.add(task_id)
        subscriber, _ = await a2a(tenant=tenant, streaming=True)

        streamed = await collect(subscriber.subscribe(SubscribeToTaskRequest(id=task_id)))

        assert not read_then_cancelled  # the subscribe read it, and it was cancelled then
        assert streamed[0].task.status.state != TaskState.TASK_STATE_CANCELED
        assert streamed[-1].status_update.status.state == TaskState.TASK_STATE_CANCELED

    a2a.run(run)


def test_a_subscribe_to_another_tenants_task_is_refused_before_its_log_is_read(
    a2a: Clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SubscribeToTask read the task's whole event log (up to megabytes) before it looked
    the task up: another tenant's task took as long to refuse as its log took to read, and
    so told a task that exists from an unknown id."""
    tallied: list[str] = []
    tally = EventHub.tally

    async def recorded(self: EventHub, task_id: str, event_type: str) -> tuple[int, int]:
        tallied.append(task_id)
        return await tally(self, task_id, event_type)

    monkeypatch.setattr(EventHub, "tally", recorded)

    async def run() -> None:
        tenant = f"t-{uuid.uuid4().hex[:8]}"
        owner, _ = await a2a(tenant=tenant)
        task_id = await sent_at_once(owner, message("test.sleepy", data={"sleep_s": 20}))
        stranger, _ = await a2a(streaming=True)
        with pytest.raises(TaskNotFoundError):
            await collect(stranger.subscribe(SubscribeToTaskRequest(id=task_id)))
        assert task_id not in tallied
        # while the owner's subscribe reads it, as before
        subscriber, _ = await a2a(tenant=tenant, streaming=True)
        stream = subscriber.subscribe(SubscribeToTaskRequest(id=task_id))
        first = await anext(aiter(stream))
        assert first.task.id == task_id
        assert task_id in tallied
        await stream.aclose()

    a2a.run(run)


def test_a_task_without_a_session_has_a_context_of_its_own_on_the_task_and_its_events(
    a2a: Clients,
) -> None:
    """A2A requires ``contextId`` on a task and on each of its events, made by the server
    when the message names none: it was empty."""

    async def run() -> None:
        client, _ = await a2a(streaming=True)
        streamed = await collect(
            client.send_message(SendMessageRequest(message=message("echo", data={"a": 1})))
        )
        task_id = streamed[0].task.id
        context = TASK_CONTEXT_PREFIX + task_id
        contexts = {
            e.task.context_id or e.status_update.context_id or e.artifact_update.context_id
            for e in streamed
        }
        assert contexts == {context}
        assert (await client.get_task(GetTaskRequest(id=task_id))).context_id == context
        listed = await client.list_tasks(ListTasksRequest(context_id=context))
        assert [t.id for t in listed.tasks] == [task_id]

    a2a.run(run)


def test_a_message_naming_a_tasks_own_context_is_refused_saying_why(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    """Such a context holds one task: it is no session to continue (it was taken for a
    session's id: 'no such session')."""
    _, token = make_key()
    context = TASK_CONTEXT_PREFIX + str(uuid.uuid4())
    body = send_message_body([{"text": "again"}])
    body["params"]["message"]["contextId"] = context

    error = rpc(api, token, body).json()["error"]

    assert error["code"] == INVALID_PARAMS
    assert "one task without a session" in error["message"]


def test_the_public_card_has_a_skill_saying_where_the_capabilities_are(api: ServedApp) -> None:
    card = httpx.get(f"{api.url}/.well-known/agent-card.json").json()

    [skill] = card["skills"]  # REQUIRED, at least one
    assert skill["id"] and skill["name"] and skill["tags"]
    assert "extended" in skill["description"]


@pytest.mark.parametrize("missing", ["messageId", "role"])
def test_a_message_without_a_required_field_is_invalid_params_naming_it(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess, missing: str
) -> None:
    """The SDK's own handler checks a request's REQUIRED fields; ours took a message without
    ``messageId`` (what its idempotency is keyed on) or ``role``."""
    _, token = make_key()
    body = send_message_body([{"text": "hi"}], returnImmediately=True)
    del body["params"]["message"][missing]

    error = rpc(api, token, body).json()["error"]

    assert error["code"] == INVALID_PARAMS
    [_, bad_request] = error["data"]  # the SDK's ErrorInfo, then its BadRequest
    fields = [v["field"] for v in bad_request["fieldViolations"]]
    assert fields == [{"messageId": "message.message_id", "role": "message.role"}[missing]]


@pytest.mark.parametrize("page_size", [0, 101])
def test_a_page_size_outside_1_to_100_is_invalid_params(
    api: ServedApp, make_key: KeyMaker, page_size: int
) -> None:
    """It was clamped; A2A (and the SDK's ``validate_page_size``) refuses it."""
    _, token = make_key()

    error = rpc_error(api, token, "ListTasks", {"pageSize": page_size})
    rest = rest_get(api, token, "/tasks", pageSize=str(page_size))

    assert error["code"] == INVALID_PARAMS
    assert rest.status_code == 400, rest.text


def test_a_negative_history_length_is_invalid_params(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    _, token = make_key()
    message_body = send_message_body([{"text": "hi"}], returnImmediately=True, historyLength=-1)

    refused = [
        rpc_error(api, token, "ListTasks", {"historyLength": -1}),
        rpc_error(api, token, "GetTask", {"id": str(uuid.uuid4()), "historyLength": -1}),
        rpc(api, token, message_body).json()["error"],
    ]

    assert [e["code"] for e in refused] == [INVALID_PARAMS] * 3, refused


@pytest.mark.parametrize(
    "parts",
    [
        [{"url": "https://example.com/invoice.pdf", "mediaType": "application/pdf"}],
        [{"text": "read this"}, {"raw": "JVBERi0=", "mediaType": "application/pdf"}],
    ],
    ids=["a file alone", "a file beside text"],
)
def test_a_file_part_is_a_content_type_not_supported(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess, parts: list[dict[str, Any]]
) -> None:
    """The card takes JSON and plain text: a file alone was -32602 "neither a data part nor
    a text part", and one beside text was dropped without a word."""
    _, token = make_key()

    answer = rpc(api, token, send_message_body(parts, returnImmediately=True)).json()

    assert answer.get("error", {}).get("code") == CONTENT_TYPE_NOT_SUPPORTED, answer


@pytest.mark.parametrize("binding", ["jsonrpc", "rest"])
def test_a_key_revoked_during_a_blocking_message_is_401_problem_json(
    uncached_api: ServedApp,
    make_key: KeyMaker,
    engine: Engine,
    worker: CeleryProcess,
    binding: str,
) -> None:
    """A2A has no error for a key: the wait's refusal was -32602 (REST: 400). It is answered
    as the API answers a key it does not take, as nothing of the answer was sent yet."""
    tenant, token = make_key()
    _, other = make_key(tenant=tenant)
    body = send_message_body(
        [{"data": {"sleep_s": SLEEP_S}}], metadata={"capability": "test.sleepy"}
    )

    def sent() -> httpx.Response:
        if binding == "jsonrpc":
            return rpc(uncached_api, token, body)
        headers = {**A2A_VERSION, "Authorization": f"Bearer {token}"}
        url = f"{uncached_api.url}{REST_PATH}/message:send"
        return httpx.post(url, json=body["params"], headers=headers, timeout=60)

    with client_for(uncached_api, other) as reader:
        answer = revoked_while(sent, reader, engine, token)

    assert answer.status_code == 401, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.headers["www-authenticate"] == "Bearer"
    assert answer.json()["code"] == "unauthenticated"


def test_list_tasks_counts_every_page_and_filters_by_when_the_status_moved(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    """``totalSize`` was the page's length, and ``statusTimestampAfter`` filtered nothing."""
    _, token = make_key()
    with client_for(api, token) as http:
        # Given three tasks of the key's, the third accepted after the first two had ended
        first = [http.post("/tasks", json=ECHO).json()["task_id"] for _ in range(2)]
        ended = [wait_for_task(http, t, {"succeeded"})["finished_at"] for t in first]
        third = http.post("/tasks", json=ECHO).json()["task_id"]
        wait_for_task(http, third, {"succeeded"})

    def listed(**params: Any) -> dict[str, Any]:
        answer = rpc(
            api, token, {"jsonrpc": "2.0", "id": 1, "method": "ListTasks", "params": params}
        )
        assert answer.status_code == 200 and "result" in answer.json(), answer.text
        result: dict[str, Any] = answer.json()["result"]
        return result

    # When they are listed two a page, Then the count is of all three, on each page
    page = listed(pageSize=2)
    assert (len(page["tasks"]), page["totalSize"]) == (2, 3)
    rest = listed(pageSize=2, pageToken=page["nextPageToken"])
    assert (len(rest["tasks"]), rest["totalSize"]) == (1, 3)
    # And since the first two ended, only the third's status moved
    since = listed(statusTimestampAfter=max(ended))
    assert [t["id"] for t in since["tasks"]] == [third]
    assert since["totalSize"] == 1
    assert listed(statusTimestampAfter="2999-01-01T00:00:00Z").get("tasks", []) == []
