"""An A2A blocking message and an MCP tool call whose task goes with its TTL while they wait
answer it ``expired`` with ``ttl_exceeded``, as a REST sync wait does
(``test_streams_end.py``): not the task as it was accepted, queued, though gone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from a2a.types import SendMessageRequest, TaskState

from api.app import create_app
from broker.remote.a2a_json import to_json
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import CeleryProcess, ServedApp
from tests.integration.test_a2a_facade import Clients, collect, message
from tests.integration.test_mcp import connected

# The test worker runs two test.sleepy tasks at once: two long ones hold it, so a third waits
# in its queue, longer than the two seconds its tasks are kept.
HOLDERS = 2
HOLD_S = 30


@pytest.fixture
def short_lived(settings: Settings, worker: CeleryProcess) -> Iterator[ServedApp]:
    """An API that keeps a task two seconds unless told otherwise, and whose A2A and MCP
    waits may last 40 s."""
    tuned = settings.model_copy(update={"result_ttl_s": 2, "sync_max_wait_s": 40, "mcp_wait_s": 40})
    with ServedApp(create_app(tuned)) as served:
        yield served


@pytest.fixture
def held_worker(short_lived: ServedApp, make_key: KeyMaker) -> Iterator[str]:
    """The tenant's token, with the worker's test.sleepy slots held by long tasks (kept a
    minute), cancelled at the end."""
    _, token = make_key(None, None)
    with client_for(short_lived, token) as http:
        sleeping = {"sleep_s": HOLD_S}
        ids = [
            http.post(
                "/tasks",
                json={"capability": "test.sleepy", "payload": sleeping, "result_ttl_s": 60},
            ).json()["task_id"]
            for _ in range(HOLDERS)
        ]
        try:
            eventually(
                lambda: [http.get(f"/tasks/{i}").json()["status"] for i in ids],
                "the worker's test.sleepy slots held",
                until=lambda statuses: statuses == ["running"] * HOLDERS,
            )
            yield token
        finally:
            for task_id in ids:
                http.post(f"/tasks/{task_id}/cancel")


def queued_past_its_ttl(http: httpx.Client, task_id: str) -> None:
    """Ended ``ttl_exceeded`` by the janitor, when one ran in time (its row kept a TTL more),
    else gone."""
    answer = http.get(f"/tasks/{task_id}")
    if answer.status_code == 200:
        ended = answer.json()
        assert (ended["status"], ended["error"]["code"]) == ("expired", "ttl_exceeded")
    else:
        assert answer.status_code == 404, answer.text


def test_an_a2a_blocking_message_whose_task_goes_with_its_ttl_answers_it_failed_ttl_exceeded(
    short_lived: ServedApp, make_key: KeyMaker, held_worker: str
) -> None:
    a2a = Clients(short_lived, make_key)

    async def run() -> None:
        client, _ = await a2a()
        # Given a blocking message whose task waits behind the held worker, kept two seconds
        sent = message("test.sleepy", data={"sleep_s": 0})
        # When its TTL passes while the message waits
        events = await collect(client.send_message(SendMessageRequest(message=sent)))
        # Then the answer is the task expired with its TTL (A2A's FAILED), not submitted
        task = events[-1].task
        assert task.status.state == TaskState.TASK_STATE_FAILED, task
        reach = to_json(task.metadata)["reach"]
        assert reach["status"] == "expired"
        assert reach["error"]["code"] == "ttl_exceeded"
        assert to_json(task.metadata)["capability"] == "test.sleepy"
        with client_for(short_lived, held_worker) as http:
            queued_past_its_ttl(http, task.id)

    a2a.run(run)


def test_an_mcp_tool_call_whose_task_goes_with_its_ttl_is_a_tool_error_ttl_exceeded(
    short_lived: ServedApp, held_worker: str
) -> None:
    async def call() -> dict[str, object]:
        async with connected(short_lived, held_worker) as client:
            # Given a tool call whose task waits behind the held worker, kept two seconds
            # When its TTL passes while the call waits
            answer = await client.call_tool("test.sleepy", {"sleep_s": 0})
            # Then the call ends with a tool error: the task expired with its TTL, not a
            # task id to poll for a task that is gone
            assert answer.is_error
            assert isinstance(answer.structured_content, dict)
            return answer.structured_content

    content = asyncio.run(call())
    assert content["status"] == "expired"
    assert isinstance(content["error"], dict) and content["error"]["code"] == "ttl_exceeded"
    with client_for(short_lived, held_worker) as http:
        queued_past_its_ttl(http, str(content["task_id"]))
