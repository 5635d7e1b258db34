"""Publishing to Celery from the broker side: the API never imports ``workers``.

Every capability's messages are one Celery task, ``reach.run``, carrying only the task id and
the queue; the payload stays in Postgres, the source of truth.
"""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, datetime
from typing import Any

from celery import Celery
from kombu.transport.redis import PRIORITY_STEPS, Channel

from broker.observability.tracing import traceparent
from broker.settings import Settings
from broker.tasks.turns import Due

RUN_TASK = "reach.run"
PURGE_TASK = "reach.purge_expired"
REAP_TASK = "reach.reap_lost"
SWEEP_TASK = "reach.sweep_queued"
MAINTENANCE_QUEUE = "reach.maintenance"
WEBHOOKS_QUEUE = "reach.webhooks"
# Webhooks: fan a task event out to its endpoints, attempt one delivery, sweep lost ones.
FANOUT_TASK = "reach.webhooks.fanout"
DELIVER_TASK = "reach.webhooks.deliver"
WEBHOOK_SWEEP_TASK = "reach.webhooks.sweep"

# Above any task's hard time limit plus its longest queue wait: a Redis broker re-delivers an
# unacked message after this long, even while it still runs (celery #5935).
VISIBILITY_TIMEOUT_S = 6 * 3600

# On a Redis broker a queue is one list per priority step: kombu keeps the messages of
# priority n > 0 in ``<queue>\x06\x16<n>`` and a worker takes from the lowest n that holds
# one. A tenant past its fair slice of a crowded queue (``backpressure.QueueBound``) has its
# run messages put in the last list: behind every other tenant's, in the same queue.
BEHIND = PRIORITY_STEPS[-1]
TENANT_HEADER = "reach_tenant"  # a run message's: whose task it runs


def redis_list(queue: str, priority: int = 0) -> str:
    """The list a Redis broker keeps ``queue``'s messages of ``priority`` in (a step)."""
    return f"{queue}{Channel.sep}{priority}" if priority else queue


def redis_lists(queue: str) -> list[str]:
    """Every list of ``queue`` on a Redis broker, in the order a worker takes from them."""
    return [redis_list(queue, step) for step in PRIORITY_STEPS]


def celery_config(settings: Settings) -> dict[str, Any]:
    """The Celery settings both the producer (API) and the workers use."""
    return {
        "broker_url": settings.celery_broker_url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {"visibility_timeout": VISIBILITY_TIMEOUT_S},
        # JSON only: never unpickle what came over the wire.
        "accept_content": ["json"],
        "task_serializer": "json",
        "result_serializer": "json",
        # Results live in Postgres, never in a Celery result backend.
        "task_ignore_result": True,
        "result_backend": None,
        # Ack after the handler returns, and requeue when the worker process dies; the claim
        # from 'queued' in Postgres makes a redelivery harmless.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        # A lost broker connection (a Redis restart, a failover, a reset connection) leaves the
        # running tasks running: True terminated each one, so a sub-second blip ended every
        # task in flight `worker_lost` (or ran it again). The unacked message comes back at
        # once and finds its task claimed (skipped); the run's own ack then finds the message
        # gone, and its final write lands once (celery #6654's double run needs a claim that
        # can succeed twice; ours, from 'queued', cannot).
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_routes": {
            PURGE_TASK: {"queue": MAINTENANCE_QUEUE},
            REAP_TASK: {"queue": MAINTENANCE_QUEUE},
            SWEEP_TASK: {"queue": MAINTENANCE_QUEUE},
            FANOUT_TASK: {"queue": WEBHOOKS_QUEUE},
            DELIVER_TASK: {"queue": WEBHOOKS_QUEUE},
            # Maintenance, not a delivery: it must run while receivers hold every delivery slot.
            WEBHOOK_SWEEP_TASK: {"queue": MAINTENANCE_QUEUE},
        },
        "task_default_queue": MAINTENANCE_QUEUE,
        # Task events cost ~3 ms a task; Flower turns them on in the workers when it starts
        # (enable_events), so they are off until someone watches.
        "worker_send_task_events": False,
        "task_send_sent_event": False,
        "broker_pool_limit": 20,
    }


