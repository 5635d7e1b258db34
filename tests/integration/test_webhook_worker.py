"""The webhooks worker's tasks (fanout, one attempt), run in this process against a database
of the test's own and real receivers on loopback; what they publish stays in a Redis db
nobody consumes, to be read."""

from __future__ import annotations

import base64
import json
import secrets
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import Engine, delete, func, select, update

from broker.db.models import tasks_table, webhooks_table
from broker.db.models import webhook_attempts_table as attempts_log
from broker.db.models import webhook_deliveries_table as deliveries_table
from broker.settings import Settings
from broker.tasks.dispatch import WEBHOOKS_QUEUE
from broker.webhooks import deliveries, policy
from broker.webhooks.events import PROGRESS
from broker.webhooks.ssrf import Guard
from reach import localservices
from tests.integration.receiver import Receiver, Reply, always
from tests.integration.rows import a_task_row
from tests.integration.webhook_rows import (
    a_delivery_to,
    a_subscription,
    delivery,
    idle_producer,
    published,
)
from workers.system.sender import SENDER_ERROR, send
from workers.system.webhooks import Webhooks

# A wait past a countdown's reach: an attempt's next message is the sweep's to publish.
SCHEDULE_S = [0.0, 100.0, 100.0]
JITTER = 0.2
# Neither number (²: Python's str.isdigit holds for it, float refuses it) nor a date that
# datetime holds (its year overflows a C long).
UNREADABLE_RETRY_AFTER = ["\u00b2", "Fri, 31 Dec 9999999999999999999 23:59:59 GMT"]


@pytest.fixture
def producer(services: localservices.Services, settings: Settings) -> Iterator[Celery]:
    with idle_producer(services, settings) as made:
        yield made


def hooks_of(settings: Settings, engine: Engine, producer: Celery, **changes: object) -> Webhooks:
    own = settings.model_copy(
        update={"webhook_schedule_s": SCHEDULE_S, "webhook_jitter": JITTER, **changes}
    )
    return Webhooks(producer, own, lambda: engine)


@pytest.mark.parametrize("retry_after", UNREADABLE_RETRY_AFTER, ids=["superscript", "year"])
def test_a_retry_after_the_sender_cannot_read_is_ignored_and_the_503_is_retried_on_schedule(
    settings: Settings, own_engine: Engine, producer: Celery, retry_after: str
) -> None:
    """``float("²")`` raised out of the sender: the attempt recorded nothing, released
    nothing, stayed ``sending`` for its lease, and the sweep then made it due at once."""
    hooks = hooks_of(settings, own_engine, producer)
    # Given a receiver that answers 503 with a Retry-After no one can read
    with Receiver(always(Reply(503, {"Retry-After": retry_after}))) as receiver:
        delivery_id = a_delivery_to(own_engine, receiver.url, final_attempt=len(SCHEDULE_S))
        # When the first attempt is made
        status = hooks.deliver(str(delivery_id), 1)
        [call] = receiver.requests
    # Expect it recorded with its status, pending, and due on the schedule's second delay
    row = delivery(own_engine, delivery_id)
    assert row is not None and call.path == "/hook"
    assert status == row["status"] == policy.PENDING
    assert row["last_status_code"] == 503 and row["attempts"] == 1
    with own_engine.connect() as conn:
        [(code, at)] = conn.execute(
            select(attempts_log.c.status_code, attempts_log.c.at).where(
                attempts_log.c.delivery_id == delivery_id
            )
        ).all()
    waits_s = (row["next_attempt_at"] - at).total_seconds()  # type: ignore[operator]
    assert code == 503
    assert SCHEDULE_S[1] * (1 - JITTER) - 1 <= waits_s <= SCHEDULE_S[1] * (1 + JITTER) + 1


@pytest.mark.parametrize("retry_after", UNREADABLE_RETRY_AFTER, ids=["superscript", "year"])
def test_the_sender_returns_a_503_whatever_its_retry_after_holds(retry_after: str) -> None:
    with Receiver(always(Reply(503, {"Retry-After": retry_after}))) as receiver:
        outcome = send(Guard(["127.0.0.1"]), receiver.url, b"{}", {}, timeout_s=5, max_bytes=64)
    assert outcome.status_code == 503 and outcome.retry_after_s is None
    assert policy.verdict(outcome) == "retry"


def test_an_error_of_the_senders_own_is_an_attempt_failed_for_good_not_a_raise() -> None:
    def broken(host: str, port: int) -> list[str]:
        raise RuntimeError("a bug of ours, with text no tenant should read")

    outcome = send(
        Guard([], resolver=broken), "http://hooks.test/hook", b"{}", {}, timeout_s=5, max_bytes=64
    )

    assert outcome.status_code is None and not outcome.transient
    assert outcome.error == SENDER_ERROR and policy.verdict(outcome) == "failed"


