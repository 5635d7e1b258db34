"""A fanout that fails holds up nobody else's, and a result's numbers reach an A2A push
exactly: through the API, the workers, the webhook sweep and receivers on loopback."""

from __future__ import annotations

import json
import secrets
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select, update

from broker.db.models import tasks_table as tasks
from broker.db.models import webhook_deliveries_table as deliveries
from broker.db.models import webhook_outbox_table as outbox
from broker.settings import Settings
from broker.tasks import execution
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.receiver import Receiver
from tests.integration.rows import a_task_row
from tests.integration.stack import CeleryProcess, ServedApp, start_worker
from tests.integration.test_webhook_push_configs import rpc
from tests.integration.webhook_client import submit
from workers.system.webhooks import SWEEP_BATCH

# The sweep's grace (``FANOUT_GRACE_S``) and interval, a few sweeps of failing fanouts, with
# room for a slow machine.
DELIVERED_WITHIN_S = 120


def with_callback_secret(api: ServedApp, make_key: KeyMaker) -> tuple[str, str]:
    """A fresh tenant whose callbacks are signed (else none is sent); (tenant, token)."""
    tenant, token = make_key()
    _, admin = make_key(tenant=tenant, tenant_admin=True)
    with client_for(api, admin) as http:
        assert http.post("/callbacks/secret").status_code == 201
    return tenant, token


def test_an_a2a_push_of_a_result_holding_an_integer_beyond_a_double_keeps_its_digits(
    api: ServedApp,
    make_key: KeyMaker,
    settings: Settings,
    log_dir: Path,
    worker: CeleryProcess,
) -> None:
    """``push_body`` put the result in a protobuf ``Value``, whose numbers are doubles: 10**400
    raised OverflowError, the fanout failed at every try and the push never went out."""
    _, token = with_callback_secret(api, make_key)
    big = 10**400
    with client_for(api, token) as client, Receiver() as receiver:
        # Given a task whose payload (its result: test.solo returns it) holds 10**400, queued
        # while no agent serves its capability, and an A2A push config set on it
        task = submit(client, "test.solo", payload={"n": big}, queue_if_unavailable=True)
        task_id = task["task_id"]
        config = {"taskId": task_id, "url": f"{receiver.url}/push", "token": "tok-big"}
        rpc(api, token, "CreateTaskPushNotificationConfig", config)
        # When an agent runs it
        solo = start_worker(
            settings, "test.solo", f"solo-{secrets.token_hex(3)}", log_dir, concurrency=1
        )
        try:
            [push] = receiver.wait_for(1, timeout_s=DELIVERED_WITHIN_S)
        finally:
            solo.stop()
        assert client.get(f"/tasks/{task_id}").json()["result"] == {"n": big}
    # Then its push arrives, the number's every digit kept (a string: a protobuf number is a
    # double)
    sent = json.loads(push.body)["task"]
    assert sent["id"] == task_id and sent["status"]["state"] == "TASK_STATE_COMPLETED"
    assert sent["artifacts"][0]["parts"][0]["data"] == {"n": str(big)}
    assert push.headers["x-a2a-notification-token"] == "tok-big"


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def finished_with(
    engine: Engine, tenant: str, result: Any, callbacks: list[Any]
) -> list[uuid.UUID]:
    """Running tasks of ``tenant``, one per callback, finished with ``result`` by the final
    write alone: each owes a fanout, and no message was ever sent for it (as if lost)."""
    ids = [a_task_row(engine, tenant=tenant, status="running") for _ in callbacks]
    with engine.begin() as conn:
        for task_id, callback in zip(ids, callbacks, strict=True):
            conn.execute(update(tasks).where(tasks.c.id == task_id).values(callback=callback))
    for start in range(0, len(ids), 100):
        finishes = [execution.Finish.succeeded(i, result) for i in ids[start : start + 100]]
        assert all(execution.finish_many(engine, finishes))
    return ids


def owed_of(engine: Engine, task_ids: list[uuid.UUID]) -> int:
    with engine.connect() as conn:
        query = select(func.count()).where(outbox.c.task_id.in_(task_ids))
        return int(conn.execute(query).scalar_one())


def test_fanouts_that_fail_every_time_hold_up_no_other_tenants_and_are_given_up_after_their_tries(
    api: ServedApp,
    make_key: KeyMaker,
    engine: Engine,
    settings: Settings,
    system_workers: list[CeleryProcess],
    system_beat: CeleryProcess,
) -> None:
    """The sweep took 500 owed fanouts in no order and left one that failed owed, tried at
    each sweep until its task expired: more than 500 that always fail and no other fanout owed
    ever ran again."""
    good_tenant, _ = with_callback_secret(api, make_key)
    with Receiver() as receiver:
        # Given more fanouts than a sweep takes whose delivery cannot be written: a callback
        # whose URL is longer than a delivery holds (written past the API's checks)
        poison_url = f"{receiver.url}/poison/" + "x" * 3000
        callback_too_long = {"url": poison_url, "events": ["task.succeeded"]}
        many = SWEEP_BATCH + 100
        poison = finished_with(
            engine, "poison-" + secrets.token_hex(4), {"ok": 1}, [callback_too_long] * many
        )
        # And after them another tenant's task with a callback, both owed past the grace
        callback = {"url": f"{receiver.url}/good", "events": ["task.succeeded"]}
        [good] = finished_with(engine, good_tenant, {"ok": 1}, [callback])
        with engine.begin() as conn:
            due = update(outbox).where(outbox.c.task_id.in_([*poison, good]))
            conn.execute(due.values(finished_at=outbox.c.finished_at - timedelta(seconds=20)))
        # When the webhook sweep runs (every second), expect the other tenant's callback sent
        [call] = receiver.wait_for(1, timeout_s=DELIVERED_WITHIN_S)
        # while failing fanouts are still owed: it did not wait for them to be given up
        assert owed_of(engine, poison) > 0
        # And each failing one given up after as many tries as a delivery has
        eventually(
            lambda: owed_of(engine, poison),
            "the failing fanouts given up",
            DELIVERED_WITHIN_S,
            until=lambda left: left == 0,
        )
    assert call.path == "/hook/good"
    assert json.loads(call.body)["data"]["task_id"] == str(good)
    tries = len(settings.webhook_schedule_s)
    log = system_workers[0].output()
    given_up = [f"task {task_id} after {tries} failures" in log for task_id in poison]
    assert all(given_up), f"{given_up.count(False)} not logged as given up"
    with engine.connect() as conn:
        query = select(func.count()).where(deliveries.c.task_id.in_(poison))
        assert conn.execute(query).scalar_one() == 0
    assert [r.path for r in receiver.requests] == ["/hook/good"]
