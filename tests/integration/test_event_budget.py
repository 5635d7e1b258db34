"""What an agent sends back is bounded: its progress and outputs together take at most a
budget of its task's event log (``events_too_large``), and its result at most
``REACH_MAX_RESULT_BYTES`` (``result_too_large``). Unbounded, one agent streaming large chunks
or returning a large result filled Redis (and Postgres) for every tenant. The broker's own
status events and the final event are not counted: a task past its budget still ends, and its
stream still closes."""

from __future__ import annotations

import uuid

import httpx
import pytest
import redis

from broker.errors import EventsTooLarge
from broker.tasks.events import EventLog, bytes_key, read_log_sync
from tests.integration.stack import CeleryProcess, wait_for_task
from tests.integration.test_replies import read_stream

FINAL = {"succeeded", "failed", "cancelled", "expired"}
MiB = 1024 * 1024


def test_an_agents_events_past_the_budget_are_refused_and_the_final_one_still_goes_in(
    own_redis: str,
) -> None:
    client = redis.Redis.from_url(own_redis)
    log = EventLog(client, 60, max_bytes=1000)
    task_id = uuid.uuid4()
    assert log.append(task_id, "status", {"status": "running"}, trace_id="t", attempt=1) == 1
    assert log.append(task_id, "output", "x" * 600, trace_id="t", attempt=1) == 2
    # The next output would pass 1,000 bytes: refused, and it takes nothing of the budget
    with pytest.raises(EventsTooLarge) as refused:
        log.append(task_id, "output", "y" * 600, trace_id="t", attempt=1)
    assert refused.value.code == "events_too_large"
    taken = int(client.get(bytes_key(task_id)) or 0)
    assert 600 < taken < 1000
    # A progress report is the agent's too, and a small one still fits
    assert log.append(task_id, "progress", {"percent": 50}, trace_id="t", attempt=1) == 3
    with pytest.raises(EventsTooLarge):
        log.append(task_id, "progress", {"percent": 60, "message": "z" * 600}, trace_id="t")
    # The broker's status events and the final event are not counted
    assert log.append(task_id, "status", {"status": "queued", "pad": "q" * 2000}, trace_id="t")
    assert log.append(task_id, "failed", {"result": "r" * 5000}, trace_id="t") == 5
    assert [e.type for e in read_log_sync(client, task_id)] == [
        "status",
        "output",
        "progress",
        "status",
        "failed",
    ]


def test_each_task_has_its_own_budget_even_in_one_group(own_redis: str) -> None:
    client = redis.Redis.from_url(own_redis)
    log = EventLog(client, 60, max_bytes=1000)
    full, other = uuid.uuid4(), uuid.uuid4()
    items = [
        log._item(full, "output", "a" * 700, "t", None),
        log._item(full, "output", "b" * 700, "t", None),
        log._item(other, "output", "c" * 700, "t", None),
    ]
    assert log._append_many_sync(items) == [1, -1, 1]
    assert client.ttl(bytes_key(full)) > 0  # it goes with the log


def test_an_agent_streaming_past_its_budget_fails_events_too_large(
    client: httpx.Client, worker: CeleryProcess
) -> None:
    """Five outputs of 1 MiB against the default budget of 4 MiB: three go out, the fourth is
    refused and fails the task; its stream shows the three, then the final event."""
    task = client.post(
        "/tasks", json={"capability": "test.flood", "payload": {"n": 5, "size": MiB}}
    ).json()
    events = read_stream(client, "GET", f"/tasks/{task['task_id']}/events")
    kinds = [e.get("event") for e in events]
    assert kinds == ["status", "status", "output", "output", "output", "failed"]
    done = wait_for_task(client, task["task_id"], FINAL)
    assert done["status"] == "failed"
    assert done["error"]["code"] == "events_too_large"
    assert done["error"]["retryable"] is False


def test_an_agent_that_catches_the_refusal_goes_on_and_succeeds(
    client: httpx.Client, worker: CeleryProcess
) -> None:
    task = client.post(
        "/tasks",
        json={"capability": "test.flood", "payload": {"n": 5, "size": MiB, "catch": True}},
    ).json()
    done = wait_for_task(client, task["task_id"], FINAL)
    assert done["status"] == "succeeded"
    assert done["result"]["chunks"] == 3


def test_a_result_past_its_limit_fails_result_too_large(
    client: httpx.Client, worker: CeleryProcess
) -> None:
    """The default limit is 4 MiB of JSON; 5 MiB is not stored, 3 MiB is."""
    too_large = client.post(
        "/tasks", json={"capability": "test.flood", "payload": {"n": 0, "result_size": 5 * MiB}}
    ).json()
    fits = client.post(
        "/tasks", json={"capability": "test.flood", "payload": {"n": 0, "result_size": 3 * MiB}}
    ).json()
    failed = wait_for_task(client, too_large["task_id"], FINAL)
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "result_too_large"
    assert failed["result"] is None
    succeeded = wait_for_task(client, fits["task_id"], FINAL)
    assert succeeded["status"] == "succeeded"
    assert len(succeeded["result"]["blob"]) == 3 * MiB
