"""Hostile receivers: tarpits that answer a byte at a time, against a stack of this module's own
(its Redis db, an agent worker, the maintenance worker and a webhooks worker of 4 processes,
the API). The attempt timeout is 3 s, the schedule two attempts, and a tenant may have two
attempts in flight. The figures are printed (``pytest -s``)."""

from __future__ import annotations

import base64
import json
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import redis
from celery import Celery
from sqlalchemy import Engine, create_engine, select, text

from api.app import create_app
from broker.db.models import webhook_attempts_table as attempts_log
from broker.db.models import webhook_deliveries_table as deliveries_table
from broker.settings import Settings
from broker.tasks.dispatch import WEBHOOK_SWEEP_TASK, WEBHOOKS_QUEUE, celery_config
from broker.tenancy import key_store
from broker.webhooks import deliveries
from reach import localservices, migrate
from tests.eventually import eventually
from tests.integration.receiver import Receiver, Tarpit
from tests.integration.rows import a_delivery_row
from tests.integration.stack import (
    CeleryProcess,
    ServedApp,
    start_system_workers,
    start_worker,
)
from tests.integration.webhook_client import register, submit, wait_deliveries
from workers.system.webhooks import SWEEP_BATCH, Webhooks

TIMEOUT_S = 3.0
SCHEDULE_S = [0.0, 0.2]
MAX_INFLIGHT = 2
WEBHOOKS_CONCURRENCY = 4


