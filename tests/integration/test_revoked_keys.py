"""A key revoked while its streams and waits are open: each ends without the task's outcome
(as a new request with the key would be refused), and the task itself still finishes, its
tenant's to read with another key.

The API here caches keys for 0 s (``uncached_api``); the task sleeps long past the quiet
spell (2 s) after which an open stream or wait looks at its key again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import pytest
from a2a.types import SendMessageRequest, SubscribeToTaskRequest, TaskState
from a2a.utils.errors import A2AError
from mcp_types import CallToolResult
from sqlalchemy import Engine

from broker.tenancy import key_store
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import CeleryProcess, ServedApp, wait_for_task
from tests.integration.test_a2a_facade import Clients, message, sent_at_once
from tests.integration.test_mcp import connected
from tests.integration.test_replies import frames

SLEEP_S = 8
FINAL = {"succeeded", "failed", "cancelled", "expired"}
T = TypeVar("T")


def key_id(token: str) -> str:
    return token.split("_")[1]


def running_sleeper(http: httpx.Client) -> str:
    """The id of the tenant's ``test.sleepy`` task, once it runs."""
    running = eventually(
        lambda: http.get(
            "/tasks", params={"capability": "test.sleepy", "status": "running"}
        ).json()["tasks"],
        "the sleeper to run",
    )
    return str(running[0]["task_id"])


def revoked_while(waiting: Callable[[], T], http: httpx.Client, engine: Engine, token: str) -> T:
    """``waiting()`` (a request that holds its answer until the task ends) in a thread, the
    key revoked once the task runs: what it answered."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(waiting)
        running_sleeper(http)
        assert key_store.revoke_key(engine, key_id(token))
        return answer.result(timeout=60)


def test_an_sse_stream_ends_without_the_outcome_once_its_key_is_revoked(
    uncached_api: ServedApp, make_key: KeyMaker, engine: Engine, worker: CeleryProcess
) -> None:
    # given a task's event stream open with a key
    tenant, token = make_key()
    _, other = make_key(tenant=tenant)
    with client_for(uncached_api, token) as http, client_for(uncached_api, other) as reader:
        task_id = http.post(
            "/tasks", json={"capability": "test.sleepy", "payload": {"sleep_s": SLEEP_S}}
        ).json()["task_id"]
        with http.stream("GET", f"/tasks/{task_id}/events") as response:
            assert response.status_code == 200
            seen, stream = [], frames(response.iter_lines())
            for frame in stream:
                seen.append(frame)
                if frame.get("event") == "status" and frame["data"]["data"]["status"] == "running":
                    # when the key is revoked while the task runs
                    assert key_store.revoke_key(engine, key_id(token))
                    break
            # expect the stream to end, cleanly, before the task's final event
            seen += list(stream)
        assert not FINAL & {str(frame.get("event")) for frame in seen}
        assert http.get(f"/tasks/{task_id}").status_code == 401
        # and the task to finish all the same, for the tenant's other keys
        assert wait_for_task(reader, task_id, FINAL)["status"] == "succeeded"


def test_a_sync_wait_answers_401_once_its_key_is_revoked(
    uncached_api: ServedApp, make_key: KeyMaker, engine: Engine, worker: CeleryProcess
) -> None:
    # given a sync submit waiting for its task (the wait is longer than the task)
    tenant, token = make_key()
    _, other = make_key(tenant=tenant)
    envelope = {"capability": "test.sleepy", "reply_mode": "sync", "payload": {"sleep_s": SLEEP_S}}
    with client_for(uncached_api, token) as http, client_for(uncached_api, other) as reader:
        # when the key is revoked while the task runs
        answer = revoked_while(lambda: http.post("/tasks", json=envelope), reader, engine, token)
        # expect 401, as a new request with the key would get, not the finished task
        assert answer.status_code == 401, answer.text
        assert answer.json()["code"] == "unauthenticated"
        # and the task to finish all the same
        task_id = only_sleeper(reader)
        assert wait_for_task(reader, task_id, FINAL)["status"] == "succeeded"


def only_sleeper(http: httpx.Client) -> str:
    """The id of the tenant's one ``test.sleepy`` task."""
    listed = http.get("/tasks", params={"capability": "test.sleepy"}).json()["tasks"]
    assert len(listed) == 1
    return str(listed[0]["task_id"])


