"""A delivery's stored body carries the task, its result too: it may not outlive the task.
The session stack (the maintenance worker runs the webhook sweep every second, by beat)."""

from __future__ import annotations

import json
import secrets
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import redis
from sqlalchemy import Engine, select

from broker.db.models import tasks_table as tasks
from broker.db.models import webhook_bodies_table as bodies_table
from broker.db.models import webhook_deliveries_table as deliveries_table
from broker.webhooks import deliveries, upkeep
from tests.agents import GATE_KEY
from tests.eventually import eventually
from tests.integration.receiver import Receiver
from tests.integration.rows import a_delivery_row
from tests.integration.stack import CeleryProcess
from tests.integration.webhook_client import finished, register, submit, wait_deliveries


def stored(engine: Engine, delivery_id: str) -> dict[str, object]:
    """The delivery's row, with the text of its body (None once gone)."""
    query = (
        select(deliveries_table, bodies_table.c.body)
        .outerjoin(bodies_table, bodies_table.c.id == deliveries_table.c.body_id)
        .where(deliveries_table.c.id == uuid.UUID(delivery_id))
    )
    with engine.connect() as conn:
        return dict(conn.execute(query).one()._mapping)


def test_given_a_delivered_result_expect_its_stored_body_gone_when_the_task_expires(
    client: httpx.Client, engine: Engine, system_beat: CeleryProcess
) -> None:
    # Given a task whose result is kept 2 s, delivered to a webhook
    secret = f"result-{secrets.token_hex(4)}"
    with Receiver() as receiver:
        webhook, _ = register(client, receiver.url, events=["task.succeeded"])
        task = submit(client, payload={"secret": secret}, result_ttl_s=2)
        path = f"/webhooks/{webhook['webhook_id']}/deliveries"
        [delivery] = wait_deliveries(client, path, finished("succeeded"))
    row = stored(engine, delivery["delivery_id"])
    assert secret in str(row["body"])
    with engine.connect() as conn:
        expires_at = conn.execute(
            select(tasks.c.expires_at).where(tasks.c.id == uuid.UUID(task["task_id"]))
        ).scalar_one()
    assert row["body_expires_at"] == expires_at
    # When the task expires and the sweep has run
    eventually(
        lambda: stored(engine, delivery["delivery_id"]),
        "the body gone with its task",
        60,
        0.2,
        until=lambda row: row["body"] is None,
    )
    # Expect the body gone, not before the task's expiry, and the attempts' log kept
    assert datetime.now(UTC) >= expires_at
    [kept] = client.get(path).json()["deliveries"]
    assert kept["status"] == "succeeded" and len(kept["attempts"]) == 1
    again = client.post(f"{path}/{delivery['delivery_id']}/redeliver")
    assert again.status_code == 409 and again.json()["code"] == "delivery_expired"


def test_given_a_waiting_delivery_whose_task_expired_expect_no_attempt_and_failed(
    engine: Engine,
) -> None:
    # Given a delivery waiting for its first attempt whose task expired a moment ago
    delivery_id = a_delivery_row(
        engine,
        body='{"data": {"result": "kept too long"}}',
        body_expires_in=timedelta(seconds=-1),
    )
    # When its attempt comes, and the sweep removes expired bodies
    claimed = deliveries.claim(engine, delivery_id, 1, lease_s=30, max_inflight=9)
    while upkeep.purge_expired_bodies(engine, batch=1000, budget_s=10):
        pass
    # Expect no attempt, the body gone and the delivery failed, saying why
    row = stored(engine, str(delivery_id))
    assert claimed is None
    assert row["body"] is None and row["status"] == "failed" and row["attempts"] == 0
    assert "expired" in str(row["last_error"])


