"""Every final state reaches the event log, exactly once: the log closes on its final event,
and a task final in Postgres without it (its worker died between the two writes) gets it from a
redelivered message or from the reaper. The stream side is in ``test_replies``; the real
crash in ``test_faults``."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from sqlalchemy import Engine, insert

from broker import jsonbody
from broker.db.models import tasks_table
from broker.settings import Settings
from broker.tasks.dispatch import Dispatcher, send_run
from broker.tasks.events import EventLog, read_log_sync
from tests.eventually import eventually
from tests.integration.stack import CeleryProcess


def finished_without_final_event(
    engine: Engine, redis_url: str, tenant: str, *, finished_ago_s: float
) -> dict[str, Any]:
    """The state a crash between the final write and the final event leaves: the row
    succeeded in Postgres, the log holding only ``queued`` and ``running``."""
    now = datetime.now(UTC)
    task_id = uuid.uuid4()
    digest, size = jsonbody.digest({"crash": True})
    row = {
        "id": task_id,
        "tenant": tenant,
        "capability": "echo",
        "queue": "echo",
        "status": "succeeded",
        "payload": {"crash": True},
        "payload_digest": digest,
        "payload_size": size,
        "result": {"crash": True},
        "attempts": 1,
        "trace_id": uuid.uuid4().hex,
        "result_ttl_s": 7200,
        "created_at": now - timedelta(seconds=finished_ago_s + 1),
        "started_at": now - timedelta(seconds=finished_ago_s + 0.5),
        "finished_at": now - timedelta(seconds=finished_ago_s),
        "expires_at": now + timedelta(hours=1),
    }
    with engine.begin() as conn:
        conn.execute(insert(tasks_table).values(**row))
    log = EventLog(redis.Redis.from_url(redis_url), 7200, max_bytes=1 << 20)
    log.append(task_id, "status", {"status": "queued"}, tenant="t", trace_id=row["trace_id"])
    log.append(task_id, "status", {"status": "running"}, tenant="t", trace_id=row["trace_id"])
    return row


def final_events(redis_url: str, task_id: uuid.UUID) -> list[Any]:
    return [e for e in read_log_sync(redis.Redis.from_url(redis_url), task_id) if e.final]


def wait_for_final_event(redis_url: str, task_id: uuid.UUID) -> list[Any]:
    return eventually(lambda: final_events(redis_url, task_id), f"task {task_id}'s final event")


def test_a_final_event_closes_the_log(own_redis: str) -> None:
    client = redis.Redis.from_url(own_redis)
    log = EventLog(client, 60, max_bytes=1 << 20)
    task_id = uuid.uuid4()
    assert log.append(task_id, "status", {"status": "running"}, tenant="t", trace_id="t") == 1
    assert log.append(task_id, "succeeded", {"n": 1}, tenant="t", trace_id="t") == 2
    # A second announcement of the final state, and anything after it, is refused
    assert log.append(task_id, "succeeded", {"n": 2}, tenant="t", trace_id="t") == 0
    assert log.append(task_id, "failed", {"n": 3}, tenant="t", trace_id="t") == 0
    assert log.append(task_id, "output", {"late": True}, tenant="t", trace_id="t") == 0
    events = read_log_sync(client, task_id)
    assert [(e.seq, e.type, e.data) for e in events] == [
        (1, "status", {"status": "running"}),
        (2, "succeeded", {"n": 1}),
    ]


def test_a_redelivered_message_of_a_finished_task_appends_its_missing_final_event(
    engine: Engine,
    redis_url: str,
    settings: Settings,
    tenant: tuple[str, str],
    worker: CeleryProcess,
) -> None:
    # Given a task whose worker died between its two writes, an hour ago (beyond the reaper)
    row = finished_without_final_event(engine, redis_url, tenant[0], finished_ago_s=3600)
    assert final_events(redis_url, row["id"]) == []
    # When its message comes again (Celery requeues the message of a pool process that died)
    dispatcher = Dispatcher(settings)
    try:
        send_run(dispatcher.app, row["id"], "echo", trace_id=row["trace_id"], tenant=tenant[0])
        # Then the worker finds the task final and appends its final event, once
        [event] = wait_for_final_event(redis_url, row["id"])
        send_run(dispatcher.app, row["id"], "echo", trace_id=row["trace_id"], tenant=tenant[0])
        skipped = f"task {row['id']} not queued any more"
        eventually(
            lambda: worker.output().count(skipped) >= 2, "the second message handled and skipped"
        )
    finally:
        dispatcher.close()
    assert (event.seq, event.type, event.trace_id) == (3, "succeeded", row["trace_id"])
    assert (event.data["task_id"], event.data["result"]) == (str(row["id"]), {"crash": True})
    assert len(final_events(redis_url, row["id"])) == 1  # the second message added none


def test_the_reaper_appends_the_final_event_a_crash_left_out(
    engine: Engine,
    redis_url: str,
    tenant: tuple[str, str],
    system_beat: CeleryProcess,
) -> None:
    # Given a task that just finished in Postgres without its final event, and no message
    row = finished_without_final_event(engine, redis_url, tenant[0], finished_ago_s=0)
    # Then the reaper appends it, once
    [event] = wait_for_final_event(redis_url, row["id"])
    assert (event.seq, event.type, event.trace_id) == (3, "succeeded", row["trace_id"])
    assert event.data["result"] == {"crash": True}
