"""A final event's webhooks are owed from the final write (``broker.webhooks.outbox``): a
worker that dies right after it loses none of them, and none is sent twice."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
from sqlalchemy import Engine, func, select

from broker.db.models import tasks_table as tasks
from broker.db.models import webhook_outbox_table as outbox
from broker.settings import Settings
from broker.tasks import execution
from broker.webhooks import fanout
from tests.eventually import eventually
from tests.integration.receiver import Receiver
from tests.integration.rows import a_task_row
from tests.integration.stack import CeleryProcess, start_worker
from tests.integration.webhook_client import register, submit, wait_deliveries
from workers import faults

# The sweep's grace (``FANOUT_GRACE_S``), its interval and the pool's restart, with room.
DELIVERED_WITHIN_S = 120


def owed(engine: Engine, task_id: uuid.UUID | str) -> int:
    with engine.connect() as conn:
        query = select(func.count()).where(outbox.c.task_id == uuid.UUID(str(task_id)))
        return int(conn.execute(query).scalar_one())


def test_a_worker_killed_right_after_the_final_write_still_sends_each_webhook_once(
    client: httpx.Client,
    tenant_admin: httpx.Client,
    settings: Settings,
    engine: Engine,
    log_dir: Path,
    system_beat: CeleryProcess,
) -> None:
    # Given a tenant's subscription and a task's own callback, both on a loopback receiver,
    # and a worker whose pool process kills itself (SIGKILL) right after it writes a task's
    # final state, before its final event and the fanout message
    assert tenant_admin.post("/callbacks/secret").status_code == 201
    crashing = start_worker(
        settings,
        "test.late",
        f"crash-before-fanout-{uuid.uuid4().hex[:4]}",
        log_dir,
        env={faults.CRASH_AFTER_FINISH: "test.late"},
    )
    try:
        with Receiver() as receiver:
            register(client, receiver.url, events=["task.succeeded"])
            callback = {"url": f"{receiver.url}/own", "events": ["task.succeeded"]}
            task = submit(client, "test.late", payload={}, callback=callback)
            task_id = task["task_id"]
            # When the task has run and its worker died between the final write and the rest
            eventually(lambda: "signal 9 (SIGKILL)" in crashing.output(), "the pool killed")
            # Then both endpoints get the task's final event
            calls = receiver.wait_for(2, timeout_s=DELIVERED_WITHIN_S)
            path = f"/tasks/{task_id}/deliveries"
            both_done = wait_deliveries(
                client,
                path,
                lambda found: len(found) == 2 and {d["status"] for d in found} == {"succeeded"},
            )
            # And a fanout run again (a late message, another sweep) writes and sends nothing
            again = fanout.fanout(engine, uuid.UUID(task_id), "task.succeeded", settings)
            assert again is not None and again.waiting == []
            assert len(client.get(path).json()["deliveries"]) == 2
            assert len(receiver.requests) == 2
    finally:
        crashing.stop()
    assert sorted(call.path for call in calls) == ["/hook", "/hook/own"]
    assert {call.headers["webhook-id"] for call in calls} == {d["message_id"] for d in both_done}
    assert [d["attempt_count"] for d in both_done] == [1, 1]
    assert client.get(f"/tasks/{task_id}").json()["status"] == "succeeded"
    # And nothing is left owed for it
    assert owed(engine, task_id) == 0


def test_a_final_write_records_a_fanout_only_where_someone_may_want_it(
    engine: Engine, settings: Settings
) -> None:
    # Given two running tasks of a tenant with no subscription, one with a callback
    tenant = f"outbox-{uuid.uuid4().hex[:8]}"
    plain = a_task_row(engine, tenant=tenant, status="running")
    called = a_task_row(engine, tenant=tenant, status="running")
    with engine.begin() as conn:
        url = "http://127.0.0.1:9/hook"
        callback = {"url": url, "events": ["task.succeeded"]}
        conn.execute(tasks.update().where(tasks.c.id == called).values(callback=callback))
    # When both finish in one statement
    finished = execution.finish_many(
        engine,
        [execution.Finish.succeeded(plain, {"n": 1}), execution.Finish.succeeded(called, None)],
    )
    # Then both rows come back as before, and only the one with a callback owes a fanout
    assert [row and row["status"] for row in finished] == ["succeeded", "succeeded"]
    assert (owed(engine, plain), owed(engine, called)) == (0, 1)
    # And its fanout settles it, in the transaction that writes its delivery
    written = fanout.fanout(engine, called, "task.succeeded", settings)
    assert written is not None and len(written.waiting) == 1
    assert owed(engine, called) == 0
