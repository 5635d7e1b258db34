"""Every stream ends, and every wait: on a task gone with its TTL, and on a client that
resumes past the final event."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import Engine, func, select

from api.app import create_app
from broker.db.models import tasks_table
from broker.settings import Settings
from broker.tasks.events import EVENTS_SLACK_S, attempt_key, bytes_key, log_key, seq_key
from tests.integration.conftest import client_for
from tests.integration.stack import CeleryProcess, ServedApp, wait_for_task
from tests.integration.test_replies import frames

# No worker serves it: its tasks wait in its queue until their TTL passes.
UNSERVED = "test.nobody"
# Only a bound on a hang: a stream that still runs then has failed the test.
STREAM_BOUND_S = 90
# The wait a sync submit may take here: its task's 2 s TTL passes well before it ends.
SYNC_WAIT_S = 40


@pytest.fixture
def quick(settings: Settings, worker: CeleryProcess) -> Iterator[ServedApp]:
    """An API whose streams go quiet (and look at Postgres) after 0.2 s, not 2 s, and whose
    sync submits wait up to ``SYNC_WAIT_S``."""
    tuned = settings.model_copy(update={"sse_ping_s": 0.2, "sync_max_wait_s": SYNC_WAIT_S})
    with ServedApp(create_app(tuned)) as served:
        yield served


@pytest.fixture
def http(quick: ServedApp, tenant: tuple[str, str]) -> Iterator[httpx.Client]:
    with client_for(quick, tenant[1]) as client:
        yield client


@dataclass
class Stream:
    events: list[dict[str, Any]] = field(default_factory=list)  # not its pings
    ended: bool = False  # by itself, within ``STREAM_BOUND_S``
    location: str = ""


def read_until_end(http: httpx.Client, method: str, url: str, **kwargs: Any) -> Stream:
    bound = time.monotonic() + STREAM_BOUND_S
    stream = Stream()
    with http.stream(method, url, timeout=httpx.Timeout(10, read=30), **kwargs) as response:
        assert response.status_code == 200, response.read()
        stream.location = response.headers.get("location", "")
        for frame in frames(response.iter_lines()):
            if "comment" not in frame:
                stream.events.append(frame)
            if time.monotonic() > bound:
                return stream
    stream.ended = True
    return stream


def unserved(**extra: Any) -> dict[str, Any]:
    """A task that waits for an agent nobody runs, kept two seconds."""
    return {
        "capability": UNSERVED,
        "payload": {"n": 1},
        "queue_if_unavailable": True,
        "result_ttl_s": 2,
        **extra,
    }


def assert_gone_with_its_ttl(task: dict[str, Any], task_id: str) -> None:
    assert task["task_id"] == task_id
    assert task["capability"] == UNSERVED
    assert task["status"] == "expired"
    assert task["error"]["code"] == "ttl_exceeded"


def assert_ended_or_gone(http: httpx.Client, task_id: str) -> None:
    """The task after its TTL passed unstarted: ended ``ttl_exceeded`` by the janitor, when
    one ran in time (it keeps its row a TTL more, told as any end is), else gone."""
    answer = http.get(f"/tasks/{task_id}")
    if answer.status_code == 200:
        assert_gone_with_its_ttl(answer.json(), task_id)
    else:
        assert answer.status_code == 404, answer.text


def test_a_stream_mode_submit_whose_task_goes_with_its_ttl_ends_with_expired(
    http: httpx.Client,
) -> None:
    # Given a stream-mode submit of a task no agent takes, kept two seconds
    # When its TTL passes and the task is gone
    stream = read_until_end(http, "POST", "/tasks", json=unserved(reply_mode="stream"))
    # Then the stream ends by itself, its last event ``expired``: the task, gone with its TTL
    assert stream.ended, f"the stream of a gone task was still open after {STREAM_BOUND_S} s"
    assert [e["event"] for e in stream.events] == ["status", "expired"]
    task_id = stream.location.rsplit("/", 1)[-1]
    assert_gone_with_its_ttl(stream.events[-1]["data"]["data"], task_id)
    assert [int(e["id"]) for e in stream.events] == [1, 2]
    assert_ended_or_gone(http, task_id)


def test_a_task_stream_whose_task_goes_with_its_ttl_ends_with_expired(
    http: httpx.Client,
) -> None:
    # Given a task no agent takes, kept two seconds, and its event stream opened at once
    task_id = http.post("/tasks", json=unserved()).json()["task_id"]
    # When its TTL passes
    stream = read_until_end(http, "GET", f"/tasks/{task_id}/events")
    # Then the stream ends, with the task as the caller read it, expired
    assert stream.ended, f"the stream of a gone task was still open after {STREAM_BOUND_S} s"
    assert [e["event"] for e in stream.events] == ["status", "expired"]
    assert_gone_with_its_ttl(stream.events[-1]["data"]["data"], task_id)


def test_a_sync_wait_whose_task_goes_with_its_ttl_answers_expired(http: httpx.Client) -> None:
    # Given a sync submit of a task no agent takes, kept two seconds, that may wait 40 s
    response = http.post("/tasks", json=unserved(reply_mode="sync"), timeout=SYNC_WAIT_S + 30)
    # Then once the task is gone the wait ends: 200, the task expired with its TTL (before,
    # 202 after the whole wait, with the task as it was accepted: queued, though gone)
    assert response.status_code == 200, response.text
    task = response.json()
    assert_gone_with_its_ttl(task, task["task_id"])
    assert_ended_or_gone(http, task["task_id"])


def test_a_last_event_id_at_the_final_event_ends_the_stream_with_nothing_and_past_it_gets_it(
    http: httpx.Client,
) -> None:
    # Given a finished task and its stream's events
    echo = {"capability": "echo", "payload": {"e": 1}}
    task_id = http.post("/tasks", json=echo).json()["task_id"]
    wait_for_task(http, task_id, {"succeeded"})
    whole = read_until_end(http, "GET", f"/tasks/{task_id}/events")
    assert whole.ended and whole.events[-1]["event"] == "succeeded"
    final_id = int(whole.events[-1]["id"])
    # When a client resumes from the final event (an EventSource's reconnect after it)
    resumed = read_until_end(
        http, "GET", f"/tasks/{task_id}/events", headers={"Last-Event-ID": str(final_id)}
    )
    # Then the stream ends with nothing: it has every event
    assert resumed.ended and resumed.events == []
    # And one resuming far past it (an id of no log of this task's) gets the final event
    # once, numbered past its id, without waiting for the store to stand in
    far = 10**6
    past = read_until_end(
        http, "GET", f"/tasks/{task_id}/events", headers={"Last-Event-ID": str(far)}
    )
    assert past.ended
    assert [(e["id"], e["event"]) for e in past.events] == [(str(far + 1), "succeeded")]
    # And its reconnect from that id ends with nothing: it has the final event now
    handed = read_until_end(
        http, "GET", f"/tasks/{task_id}/events", headers={"Last-Event-ID": str(far + 1)}
    )
    assert handed.ended and handed.events == []
    # And so for the largest id a client may send: the id it is handed is one it may send
    # (one past it was refused, 400 invalid_last_event_id, on the reconnect)
    largest = 10**18 - 1
    top = read_until_end(
        http, "GET", f"/tasks/{task_id}/events", headers={"Last-Event-ID": str(largest)}
    )
    assert [(e["id"], e["event"]) for e in top.events] == [(str(largest), "succeeded")]
    again = read_until_end(
        http, "GET", f"/tasks/{task_id}/events", headers={"Last-Event-ID": top.events[0]["id"]}
    )
    assert again.ended and again.events == []
    # And one resuming just below it gets the final event, with its own id, once
    last = read_until_end(
        http, "GET", f"/tasks/{task_id}/events", headers={"Last-Event-ID": str(final_id - 1)}
    )
    assert last.ended
    assert [(e["id"], e["event"]) for e in last.events] == [(str(final_id), "succeeded")]


def test_a_stream_resumed_past_a_log_that_began_again_gets_the_final_event(
    http: httpx.Client, settings: Settings
) -> None:
    # Given a running task whose stream a client read to id 2, then dropped
    sleepy = {"capability": "test.sleepy", "payload": {"sleep_s": 3}}
    task_id = http.post("/tasks", json=sleepy).json()["task_id"]
    wait_for_task(http, task_id, {"running"})
    seen: list[dict[str, Any]] = []
    with http.stream("GET", f"/tasks/{task_id}/events", timeout=30) as response:
        for frame in frames(response.iter_lines()):
            if "comment" not in frame:
                seen.append(frame)
            if len(seen) == 2:
                break
    assert [e["id"] for e in seen] == ["1", "2"]
    # And its log lost in Redis meanwhile (a restart without persistence, an eviction): the
    # final event begins a new log at id 1
    with redis.Redis.from_url(settings.redis_url) as client:
        client.delete(log_key(task_id), seq_key(task_id), attempt_key(task_id), bytes_key(task_id))
    wait_for_task(http, task_id, {"succeeded"})
    # When the client resumes from id 2
    resumed = read_until_end(
        http, "GET", f"/tasks/{task_id}/events", headers={"Last-Event-ID": "2"}
    )
    # Then it gets the final event it never had, numbered past 2, and the stream ends
    assert resumed.ended
    assert [(e["id"], e["event"]) for e in resumed.events] == [("3", "succeeded")]


def test_a_running_tasks_event_log_lasts_as_long_as_its_row(
    http: httpx.Client, settings: Settings, engine: Engine
) -> None:
    """A claim holds the row ``RUN_HOLD_S`` (6 h) past its ``result_ttl_s``, a handler may
    run that long, but its log and the seq its ids come from were kept an hour past it: a
    handler silent for longer outlived its log, whose ids began again at 1."""
    body = {"capability": "test.sleepy", "payload": {"sleep_s": 3}, "result_ttl_s": 60}
    task_id = http.post("/tasks", json=body).json()["task_id"]
    wait_for_task(http, task_id, {"running"})
    with engine.connect() as conn:
        left = select(func.extract("epoch", tasks_table.c.expires_at - func.now()))
        row_left_s = float(conn.execute(left.where(tasks_table.c.id == task_id)).scalar_one())
    with redis.Redis.from_url(settings.redis_url) as client:
        kept_s = [client.ttl(key(task_id)) for key in (log_key, seq_key, attempt_key)]
    assert min(kept_s) >= row_left_s, (kept_s, row_left_s)
    # And once it ended, its log goes an hour after its result, as every task's does
    wait_for_task(http, task_id, {"succeeded"})
    with redis.Redis.from_url(settings.redis_url) as client:
        assert 0 < client.ttl(log_key(task_id)) <= 60 + EVENTS_SLACK_S


def test_a_stream_resumed_from_id_1_of_a_log_that_began_again_gets_the_final_event(
    http: httpx.Client, settings: Settings
) -> None:
    """The new log's final event was id 1 too: the client was taken to have it, and every
    reconnect from id 1 ended with nothing."""
    # Given a task whose stream a client read to id 1 (its queued event), then dropped
    sleepy = {"capability": "test.sleepy", "payload": {"sleep_s": 3}}
    task_id = http.post("/tasks", json=sleepy).json()["task_id"]
    with http.stream("GET", f"/tasks/{task_id}/events", timeout=30) as response:
        first = next(f for f in frames(response.iter_lines()) if "comment" not in f)
    assert (first["id"], first["event"]) == ("1", "status")
    wait_for_task(http, task_id, {"running"})
    # And its log lost meanwhile: the final event begins a new log at id 1
    with redis.Redis.from_url(settings.redis_url) as client:
        client.delete(log_key(task_id), seq_key(task_id), attempt_key(task_id), bytes_key(task_id))
    wait_for_task(http, task_id, {"succeeded"})
    # When it resumes from id 1
    url = f"/tasks/{task_id}/events"
    resumed = read_until_end(http, "GET", url, headers={"Last-Event-ID": "1"})
    # Then it gets the final event, numbered past 1, and its reconnect from there nothing
    assert [(e["id"], e["event"]) for e in resumed.events] == [("2", "succeeded")]
    again = read_until_end(http, "GET", url, headers={"Last-Event-ID": "2"})
    assert again.ended and again.events == []