# The REST binding's SubscribeToTask is a bodiless POST, which the A2A routes' body check
# refuses (400) before the SDK runs: REST is driven here through a streamed message.
@pytest.mark.parametrize(
    ("binding", "method"), [("JSONRPC", "SubscribeToTask"), ("HTTP+JSON", "SendStreamingMessage")]
)
def test_an_a2a_stream_ends_with_an_error_once_its_key_is_revoked(
    uncached_api: ServedApp,
    make_key: KeyMaker,
    engine: Engine,
    worker: CeleryProcess,
    binding: str,
    method: str,
) -> None:
    tokens: list[str] = []

    def recorded(*args: Any, **kwargs: Any) -> tuple[str, str]:
        made = make_key(*args, **kwargs)
        tokens.append(made[1])
        return made

    clients = Clients(uncached_api, recorded)
    tenant, other = make_key()

    async def run() -> None:
        # given an A2A stream of a long task, with a key of its own
        sender, _ = await clients(tenant=tenant)
        watcher, _ = await clients(tenant=tenant, streaming=True, binding=binding)
        sleepy = message("test.sleepy", data={"sleep_s": SLEEP_S})
        if method == "SubscribeToTask":
            task_id = await sent_at_once(sender, sleepy)
            stream = watcher.subscribe(SubscribeToTaskRequest(id=task_id))
        else:
            stream = watcher.send_message(SendMessageRequest(message=sleepy))
        first = await anext(stream)
        assert first.HasField("task")
        # when its key is revoked
        assert await asyncio.to_thread(key_store.revoke_key, engine, key_id(tokens[-1]))
        # expect the stream to end with the SDK's error, before the task's artifact or state
        seen = []
        with pytest.raises(A2AError) as ended:
            async with asyncio.timeout(60):  # bounds a hang
                async for event in stream:
                    seen.append(event)
        assert "API key" in str(ended.value)
        assert not any(event.HasField("artifact_update") for event in seen)
        states = {event.status_update.status.state for event in seen}
        assert TaskState.TASK_STATE_COMPLETED not in states
        # and the task to finish all the same, for the tenant's other keys
        done = await asyncio.to_thread(finished, uncached_api, other, first.task.id)
        assert done["status"] == "succeeded"

    clients.run(run)


def finished(api: ServedApp, token: str, task_id: str) -> dict[str, object]:
    with client_for(api, token) as http:
        return wait_for_task(http, task_id, FINAL)


def test_an_mcp_tool_call_waiting_ends_refused_once_its_key_is_revoked(
    uncached_api: ServedApp, make_key: KeyMaker, engine: Engine, worker: CeleryProcess
) -> None:
    # given a tool call waiting for its task (the MCP wait is longer than the task)
    tenant, token = make_key()
    _, other = make_key(tenant=tenant)
    with client_for(uncached_api, other) as reader:
        # when the key is revoked while the task runs
        answer = revoked_while(lambda: called_sleeper(uncached_api, token), reader, engine, token)
        # expect the call refused as unauthenticated, without the task's result
        assert answer.is_error
        assert answer.structured_content is not None
        assert answer.structured_content["error"]["code"] == "unauthenticated"
        # and the task to finish all the same
        task_id = only_sleeper(reader)
        assert wait_for_task(reader, task_id, FINAL)["status"] == "succeeded"


def called_sleeper(api: ServedApp, token: str) -> CallToolResult:
    async def one() -> CallToolResult:
        async with connected(api, token) as client:
            # The client checks a result against the tool's schema, listing the tools first
            # if it has not: listed now, while the key is valid.
            await client.list_tools()
            return await client.call_tool("test.sleepy", {"sleep_s": SLEEP_S})

    return asyncio.run(one())