def send_run(
    app: Celery,
    task_id: uuid.UUID,
    queue: str,
    *,
    trace_id: str,
    tenant: str,
    deadline_at: datetime | None = None,
    countdown_s: float | None = None,
    behind: bool = False,
) -> None:
    """Publish the message that runs a task, from the API or from a worker (retries, sweeps).

    The message expires with the task's deadline: a task not started by then is never run
    (the sweeper then marks its row expired). ``behind``: after the other tenants' messages
    of the queue (a Redis broker's; another broker's order is its own). ``tenant`` goes in
    its headers: a worker holds at most its share of slots for one tenant's runs
    (``workers.loop_consumer``) before it has read the task.
    """
    behind = behind and app.conf.broker_url.startswith(("redis://", "rediss://"))
    app.send_task(
        RUN_TASK,
        args=[str(task_id), queue],
        task_id=str(task_id),
        queue=queue,
        headers=_run_headers(trace_id, tenant),
        expires=deadline_at,
        countdown=countdown_s,
        priority=BEHIND if behind else None,
    )


def _run_headers(trace_id: str, tenant: str) -> dict[str, str]:
    """A run message's own headers: its trace (``trace_id``, and as W3C ``traceparent``,
    which OpenTelemetry's Celery instrumentation continues the caller's trace from; without
    it each worker span began a trace of its own) and its tenant."""
    return {"trace_id": trace_id, "traceparent": traceparent(trace_id), TENANT_HEADER: tenant}


def redis_run_message(
    app: Celery,
    task_id: uuid.UUID,
    queue: str,
    *,
    trace_id: str,
    tenant: str,
    deadline_at: datetime | None,
    behind: bool = False,
) -> tuple[str, bytes]:
    """The list kombu's Redis transport LPUSHes ``send_run``'s message onto (no countdown),
    and the message's bytes.

    Celery's own ``as_task_v2`` builds the task message (protocol 2); this adds the envelope
    kombu's virtual transport wraps it in: JSON body, base64-encoded, priority 0 (``BEHIND``
    when ``behind``). The API pushes it in the same Redis call as the task's ``queued`` event,
    so a submit needs neither a thread nor a second round trip; a stock Celery worker cannot
    tell the difference.
    """
    priority = BEHIND if behind else 0
    message = app.amqp.as_task_v2(
        str(task_id), RUN_TASK, args=[str(task_id), queue], expires=deadline_at, ignore_result=None
    )
    headers = {**message.headers, **_run_headers(trace_id, tenant)}
    properties: dict[str, Any] = {
        **message.properties,
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": queue},
        "priority": priority,
        "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4()),
    }
    if deadline_at is not None:  # what Celery's send_task adds for ``expires`` (AMQP's TTL)
        left_s = max(0.0, (deadline_at - datetime.now(UTC)).total_seconds())
        properties["expiration"] = str(int(left_s * 1000))
    body = json.dumps(message.body).encode()
    envelope = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": properties,
    }
    return redis_list(queue, priority), json.dumps(envelope).encode()


def send_announce(app: Celery, task_id: uuid.UUID | str, event_type: str) -> None:
    """Ask the webhooks worker to deliver ``event_type`` (``task.succeeded``, ...) of a task
    to every endpoint that wants it. Whoever moves a task to a final state sends this."""
    app.send_task(FANOUT_TASK, args=[str(task_id), event_type], queue=WEBHOOKS_QUEUE)


def send_deliver(
    app: Celery, delivery_id: uuid.UUID | str, attempt: int, countdown_s: float | None = None
) -> None:
    """Attempt number ``attempt`` of a webhook delivery, after ``countdown_s``."""
    app.send_task(
        DELIVER_TASK,
        args=[str(delivery_id), attempt],
        queue=WEBHOOKS_QUEUE,
        countdown=countdown_s or None,
    )


