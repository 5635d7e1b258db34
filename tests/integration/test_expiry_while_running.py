"""A task a worker holds never expires under it: its TTL counts from its end (or, for one that
never starts, from its submit), however long its run takes."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import httpx
import redis
from sqlalchemy import Engine, func, select, text

from broker.db.models import tasks_table
from broker.settings import Settings
from broker.tasks import execution
from tests.eventually import eventually
from tests.integration.stack import CeleryProcess, wait_for_task

FINAL = {"succeeded", "failed", "cancelled", "expired"}
TTL_S = 3  # a task's TTL: a loaded machine's pause between its end and the read fits in it
RUN_S = 8  # how long the task runs: far past its TTL


def ttl_passed(engine: Engine, created_at: str, ttl_s: int) -> bool:
    """Whether Postgres's clock is past ``created_at`` plus ``ttl_s``: the task's first
    ``expires_at``, which readers compare with Postgres's clock."""
    due = datetime.fromisoformat(created_at)
    with engine.connect() as conn:
        query = select(func.now() > text("CAST(:due AS timestamptz) + make_interval(secs => :s)"))
        return bool(conn.execute(query, {"due": due, "s": ttl_s}).scalar_one())


def same_key_tasks(engine: Engine, key: str) -> list[uuid.UUID]:
    with engine.connect() as conn:
        query = select(tasks_table.c.id).where(tasks_table.c.idempotency_key == key)
        return [row.id for row in conn.execute(query)]


def test_a_task_running_past_its_ttl_keeps_its_row_its_key_and_its_outcome(
    client: httpx.Client, engine: Engine, settings: Settings
) -> None:
    # Given a task kept three seconds that runs for eight
    key = f"charge-{uuid.uuid4().hex[:8]}"
    envelope: dict[str, Any] = {
        "capability": "test.sleepy",
        "payload": {"sleep_s": RUN_S},
        "result_ttl_s": TTL_S,
        "idempotency_key": key,
    }
    first = client.post("/tasks", json=envelope)
    assert first.status_code == 202, first.text
    task_id = first.json()["task_id"]
    wait_for_task(client, task_id, {"running"})
    # When its TTL has passed while it runs, and the janitor has run since
    created = first.json()["created_at"]
    eventually(lambda: ttl_passed(engine, created, TTL_S), "the first TTL to pass")
    execution.purge_expired(engine, batch=1000, budget_s=5)
    # Then it still reads as running (before: 404)
    read = client.get(f"/tasks/{task_id}")
    assert read.status_code == 200, read.text
    assert read.json()["status"] in ("running", "succeeded")
    # And a retry with its key gets it (before: a second task, run beside it)
    again = client.post("/tasks", json=envelope)
    assert again.status_code == 202, again.text
    assert again.json()["task_id"] == task_id
    assert again.headers["idempotent-replayed"] == "true"
    # And its outcome is kept once it ends (before: its row was gone, and so was the outcome)
    done = wait_for_task(client, task_id, FINAL, timeout_s=60)
    assert done["status"] == "succeeded", done
    assert done["result"]["slept"] is True
    assert same_key_tasks(engine, key) == [uuid.UUID(task_id)]
    runs = redis.Redis.from_url(settings.redis_url).get(f"reach:test:runs:{task_id}")
    assert runs == b"1"


def test_a_session_turn_running_past_its_ttl_still_holds_back_the_next(
    client: httpx.Client, engine: Engine, system_beat: CeleryProcess
) -> None:
    # Given a session whose first turn, kept three seconds, runs for eight, and a second turn
    session_id = client.post("/sessions", json={}).json()["session_id"]
    slow = {"capability": "test.sleepy", "payload": {"sleep_s": RUN_S}, "result_ttl_s": TTL_S}
    first = client.post("/tasks", json={**slow, "session_id": session_id}).json()
    wait_for_task(client, first["task_id"], {"running"})
    second = client.post(
        "/tasks", json={"capability": "echo", "payload": {"n": 2}, "session_id": session_id}
    ).json()
    # When the first turn's TTL has passed while it runs (the sweeper republishes a turn
    # it takes as due every second)
    eventually(lambda: ttl_passed(engine, first["created_at"], TTL_S), "the first TTL to pass")
    # Then the second turn starts only once the first has ended (before: the first read as
    # gone, so the second ran beside it), and the first keeps its outcome: read as it ends,
    # within its TTL (read after the second turn, it could be gone by then)
    done_first = wait_for_task(client, first["task_id"], FINAL, timeout_s=60)
    done_second = wait_for_task(client, second["task_id"], FINAL, timeout_s=60)
    assert done_first["status"] == done_second["status"] == "succeeded"
    assert str(done_second["started_at"]) >= str(done_first["finished_at"])


def test_a_run_cut_by_its_time_limit_still_ends_expired(client: httpx.Client) -> None:
    # Given a task kept three seconds whose handler overruns its agent's 0.5 s timeout
    envelope = {"capability": "test.short-fuse", "payload": {}, "result_ttl_s": 3}
    task_id = client.post("/tasks", json=envelope).json()["task_id"]
    # Then it ends expired, with the timeout's error, readable for its three seconds after that
    done = wait_for_task(client, task_id, FINAL)
    assert done["status"] == "expired"
    assert done["error"]["code"] == "timeout"


def test_a_task_requeued_from_a_run_is_kept_its_ttl_from_then_not_the_runs_hold(
    client: httpx.Client, engine: Engine
) -> None:
    # Given a task kept two seconds, claimed: its row is held for as long as a run may last
    envelope = {"capability": "test.sleepy", "payload": {"sleep_s": 3}, "result_ttl_s": 2}
    task_id = client.post("/tasks", json=envelope).json()["task_id"]
    wait_for_task(client, task_id, {"running"})
    held = "SELECT expires_at > now() + interval '1 hour' FROM tasks WHERE id = :id"
    with engine.connect() as conn:
        assert conn.execute(text(held), {"id": task_id}).scalar_one()
    # When it goes back to its queue, as the reaper sends back a lost worker's task
    lost = {"code": "worker_lost", "message": "its worker was lost", "retryable": True}
    requeued = execution.requeue(engine, uuid.UUID(task_id), lost, attempt=1)
    assert requeued is not None and requeued["status"] == "queued"
    # Then it is kept its two seconds from then, as a submitted task is (before: the run's
    # hold of hours, never run)
    kept = (
        "SELECT expires_at <= now() + make_interval(secs => result_ttl_s) FROM tasks WHERE id = :id"
    )
    with engine.connect() as conn:
        assert conn.execute(text(kept), {"id": task_id}).scalar_one()