def test_an_events_body_is_stored_once_for_all_its_endpoints_and_goes_with_its_task(
    client: httpx.Client, engine: Engine, system_beat: CeleryProcess
) -> None:
    """Each endpoint's delivery stored its own copy of the body, the task's result in it:
    a tenant's 50 subscriptions to a 1 MiB result stored 50 MiB."""
    secret = f"result-{secrets.token_hex(4)}"
    with Receiver() as receiver:
        # Given three subscriptions to the same event
        hooks = [
            register(client, f"{receiver.url}/{n}", events=["task.succeeded"])[0] for n in range(3)
        ]
        # When a task succeeds, its result held 2 s
        task = submit(client, payload={"secret": secret}, result_ttl_s=2)
        delivered = [
            wait_deliveries(
                client, f"/webhooks/{h['webhook_id']}/deliveries", finished("succeeded")
            )[0]
            for h in hooks
        ]
        received = [r.body for r in receiver.wait_for(3)]
    # Expect every endpoint sent the whole body, and one body stored for the three
    rows = [stored(engine, d["delivery_id"]) for d in delivered]
    assert len({row["body_id"] for row in rows}) == 1
    assert len(received) == 3 and all(secret.encode() in body for body in received)
    with engine.connect() as conn:
        copies = conn.execute(
            select(bodies_table.c.id).where(bodies_table.c.body.contains(secret))
        ).all()
    assert len(copies) == 1
    assert task["task_id"] in rows[0]["body"]
    # And once the task expires, the body goes
    eventually(
        lambda: stored(engine, delivered[0]["delivery_id"]),
        "the shared body gone with its task",
        60,
        0.2,
        until=lambda row: row["body"] is None and row["body_id"] is None,
    )
    with engine.connect() as conn:
        eventually(
            lambda: conn.execute(
                select(bodies_table.c.id).where(bodies_table.c.body.contains(secret))
            ).all(),
            "the body's row deleted",
            60,
            0.2,
            until=lambda found: not found,
        )


def test_a_progress_reports_body_expires_no_later_than_its_task(
    client: httpx.Client, engine: Engine, redis_url: str
) -> None:
    """A report's body is written while its task runs, when the row's ``expires_at`` is held
    past the run: taking it as it was, the body (the task, trace and all) outlived the task
    by up to the hold's 6 hours."""
    gate = secrets.token_hex(4)
    with Receiver() as receiver:
        # Given a subscription to progress, and a task that reports some, then waits at a gate,
        # its result kept 60 s
        webhook, _ = register(client, receiver.url, events=["task.progress"])
        payload = {"gate": gate, "progress": True, "sleep_s": 0}
        task = submit(client, "test.sleepy", payload=payload, result_ttl_s=60)
        # When the report is delivered while it runs, and then it ends
        receiver.wait_for(1)
        with redis.Redis.from_url(redis_url) as gates:
            gates.set(GATE_KEY.format(gate), 1, ex=300)
    with engine.connect() as conn:
        expires_at = eventually(
            lambda: conn.execute(
                select(tasks.c.expires_at).where(
                    tasks.c.id == uuid.UUID(task["task_id"]), tasks.c.finished_at.is_not(None)
                )
            ).scalar(),
            "the task ended",
        )
        reports = conn.execute(
            select(deliveries_table.c.body_expires_at, bodies_table.c.expires_at)
            .join(bodies_table, bodies_table.c.id == deliveries_table.c.body_id)
            .where(deliveries_table.c.webhook_id == uuid.UUID(webhook["webhook_id"]))
        ).all()
    # Then the report's body, and its delivery, expire at the latest with the task
    assert len(reports) == 1
    assert max(reports[0]) <= expires_at, (reports, expires_at)


def test_a_task_nobody_started_within_its_ttl_ends_expired_and_is_told(
    client: httpx.Client, system_beat: CeleryProcess
) -> None:
    """A queued task's row went when its ``result_ttl_s`` passed: accepted, then gone with no
    final state, and nobody subscribed to its end heard of it."""
    with Receiver() as receiver:
        # Given a subscription to expired tasks, and a task nobody serves, kept 2 s
        register(client, receiver.url, events=["task.expired"])
        task = submit(client, "test.nobody", queue_if_unavailable=True, result_ttl_s=2)
        # When its time passes unstarted, then the janitor runs
        [told] = receiver.wait_for(1)
    # Then it ended expired, ttl_exceeded, and its end was delivered
    event = json.loads(told.body)
    assert event["type"] == "task.expired"
    assert event["data"]["task_id"] == task["task_id"]
    assert event["data"]["error"]["code"] == "ttl_exceeded"