# The most messages ``waiting_ids`` reads of one queue, and how many at a time.
SCAN_MAX = 20_000
SCAN_CHUNK = 1_000


def waiting_ids(app: Celery, queue: str) -> set[str] | None:
    """The ids of the tasks whose messages wait in ``queue``: a Redis broker's lists, read a
    chunk at a time from the newest (a message pushed meanwhile may be read twice, none
    that stays is missed). None on another broker, whose queue cannot be read without
    taking its messages, or past ``SCAN_MAX`` messages."""
    if not app.conf.broker_url.startswith(("redis://", "rediss://")):
        return None
    found: set[str] = set()
    total = 0
    with app.connection_for_read() as conn:
        client = conn.default_channel.client
        for key in redis_lists(queue):
            start = 0
            while True:
                chunk = client.lrange(key, start, start + SCAN_CHUNK - 1)
                start += len(chunk)
                total += len(chunk)
                if total > SCAN_MAX:
                    return None
                for raw in chunk:
                    try:
                        found.add(str(json.loads(raw)["headers"]["id"]))
                    except (ValueError, KeyError, TypeError):
                        continue  # not a task message: no id to find
                if len(chunk) < SCAN_CHUNK:
                    break
    return found


def redis_depth(app: Celery, queue: str) -> int:
    """The messages waiting in ``queue`` on a Redis broker, in all its lists: one round trip,
    on a connection of ``app``'s pool (``queue_depths`` opens one of its own)."""
    with app.pool.acquire(block=True) as conn:
        pipe = conn.default_channel.client.pipeline(transaction=False)
        for key in redis_lists(queue):
            pipe.llen(key)
        return sum(int(n) for n in pipe.execute())


def queue_depths(app: Celery, queues: list[str]) -> dict[str, int]:
    """Messages waiting in each queue, as the broker counts them.

    A queue the broker does not know holds nothing: Redis deletes an empty queue's list,
    so "not found" and "empty" are the same answer there."""
    depths: dict[str, int] = {}
    with app.connection_for_read() as conn:
        channel = conn.channel()
        for queue in queues:
            try:
                depths[queue] = channel.queue_declare(queue, passive=True).message_count
            except Exception:  # kombu raises a transport-specific "not found"
                depths[queue] = 0
                channel = conn.channel()  # AMQP closes the channel on a failed declare
        channel.close()
    return depths


class Dispatcher:
    """Publishes task messages to the queue named after the capability."""

    def __init__(self, settings: Settings) -> None:
        self.app = Celery("reach-producer", set_as_current=False)
        self.app.conf.update(celery_config(settings))
        # The broker is the Redis the events live in: a run message can be LPUSHed in the
        # same call as the task's first event (``redis_run_message``). Otherwise: ``send_run``.
        broker = settings.celery_broker_url
        self.direct = broker == settings.redis_url and broker.startswith(("redis://", "rediss://"))

    def run(self, due: Due, *, behind: bool = False) -> None:
        """Publish the run message of a session's turn that came due (``turns``); ``behind``:
        as ``send_run``'s (``QueueBound.republish_behind`` decides it)."""
        send_run(
            self.app,
            due.task_id,
            due.queue,
            trace_id=due.trace_id,
            tenant=due.tenant,
            deadline_at=due.deadline_at,
            behind=behind,
        )

    def announce(self, task_id: uuid.UUID, event_type: str) -> None:
        send_announce(self.app, task_id, event_type)

    def deliver(self, delivery_id: uuid.UUID, attempt: int) -> None:
        send_deliver(self.app, delivery_id, attempt)

    def revoke(self, task_id: uuid.UUID) -> None:
        """Stop a running task's process (agents that declared themselves cancellable)."""
        self.app.control.revoke(str(task_id), terminate=True, signal="SIGTERM")

    def queue_depths(self, queues: list[str]) -> dict[str, int]:
        return queue_depths(self.app, queues)

    def close(self) -> None:
        self.app.close()
