"""Hostile receivers: tarpits that answer a byte at a time, against a stack of this module's own
(its Redis db, an agent worker, the maintenance worker and a webhooks worker of 4 processes,
the API). The attempt timeout is 3 s, the schedule two attempts, and a tenant may have two
attempts in flight. The figures are printed (``pytest -s``)."""

from __future__ import annotations

import base64
import json
import secrets
import threading
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
from sqlalchemy import Engine, func, select, text

from api.app import create_app
from broker.db.models import webhook_attempts_table as attempts_log
from broker.db.models import webhook_deliveries_table as deliveries_table
from broker.settings import Settings
from broker.tasks.dispatch import WEBHOOK_SWEEP_TASK, WEBHOOKS_QUEUE, celery_config
from broker.tenancy import key_store
from broker.webhooks import deliveries, policy
from reach import localservices
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


class QueueWatch:
    """The longest the ``reach.webhooks`` list got while it ran: sampled every few ms by a
    thread of its own."""

    def __init__(self, settings: Settings) -> None:
        self._redis = redis.Redis.from_url(settings.celery_broker_url)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self.longest = 0

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.longest = max(self.longest, int(self._redis.llen(WEBHOOKS_QUEUE)))

    def __enter__(self) -> QueueWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._redis.close()


HOSTILE_HOOKS, HOSTILE_TASKS, VICTIM_TASKS = 40, 5, 3


def test_given_one_tenants_backlog_at_tarpits_expect_it_waiting_in_postgres_not_the_queue(
    stack: Stack, engine: Engine
) -> None:
    backlog = HOSTILE_HOOKS * HOSTILE_TASKS
    with (
        QueueWatch(stack.settings) as queue,
        Tarpit(drip_s=0.5, hold_s=120) as tarpit,
        Receiver() as receiver,
        stack.client(engine) as hostile,
        stack.client(engine) as victim,
    ):
        # Given a tenant whose many webhooks are tarpits, with a backlog of deliveries to them
        # (each attempt held for the whole timeout, two at a time: minutes to drain)
        hooks = [
            register(hostile, tarpit.url, events=["task.succeeded"])[0]["webhook_id"]
            for _ in range(HOSTILE_HOOKS)
        ]
        for _ in range(HOSTILE_TASKS):
            submit(hostile)
        eventually(lambda: len(_unfinished(engine, hooks)) == backlog, "the backlog written")
        tarpit.wait_open(MAX_INFLIGHT)
        # When another tenant's tasks finish
        register(victim, receiver.url, events=["task.succeeded"])
        sent_at = time.monotonic()
        for _ in range(VICTIM_TASKS):
            submit(victim)
        # Expect its webhooks delivered while the backlog is still waiting
        receiver.wait_for(VICTIM_TASKS, timeout_s=60)
        waited_s = time.monotonic() - sent_at
        waiting = _unfinished(engine, hooks)
        sending = waiting.count("sending")
        held = tarpit.most_open
        for hook in hooks:  # the backlog goes with its webhooks (cascade), for the next test
            assert hostile.delete(f"/webhooks/{hook}").status_code == 204
    print(
        f"\nbacklog: {len(waiting)} of {backlog} deliveries to tarpits unfinished when the"
        f" other tenant's {VICTIM_TASKS} webhooks had come, {waited_s:.2f} s after its submits;"
        f" {WEBHOOKS_QUEUE} held at most {queue.longest} messages;"
        f" at most {held} tarpit attempts at once"
    )
    assert len(waiting) > backlog // 2 and sending <= MAX_INFLIGHT
    assert held <= MAX_INFLIGHT
    # And the queue never held the backlog: per tenant its attempts' released and retry
    # messages (two caps' worth at most), besides one fanout message per task
    assert queue.longest <= 2 * 2 * MAX_INFLIGHT + HOSTILE_TASKS + VICTIM_TASKS


