"""What an agent sends back is bounded: a task's event log holds at most
``REACH_EVENT_LOG_MAX_BYTES`` (its oldest events give way past it, as past 10,000 events; one
event larger than that is refused, ``events_too_large``), and a result at most
``REACH_MAX_RESULT_BYTES`` (``result_too_large``). Unbounded, one agent streaming large chunks
or returning a large result filled Redis (and Postgres) for every tenant. The final event is
always let in: a task still ends, and its stream still closes."""

from __future__ import annotations

import uuid

import httpx
import pytest
import redis

from broker.errors import EventsTooLarge
from broker.settings import Settings
from broker.tasks.events import Event, EventLog, bytes_key, log_key, parse_entries
from tests.integration.stack import CeleryProcess, wait_for_task
from tests.integration.test_replies import read_stream

FINAL = {"succeeded", "failed", "cancelled", "expired"}
MiB = 1024 * 1024


def flood(client: httpx.Client, **payload: object) -> str:
    """A ``test.flood`` task (``tests.agents``) submitted with ``payload``: its id."""
    response = client.post("/tasks", json={"capability": "test.flood", "payload": payload})
    assert response.status_code == 202, response.text
    task_id: str = response.json()["task_id"]
    return task_id


def held(client: redis.Redis, task_id: uuid.UUID) -> tuple[list[Event], int]:
    """The log's events, and the bytes they hold (the final one aside), as Redis stores them."""
    entries = client.xrange(log_key(task_id))
    events = parse_entries(entries)
    raw = [fields[b"e"] for _, fields in entries]
    return events, sum(len(r) for r, e in zip(raw, events, strict=True) if not e.final)


def test_past_its_bytes_the_log_lets_its_oldest_events_go(own_redis: str) -> None:
    client = redis.Redis.from_url(own_redis)
    log = EventLog(client, 60, max_bytes=1000)
    task_id = uuid.uuid4()
    log.append(task_id, "status", {"status": "running"}, tenant="t", trace_id="t", attempt=1)
    for i in range(6):
        log.append(
            task_id, "output", {"i": i, "blob": "x" * 300}, tenant="t", trace_id="t", attempt=1
        )
        events, stored = held(client, task_id)
        # The counter is what the log holds, and that is never more than the budget
        assert int(client.get(bytes_key(task_id)) or 0) == stored <= 1000
        assert events[-1].data["i"] == i  # the newest is always kept
    events, _ = held(client, task_id)
    assert [e.data["i"] for e in events] == [4, 5]
    assert [e.seq for e in events] == [6, 7]
    # The final event is let in whatever its size, and takes nothing of the window
    assert log.append(task_id, "succeeded", {"result": "r" * 5000}, tenant="t", trace_id="t") == 8
    events, _ = held(client, task_id)
    assert [e.type for e in events] == ["output", "output", "succeeded"]
    assert client.ttl(bytes_key(task_id)) > 0  # the counter goes with the log


def test_an_event_larger_than_the_whole_budget_is_refused_and_takes_nothing(
    own_redis: str,
) -> None:
    client = redis.Redis.from_url(own_redis)
    log = EventLog(client, 60, max_bytes=1000)
    task_id = uuid.uuid4()
    assert log.append(task_id, "output", "small", tenant="t", trace_id="t", attempt=1) == 1
    with pytest.raises(EventsTooLarge) as refused:
        log.append(task_id, "output", "y" * 1000, tenant="t", trace_id="t", attempt=1)
    assert refused.value.code == "events_too_large"
    with pytest.raises(EventsTooLarge):
        log.append(
            task_id, "progress", {"percent": 60, "message": "z" * 1000}, tenant="t", trace_id="t"
        )
    assert log.append(task_id, "output", "next", tenant="t", trace_id="t", attempt=1) == 2
    events, stored = held(client, task_id)
    assert [e.data for e in events] == ["small", "next"]
    assert int(client.get(bytes_key(task_id)) or 0) == stored


def test_a_log_lost_before_its_count_is_counted_anew(own_redis: str) -> None:
    """Two keys expire apart, or Redis evicts one: a count left over from a lost log must not
    keep the next log at one event for good."""
    client = redis.Redis.from_url(own_redis)
    log = EventLog(client, 60, max_bytes=1000)
    task_id = uuid.uuid4()
    client.set(bytes_key(task_id), 990)  # what the lost log held
    for i in range(3):
        log.append(task_id, "output", i, tenant="t", trace_id="t", attempt=1)
    events, stored = held(client, task_id)
    assert [e.data for e in events] == [0, 1, 2]
    assert int(client.get(bytes_key(task_id)) or 0) == stored