@dataclass
class Stack:
    settings: Settings
    api: ServedApp
    maintenance: CeleryProcess
    producer: Celery

    def client(self, engine: Engine) -> httpx.Client:
        """A client for a fresh tenant allowed everything."""
        _, token = key_store.create_key(engine, f"t-{secrets.token_hex(4)}", ["*"])
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.Client(base_url=self.api.url, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def stack(settings: Settings, services: localservices.Services, log_dir: Path) -> Iterator[Stack]:
    redis_url = localservices.claim_redis_db(services.redis_url)
    own = settings.model_copy(
        update={
            "redis_url": redis_url,
            "webhook_timeout_s": TIMEOUT_S,
            "webhook_schedule_s": SCHEDULE_S,
            "webhook_max_inflight_per_tenant": MAX_INFLIGHT,
        }
    )
    processes = [start_worker(own, "echo", "tarpit-agents", log_dir)]
    try:
        processes += start_system_workers(
            own, log_dir, prefix="tarpit-", webhooks_concurrency=WEBHOOKS_CONCURRENCY
        )
        producer = Celery("tarpit-producer", set_as_current=False)
        producer.conf.update(celery_config(own))
        with ServedApp(create_app(own)) as api:
            yield Stack(own, api, processes[1], producer)
        producer.close()
    finally:
        for process in processes:
            process.stop()
        redis.Redis.from_url(redis_url).flushdb()


def ran_at(worker: CeleryProcess, task_id: str, timeout_s: float = 60) -> float:
    """When the worker logged that the task succeeded (monotonic clock of this process, read
    as it is seen); the timeout only bounds a hang."""

    def logged() -> bool:
        return any(
            task_id in line and line.startswith("{") and _succeeded(json.loads(line), task_id)
            for line in worker.output().splitlines()
        )

    eventually(logged, f"{worker.args} to run {task_id}", timeout_s, 0.02)
    return time.monotonic()


def _succeeded(record: dict[str, object], task_id: str) -> bool:
    data = record.get("data")
    return isinstance(data, dict) and data.get("id") == task_id and "succeeded" in str(record)


def test_given_one_tenants_tarpits_expect_its_bound_held_each_attempt_cut_and_others_served(
    stack: Stack, engine: Engine
) -> None:
    # Given a tenant whose four webhooks are tarpits (a byte every 0.5 s, for two minutes)
    with (
        Tarpit(drip_s=0.5, hold_s=120) as tarpit,
        Receiver() as receiver,
        stack.client(engine) as hostile,
        stack.client(engine) as other,
    ):
        hooks = [register(hostile, tarpit.url, events=["task.succeeded"])[0] for _ in range(4)]
        submit(hostile)
        tarpit.wait_open(MAX_INFLIGHT)
        # When another tenant's task finishes while they are held
        register(other, receiver.url, events=["task.succeeded"])
        sent_at = time.monotonic()
        submit(other)
        receiver.wait_for(1, timeout_s=60)
        waited_s = time.monotonic() - sent_at
        # Expect its webhook before any tarpit attempt has ended (it took no tarpit's slot)
        cut_before = [h for h in tarpit.held if h.closed_at is not None]
        open_meanwhile = tarpit.open_count
        # And every tarpit delivery dead after the schedule, each attempt cut at the timeout
        logs = [
            wait_deliveries(hostile, f"/webhooks/{h['webhook_id']}/deliveries", _dead, 120)[0]
            for h in hooks
        ]
        eventually(lambda: tarpit.open_count == 0, "the tarpit to see every connection end")
    attempts = [a for log in logs for a in log["attempts"]]
    longest_ms = max(a["latency_ms"] for a in attempts)
    print(
        f"\ntarpits: {len(hooks)} deliveries, {len(attempts)} attempts recorded"
        f" (schedule {len(SCHEDULE_S)} each), {len(tarpit.held)} connections,"
        f" at most {tarpit.most_open} held at once (bound {MAX_INFLIGHT});"
        f" longest attempt {longest_ms} ms (timeout {TIMEOUT_S:g} s);"
        f" the other tenant's webhook came after {waited_s:.2f} s"
        f" with {open_meanwhile} tarpit attempts in flight"
    )
    assert cut_before == [] and open_meanwhile >= 1
    assert [log["attempt_count"] for log in logs] == [len(SCHEDULE_S)] * len(hooks)
    assert len(attempts) == len(tarpit.held) == len(SCHEDULE_S) * len(hooks)
    assert all(a["error"] and a["error"].startswith("timeout") for a in attempts), attempts
    assert all(a["latency_ms"] >= TIMEOUT_S * 1000 for a in attempts)
    # The "timeout" label says the deadline had passed; that the sender cut each attempt
    # (rather than the tarpit letting go after its 120 s) is shown by who hung up
    assert all(h.cut_by_client for h in tarpit.held)
    assert tarpit.most_open <= MAX_INFLIGHT


def _dead(found: list[dict[str, object]]) -> bool:
    return bool(found) and found[0]["status"] == "dead"


def test_given_every_delivery_slot_held_by_tarpits_expect_maintenance_to_run_at_once(
    stack: Stack, engine: Engine
) -> None:
    # Given two tenants whose tarpits hold all four processes of the webhooks worker
    with Tarpit(drip_s=0.5, hold_s=120) as tarpit:
        clients = [stack.client(engine), stack.client(engine)]
        for client in clients:
            for _ in range(MAX_INFLIGHT):
                register(client, tarpit.url, events=["task.succeeded"])
            submit(client)
        tarpit.wait_open(WEBHOOKS_CONCURRENCY)
        # When the webhook sweep (maintenance) is due
        task_id = str(uuid.uuid4())
        sent_at = time.monotonic()
        stack.producer.send_task(WEBHOOK_SWEEP_TASK, task_id=task_id)
        waited_s = ran_at(stack.maintenance, task_id) - sent_at
        # Expect it to run while every slot is still held (before any attempt could end)
        still_open = tarpit.open_count
        cut_before = [h for h in tarpit.held if h.closed_at is not None]
        for client in clients:
            client.close()
    print(
        f"\nmaintenance: the webhook sweep ran {waited_s:.2f} s after it was sent, with"
        f" {still_open} tarpit attempts holding all {WEBHOOKS_CONCURRENCY} delivery slots"
    )
    assert cut_before == [] and still_open == WEBHOOKS_CONCURRENCY


@pytest.fixture
def own_engine(services: localservices.Services) -> Iterator[Engine]:
    """A database of the test's own: no sweeper of the session's stack takes its rows."""
    name = f"reach_lost_{secrets.token_hex(4)}"
    url = localservices.create_database(services.database_url, name)
    migrate.upgrade(url)
    built = create_engine(url)
    yield built
    built.dispose()
    localservices.drop_database(services.database_url, name)


@pytest.fixture
def idle_producer(services: localservices.Services, settings: Settings) -> Iterator[Celery]:
    """Publishes to a Redis db nobody consumes: what the sweep sends stays unsent."""
    url = localservices.claim_redis_db(services.redis_url)
    producer = Celery("idle-producer", set_as_current=False)
    producer.conf.update(celery_config(settings.model_copy(update={"redis_url": url})))
    yield producer
    producer.close()
    redis.Redis.from_url(url).flushdb()


def test_given_attempts_whose_worker_never_reports_expect_dead_after_the_schedule(
    settings: Settings, own_engine: Engine, idle_producer: Celery
) -> None:
    engine = own_engine
    # Given a delivery due now, on a schedule of two attempts
    delivery_id = _delivery(engine, final_attempt=len(SCHEDULE_S))
    hooks = Webhooks(idle_producer, settings, lambda: engine)
    for attempt in range(1, len(SCHEDULE_S) + 1):
        # When each attempt is claimed by a worker that dies (it never records an outcome)
        claimed = deliveries.claim(engine, delivery_id, attempt, lease_s=0.1, max_inflight=9)
        assert isinstance(claimed, deliveries.Claimed), (attempt, claimed)
        # and the sweep finds it once its lease has passed
        eventually(
            lambda: hooks.sweep()["lost"] >= 1 or _status(engine, delivery_id) != "sending",
            "the sweep to find the attempt lost",
        )
    # Expect each lost attempt counted and logged, and no attempt past the schedule
    assert _status(engine, delivery_id) == "dead"
    extra = deliveries.claim(engine, delivery_id, len(SCHEDULE_S) + 1, lease_s=0.1, max_inflight=9)
    assert extra is None
    with engine.connect() as conn:
        logged = conn.execute(
            select(attempts_log.c.attempt, attempts_log.c.error)
            .where(attempts_log.c.delivery_id == delivery_id)
            .order_by(attempts_log.c.attempt)
        ).all()
    assert [a for a, _ in logged] == list(range(1, len(SCHEDULE_S) + 1))
    assert all(error and error.startswith("lost") for _, error in logged)


def _delivery(engine: Engine, *, final_attempt: int) -> uuid.UUID:
    return a_delivery_row(engine, body_expires_in=timedelta(hours=1), final_attempt=final_attempt)


def _status(engine: Engine, delivery_id: uuid.UUID) -> str:
    query = select(deliveries_table.c.status).where(deliveries_table.c.id == delivery_id)
    with engine.connect() as conn:
        return str(conn.execute(query).scalar_one())


def test_given_another_tenants_backlog_of_lost_deliveries_expect_ours_sent_again(
    settings: Settings, own_engine: Engine, idle_producer: Celery
) -> None:
    engine = own_engine
    # Given another tenant with more lost deliveries than a sweep's batch, all older than ours
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO webhook_deliveries (id, tenant, task_id, event_type, url, body,"
                " body_expires_at, trace_id, status, final_attempt, next_attempt_at, expires_at)"
                " SELECT gen_random_uuid(), 'hog', gen_random_uuid(), 'task.succeeded',"
                " 'http://127.0.0.1:9/hook', '{}', now() + interval '1 hour', md5(i::text),"
                " 'pending', 3, now() - make_interval(secs => 600 - i / 100.0),"
                " now() + interval '1 day' FROM generate_series(1, :count) AS i"
            ),
            {"count": SWEEP_BATCH + 100},
        )
    # When our delivery's message is lost (due two minutes ago)
    ours = _delivery(engine, final_attempt=3)
    with engine.begin() as conn:
        conn.execute(
            deliveries_table.update()
            .where(deliveries_table.c.id == ours)
            .values(next_attempt_at=datetime.now(UTC) - timedelta(minutes=2))
        )
    # and the sweep runs
    counts = Webhooks(idle_producer, settings, lambda: engine).sweep()
    # Expect ours published again, and the sweep's work still bounded by its batch
    assert str(ours) in _published(idle_producer)
    assert counts["republished"] <= SWEEP_BATCH


def _published(producer: Celery) -> set[str]:
    """The delivery ids of the messages waiting in the producer's webhooks queue."""
    client = redis.Redis.from_url(producer.conf.broker_url)
    messages = [json.loads(m) for m in client.lrange(WEBHOOKS_QUEUE, 0, -1)]
    return {json.loads(base64.b64decode(m["body"]))[0][0] for m in messages}
