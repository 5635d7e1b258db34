"""Webhook rows written straight into a database of the test's own, and a producer whose
messages nobody takes: for driving ``workers.system.webhooks.Webhooks`` in this process,
one attempt or one sweep at a time, against real receivers on loopback."""

from __future__ import annotations

import base64
import json
import secrets
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import redis
from celery import Celery
from sqlalchemy import Engine, select, update
from sqlalchemy.dialects.postgresql import insert

from broker.db.models import callback_secrets_table as callback_secrets
from broker.db.models import webhook_deliveries_table as deliveries_table
from broker.db.models import webhooks_table
from broker.settings import Settings
from broker.tasks.dispatch import WEBHOOKS_QUEUE, celery_config
from broker.webhooks.signing import new_secret
from reach import localservices
from tests.integration.rows import a_delivery_row


@contextmanager
def idle_producer(services: localservices.Services, settings: Settings) -> Iterator[Celery]:
    """Publishes to a Redis db nobody consumes: what is sent stays there, to be read."""
    url = localservices.claim_redis_db(services.redis_url)
    producer = Celery("idle-producer", set_as_current=False)
    producer.conf.update(celery_config(settings.model_copy(update={"redis_url": url})))
    try:
        yield producer
    finally:
        producer.close()
        redis.Redis.from_url(url).flushdb()


def published(producer: Celery) -> list[tuple[str, int]]:
    """(delivery id, attempt) of each deliver message waiting in the producer's queue."""
    client = redis.Redis.from_url(producer.conf.broker_url)
    messages = [json.loads(m) for m in client.lrange(WEBHOOKS_QUEUE, 0, -1)]
    client.close()
    args = [json.loads(base64.b64decode(m["body"]))[0] for m in messages]
    return [(str(a[0]), int(a[1])) for a in args]


def a_subscription(engine: Engine, tenant: str, url: str, events: list[str]) -> uuid.UUID:
    webhook_id = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(
            insert(webhooks_table).values(
                id=webhook_id,
                tenant=tenant,
                url=url,
                events=events,
                capabilities=[],
                secret=new_secret(),
            )
        )
    return webhook_id


def a_delivery_to(
    engine: Engine,
    url: str,
    *,
    tenant: str | None = None,
    webhook_id: uuid.UUID | None = None,
    task_id: uuid.UUID | None = None,
    final_attempt: int = 3,
) -> uuid.UUID:
    """A delivery to ``url``, due now and signable: a subscription's, or else the task's
    callback (its tenant then has a callback secret)."""
    tenant = tenant or f"t-{secrets.token_hex(4)}"
    delivery_id = a_delivery_row(
        engine, body_expires_in=timedelta(hours=1), tenant=tenant, final_attempt=final_attempt
    )
    changes: dict[str, object] = {"url": url, "webhook_id": webhook_id}
    if task_id is not None:
        changes["task_id"] = task_id
    with engine.begin() as conn:
        conn.execute(
            update(deliveries_table).where(deliveries_table.c.id == delivery_id).values(changes)
        )
        if webhook_id is None:
            secret = insert(callback_secrets).values(tenant=tenant, secret=new_secret())
            conn.execute(secret.on_conflict_do_nothing())
    return delivery_id


def delivery(engine: Engine, delivery_id: uuid.UUID) -> dict[str, object] | None:
    """The delivery's row, None once it is gone."""
    query = select(deliveries_table).where(deliveries_table.c.id == delivery_id)
    with engine.connect() as conn:
        row = conn.execute(query).first()
    return None if row is None else dict(row._mapping)
