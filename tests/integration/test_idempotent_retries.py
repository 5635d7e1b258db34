"""A retry of a task already accepted is answered with that task, whatever the checks of new
work say now. The same key with the same payload returns the first task (README); before,
checks that only judge new work ran first and refused the retry: 422 `session_not_found`
once the task's session had gone idle past its TTL or been deleted, 503
`no_agent_available` once its capability's agent had stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.stack import start_worker, wait_for_task
from tests.integration.test_session_turns import new_session, wait_expired

FINAL = {"succeeded", "failed", "cancelled", "expired"}


def accepted_and_done(client: httpx.Client, envelope: dict[str, Any]) -> str:
    first = client.post("/tasks", json=envelope)
    assert first.status_code == 202, first.text
    task_id: str = first.json()["task_id"]
    assert wait_for_task(client, task_id, FINAL)["status"] == "succeeded"
    return task_id


def assert_replayed(answer: httpx.Response, task_id: str) -> None:
    assert (answer.status_code, answer.headers.get("idempotent-replayed")) == (202, "true"), (
        answer.text
    )
    assert answer.json()["task_id"] == task_id


def in_session(session_id: str, key: str) -> dict[str, Any]:
    return {
        "capability": "echo",
        "payload": {"text": "hi"},
        "session_id": session_id,
        "idempotency_key": key,
    }


def test_a_retry_after_its_session_expired_gets_the_first_task(client: httpx.Client) -> None:
    session_id = new_session(client, ttl_s=1)
    envelope = in_session(session_id, "retry-session-expired")
    task_id = accepted_and_done(client, envelope)
    wait_expired(client, session_id)
    assert_replayed(client.post("/tasks", json=envelope), task_id)
    # while a new task in that session is refused
    refused = client.post("/tasks", json={**envelope, "idempotency_key": "another"})
    assert (refused.status_code, refused.json()["code"]) == (422, "session_not_found")


def test_a_retry_after_its_session_was_deleted_gets_the_first_task(client: httpx.Client) -> None:
    session_id = new_session(client)
    envelope = in_session(session_id, "retry-session-deleted")
    task_id = accepted_and_done(client, envelope)
    assert client.delete(f"/sessions/{session_id}").status_code == 204
    assert_replayed(client.post("/tasks", json=envelope), task_id)


def test_a_retry_after_its_agent_stopped_gets_the_first_task(
    client: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    solo = start_worker(settings, "test.solo", "solo-retries", log_dir, concurrency=1)
    envelope = {"capability": "test.solo", "payload": {"n": 1}, "idempotency_key": "retry-solo"}
    try:
        task_id = accepted_and_done(client, envelope)
    finally:
        solo.stop()
    # Given no agent of the capability any more: new work is refused
    eventually(
        lambda: client.post("/tasks", json={"capability": "test.solo", "payload": {}}).status_code,
        "no agent",
        30,
        0.5,
        (503).__eq__,
    )
    # When the first submit is sent again, Then it gets its task
    assert_replayed(client.post("/tasks", json=envelope), task_id)
    # And the same key with another payload is still refused as a reused key
    other = client.post("/tasks", json={**envelope, "payload": {"n": 2}})
    assert (other.status_code, other.json()["code"]) == (422, "idempotency_key_reused")