def test_past_its_count_the_log_lets_its_oldest_events_go(own_redis: str) -> None:
    client = redis.Redis.from_url(own_redis)
    log = EventLog(client, 60, max_bytes=1 << 20, max_events=50)
    task_id, other = uuid.uuid4(), uuid.uuid4()
    # In groups, two tasks' events side by side: each log keeps its own newest 50
    items = [
        log._item(t, "output", i, "t", "t", None) for i in range(120) for t in (task_id, other)
    ]
    for start in range(0, len(items), 100):
        log._append_many_sync(items[start : start + 100])
    for t in (task_id, other):
        events, stored = held(client, t)
        assert [e.data for e in events] == list(range(70, 120))
        assert int(client.get(bytes_key(t)) or 0) == stored


def test_an_agent_streaming_more_than_the_log_holds_succeeds_and_the_log_keeps_its_newest(
    client: httpx.Client, worker: CeleryProcess
) -> None:
    """Five outputs of 1 MiB against the default 4 MiB: all go out live, and a stream opened
    after the end finds the three newest, then the final event."""
    task_id = flood(client, n=5, size=MiB)
    done = wait_for_task(client, task_id, FINAL)
    assert done["status"] == "succeeded"
    assert done["result"]["chunks"] == 5
    events = read_stream(client, "GET", f"/tasks/{task_id}/events")
    assert [e.get("event") for e in events] == ["output", "output", "output", "succeeded"]
    assert [e["data"]["data"]["i"] for e in events[:3]] == [2, 3, 4]  # type: ignore[index]


def test_an_output_larger_than_the_log_fails_events_too_large(
    client: httpx.Client, worker: CeleryProcess
) -> None:
    task_id = flood(client, n=2, size=5 * MiB)
    events = read_stream(client, "GET", f"/tasks/{task_id}/events")
    assert [e.get("event") for e in events] == ["status", "status", "failed"]
    done = wait_for_task(client, task_id, FINAL)
    assert done["status"] == "failed"
    assert done["error"]["code"] == "events_too_large"
    assert done["error"]["retryable"] is False


def test_an_agent_that_catches_the_refusal_goes_on_and_succeeds(
    client: httpx.Client, worker: CeleryProcess
) -> None:
    done = wait_for_task(client, flood(client, n=2, size=5 * MiB, catch=True), FINAL)
    assert done["status"] == "succeeded"
    assert done["result"]["chunks"] == 0


def test_a_result_past_its_limit_fails_result_too_large(
    client: httpx.Client, worker: CeleryProcess
) -> None:
    """The default limit is 4 MiB of JSON; 5 MiB is not stored, 3 MiB is."""
    too_large = flood(client, n=0, result_size=5 * MiB)
    fits = flood(client, n=0, result_size=3 * MiB)
    failed = wait_for_task(client, too_large, FINAL)
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "result_too_large"
    assert failed["result"] is None
    succeeded = wait_for_task(client, fits, FINAL)
    assert succeeded["status"] == "succeeded"
    assert len(succeeded["result"]["blob"]) == 3 * MiB


def test_a_sync_wait_on_a_finished_task_reads_its_final_event_alone_however_long_the_log(
    client: httpx.Client, settings: Settings
) -> None:
    """A sync submit looks for its task's final event before it listens, and read the whole
    log to find it: an idempotent replay of a finished task with a full log read megabytes
    from Redis for one answer, at the tenant's submit rate. The final event closes the log,
    so it is the last one."""
    # Given a task that finished with a log of about 2 MB
    envelope = {"capability": "test.flood", "payload": {"n": 64, "size": 32_000}}
    key = {"Idempotency-Key": f"long-log-{uuid.uuid4()}"}
    first = client.post("/tasks", json=envelope, headers=key)
    assert first.status_code == 202, first.text
    task_id = first.json()["task_id"]
    assert wait_for_task(client, task_id, FINAL)["status"] == "succeeded"
    store = redis.Redis.from_url(settings.redis_url)
    held_bytes = int(store.get(bytes_key(task_id)) or 0)
    assert held_bytes > 1_500_000
    # When the same submit comes again, waiting for the task
    sent_before = store.info("stats")["total_net_output_bytes"]
    again = client.post("/tasks", json={**envelope, "reply_mode": "sync"}, headers=key)
    sent = store.info("stats")["total_net_output_bytes"] - sent_before
    # Then it is answered with the finished task, and Redis sent a small part of the log
    assert again.status_code == 200, again.text
    assert (again.json()["task_id"], again.json()["status"]) == (task_id, "succeeded")
    assert sent < held_bytes / 4, f"Redis sent {sent} bytes for a log of {held_bytes}"