def _unfinished(engine: Engine, webhook_ids: list[str]) -> list[str]:
    """The status of each delivery to these webhooks still waiting or under way."""
    query = select(deliveries_table.c.status).where(
        deliveries_table.c.webhook_id.in_([uuid.UUID(w) for w in webhook_ids]),
        deliveries_table.c.status.in_(("pending", "sending")),
    )
    with engine.connect() as conn:
        return [str(s) for s in conn.execute(query).scalars()]


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
                "WITH body AS (INSERT INTO webhook_bodies (id, body, expires_at)"
                " VALUES (gen_random_uuid(), '{}', now() + interval '1 hour') RETURNING id)"
                " INSERT INTO webhook_deliveries (id, tenant, task_id, event_type, url, body_id,"
                " body_expires_at, trace_id, status, final_attempt, next_attempt_at, expires_at)"
                " SELECT gen_random_uuid(), 'hog', gen_random_uuid(), 'task.succeeded',"
                " 'http://127.0.0.1:9/hook', (SELECT id FROM body), now() + interval '1 hour',"
                " md5(i::text),"
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


def test_given_a_tenant_at_its_bound_expect_the_next_parked_and_released_oldest_first(
    own_engine: Engine,
) -> None:
    engine, tenant = own_engine, f"t-{secrets.token_hex(4)}"
    # Given five due deliveries of a tenant, oldest first, two of them under way
    due = [_due(engine, tenant, seconds_ago=50 - i) for i in range(5)]
    first, second = (_claim(engine, d) for d in due[:2])
    assert isinstance(first, deliveries.Claimed) and isinstance(second, deliveries.Claimed)
    # When the third's message comes, expect it parked and nothing released
    assert isinstance(_claim(engine, due[2]), deliveries.Busy)
    assert _release(engine, tenant) == []
    # When an attempt ends, expect the oldest waiting released, once
    deliveries.record(engine, first, policy.Outcome(status_code=200), "delivered", 0)
    assert _release(engine, tenant) == [(due[2], 1)]
    assert _release(engine, tenant) == []
    # When another message takes that slot first, expect the released one parked again
    assert isinstance(_claim(engine, due[3]), deliveries.Claimed)
    assert isinstance(_claim(engine, due[2]), deliveries.Busy)
    # and released again, still first, once the next attempt ends
    deliveries.record(engine, second, policy.Outcome(status_code=200), "delivered", 0)
    assert _release(engine, tenant) == [(due[2], 1)]


def test_given_deliveries_waiting_past_their_time_expect_the_sweep_to_fill_free_slots_only(
    settings: Settings, own_engine: Engine, idle_producer: Celery
) -> None:
    engine = own_engine
    bounded = settings.model_copy(update={"webhook_max_inflight_per_tenant": MAX_INFLIGHT})
    hooks = Webhooks(idle_producer, bounded, lambda: engine)
    # Given a tenant at its bound with deliveries parked for minutes (its attempts in flight
    # release them), and a tenant with none in flight whose releases were lost
    busy, idle = f"t-{secrets.token_hex(4)}", f"t-{secrets.token_hex(4)}"
    for delivery_id in [_due(engine, busy, seconds_ago=300 - i) for i in range(MAX_INFLIGHT)]:
        assert isinstance(_claim(engine, delivery_id), deliveries.Claimed)
    for i in range(3):
        _due(engine, busy, seconds_ago=200 - i)
    idle_due = [_due(engine, idle, seconds_ago=200 - i) for i in range(3)]
    # When the sweep runs, expect only the idle tenant's oldest published, one per free slot
    assert hooks.sweep()["republished"] == MAX_INFLIGHT
    assert _release(engine, idle) == [] and _release(engine, busy) == []
    with engine.connect() as conn:
        marked = conn.execute(
            select(deliveries_table.c.id)
            .where(
                deliveries_table.c.status == "pending", deliveries_table.c.lease_until > func.now()
            )
            .order_by(deliveries_table.c.next_attempt_at)
        ).scalars()
        assert list(marked) == idle_due[:MAX_INFLIGHT]


def _due(engine: Engine, tenant: str, *, seconds_ago: float) -> uuid.UUID:
    return a_delivery_row(
        engine,
        body_expires_in=timedelta(hours=1),
        tenant=tenant,
        due_for=timedelta(seconds=seconds_ago),
    )


def _claim(engine: Engine, delivery_id: uuid.UUID) -> deliveries.Claimed | deliveries.Busy | None:
    return deliveries.claim(engine, delivery_id, 1, lease_s=30, max_inflight=MAX_INFLIGHT)


def _release(engine: Engine, tenant: str) -> list[tuple[uuid.UUID, int]]:
    return deliveries.release(engine, tenant, max_inflight=MAX_INFLIGHT)
