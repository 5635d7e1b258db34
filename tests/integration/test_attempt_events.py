"""A task's event log takes the events of its latest attempt only: a stale attempt (its worker
paused until the reaper gave the task to another) must not mix its progress and outputs with
the new attempt's. The whole story, with real workers, is in ``test_guarantees``."""

from __future__ import annotations

import uuid

import redis

from broker.tasks.events import EventLog, read_log_sync


def test_an_attempt_is_refused_once_a_later_one_has_appended(own_redis: str) -> None:
    client = redis.Redis.from_url(own_redis)
    log = EventLog(client, 60, max_bytes=1 << 20)
    task_id = uuid.uuid4()
    assert log.append(task_id, "status", {"status": "queued"}, tenant="t", trace_id="t") == 1
    assert (
        log.append(task_id, "status", {"status": "running"}, tenant="t", trace_id="t", attempt=1)
        == 2
    )
    assert log.append(task_id, "output", "one", tenant="t", trace_id="t", attempt=1) == 3
    # Given the second attempt begun
    assert (
        log.append(task_id, "status", {"status": "running"}, tenant="t", trace_id="t", attempt=2)
        == 4
    )
    # Then the first one's events are refused, the second's taken, and so are the events
    # that belong to no attempt (the API's, a final one)
    assert log.append(task_id, "output", "one, late", tenant="t", trace_id="t", attempt=1) == 0
    assert log.append(task_id, "output", "two", tenant="t", trace_id="t", attempt=2) == 5
    assert log.append(task_id, "succeeded", {"n": 2}, tenant="t", trace_id="t") == 6
    assert [e.data for e in read_log_sync(client, task_id)] == [
        {"status": "queued"},
        {"status": "running"},
        "one",
        {"status": "running"},
        "two",
        {"n": 2},
    ]


def test_a_requeue_shuts_out_the_attempt_it_took_the_task_from(own_redis: str) -> None:
    """The reaper's ``queued`` event opens the next attempt before any worker claims it."""
    client = redis.Redis.from_url(own_redis)
    log = EventLog(client, 60, max_bytes=1 << 20)
    task_id = uuid.uuid4()
    assert log.append(task_id, "output", "one", tenant="t", trace_id="t", attempt=1) == 1
    assert (
        log.append(task_id, "status", {"status": "queued"}, tenant="t", trace_id="t", attempt=2)
        == 2
    )
    assert (
        log.append(task_id, "progress", {"percent": 90}, tenant="t", trace_id="t", attempt=1) == 0
    )
    assert log.append(task_id, "output", "two", tenant="t", trace_id="t", attempt=2) == 3


def test_a_group_refuses_only_its_stale_events(own_redis: str) -> None:
    """Appends grouped into one script call: each task's own attempt decides for it."""
    client = redis.Redis.from_url(own_redis)
    log = EventLog(client, 60, max_bytes=1 << 20)
    old, fresh = uuid.uuid4(), uuid.uuid4()
    log.append(old, "status", {"status": "running"}, tenant="t", trace_id="t", attempt=3)
    items = [
        log._item(old, "output", "stale", "t", "t", None, attempt=2),
        log._item(fresh, "output", "new", "t", "t", None, attempt=1),
        log._item(old, "output", "current", "t", "t", None, attempt=3),
    ]
    assert log._append_many_sync(items) == [0, 1, 2]