def test_a_subscription_deleted_during_its_attempt_frees_the_slot_for_the_tenants_next(
    settings: Settings, own_engine: Engine, producer: Celery
) -> None:
    """The deletion took the delivery with it (cascade): recording the attempt raised a
    foreign key violation, and the tenant's next delivery waited for the sweep."""
    hooks = hooks_of(settings, own_engine, producer, webhook_max_inflight_per_tenant=1)
    tenant = f"t-{secrets.token_hex(4)}"
    deleted = threading.Event()

    def delete_then_answer(_n: int) -> Reply:
        with own_engine.begin() as conn:
            conn.execute(delete(webhooks_table).where(webhooks_table.c.id == webhook_id))
        deleted.set()
        return Reply(200)

    # Given a tenant allowed one attempt at a time, a delivery to a subscription that is
    # deleted while its attempt is under way, and another delivery due behind it
    with Receiver(delete_then_answer) as receiver:
        webhook_id = a_subscription(own_engine, tenant, receiver.url, ["task.succeeded"])
        first = a_delivery_to(own_engine, receiver.url, tenant=tenant, webhook_id=webhook_id)
        second = a_delivery_to(own_engine, "http://127.0.0.1:9/next", tenant=tenant)
        # When the first's attempt ends
        status = hooks.deliver(str(first), 1)
    # Expect it said so without raising, and the next one released into the free slot
    assert deleted.is_set() and delivery(own_engine, first) is None
    assert status == deliveries.DELETED
    assert published(producer) == [(str(second), 1)]


def test_each_progress_report_sends_countdowns_for_its_own_deliveries_only(
    settings: Settings, own_engine: Engine, producer: Celery
) -> None:
    """Each report sent a countdown again for every earlier report's delivery still waiting
    for its first attempt: n reports, n²/2 messages an endpoint."""
    hooks = hooks_of(settings, own_engine, producer, webhook_schedule_s=[5.0, 100.0])
    # Given a task whose two subscriptions want its progress, on a schedule whose first
    # attempt waits 5 s
    tenant = f"t-{secrets.token_hex(4)}"
    task_id = a_task_row(own_engine, tenant=tenant, status="running")
    for n in range(2):
        a_subscription(own_engine, tenant, f"http://127.0.0.1:9/{n}", [PROGRESS])
    # When it reports three times
    written = [hooks.fanout(str(task_id), PROGRESS) for _ in range(3)]
    # Expect one countdown message per delivery: two a report
    sent = published(producer)
    assert written == [2, 2, 2]
    assert len(sent) == 6 and len({d for d, _ in sent}) == 6
    assert {attempt for _, attempt in sent} == {1}


def announced(producer: Celery) -> list[list[str]]:
    """The args of each fanout message waiting in the producer's queue."""
    client = redis.Redis.from_url(producer.conf.broker_url)
    messages = [json.loads(m) for m in client.lrange(WEBHOOKS_QUEUE, 0, -1)]
    client.close()
    return [json.loads(base64.b64decode(m["body"]))[0] for m in reversed(messages)]


def test_a_tasks_progress_reports_wait_on_the_queue_as_one_fanout_at_a_time(
    settings: Settings, own_engine: Engine, producer: Celery
) -> None:
    """Each report put a fanout on the queue every tenant's final events wait on: one
    tenant's 30 tasks of 50 reports made 525, and another tenant's webhooks came 6-9 s late
    (an audit, 2026-12-06). The fanout reads the latest progress when it runs."""
    hooks = hooks_of(settings, own_engine, producer)
    tenant = f"t-{secrets.token_hex(4)}"
    task_id = a_task_row(own_engine, tenant=tenant, status="running")
    a_subscription(own_engine, tenant, "http://127.0.0.1:9/progress", [PROGRESS])
    # When the task reports five times before its fanout runs
    for _ in range(5):
        hooks.on_progress(task_id)
    # Then one fanout waits
    assert announced(producer) == [[str(task_id), PROGRESS]]
    # And once it has run, the next report sends the next one
    hooks.fanout(str(task_id), PROGRESS)
    hooks.on_progress(task_id)
    hooks.on_progress(task_id)
    fanouts = [a for a in announced(producer) if a[1] == PROGRESS]
    assert fanouts == [[str(task_id), PROGRESS]] * 2


def deliveries_of(engine: Engine, task_id: uuid.UUID) -> list[Any]:
    with engine.connect() as conn:
        query = select(
            deliveries_table.c.event_type,
            deliveries_table.c.status,
            deliveries_table.c.body_id,
            deliveries_table.c.last_error,
        ).where(deliveries_table.c.task_id == task_id)
        return list(conn.execute(query.order_by(deliveries_table.c.next_attempt_at)))


def test_a_final_events_fanout_after_the_tasks_expiry_logs_its_deliveries_failed(
    settings: Settings, own_engine: Engine, producer: Celery
) -> None:
    """A task kept briefly (``result_ttl_s``) whose final event's fanout ran after its
    expiry (behind a queue) left no delivery at all: the subscriber was never told, and the
    log said nothing either."""
    hooks = hooks_of(settings, own_engine, producer)
    tenant = f"t-{secrets.token_hex(4)}"
    task_id = a_task_row(own_engine, tenant=tenant, status="running")
    a_subscription(own_engine, tenant, "http://127.0.0.1:9/h", ["task.succeeded"])
    # Given a task that ended and expired before its final event's fanout ran
    with own_engine.begin() as conn:
        ended = {
            "status": "succeeded",
            "result": {"ok": 1},
            "finished_at": func.now() - timedelta(seconds=3),
            "result_ttl_s": 2,
            "expires_at": func.now() - timedelta(seconds=1),
        }
        conn.execute(update(tasks_table).where(tasks_table.c.id == task_id).values(**ended))
    # When it runs, Then nothing is sent, and its delivery is logged failed, with no body
    assert hooks.fanout(str(task_id), "task.succeeded") == 0
    assert published(producer) == []
    [delivery] = deliveries_of(own_engine, task_id)
    assert (delivery.event_type, delivery.status, delivery.body_id) == (
        "task.succeeded",
        "failed",
        None,
    )
    assert delivery.last_error == policy.TASK_EXPIRED
