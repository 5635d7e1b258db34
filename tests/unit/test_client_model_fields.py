"""The client's models read every field the API answers, each typed: a document shaped as the
server renders it (field names copied from the server code named in each comment) arrives
whole in the model, times as aware datetimes, and nothing but ``.raw`` keeps the JSON.

The documents' keys are held equal to ``api.schemas`` (which ``tests/unit/test_schemas.py``
holds to the broker), and where a render function is pure, to what it renders: a field the
server adds shows up here as a failure, and then as a field to type."""

from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import UTC, datetime
from typing import Any, get_type_hints

from pydantic import BaseModel
from reach_client.models import (
    Agent,
    AgentVersion,
    Capability,
    Channel,
    Delivery,
    DeliveryAttempt,
    Event,
    Instance,
    Task,
    TaskStatus,
    Webhook,
    WebhookEvent,
)

from api import schemas
from broker.registry import views
from broker.webhooks import delivery_log, subscriptions

T0 = "2024-05-01T12:00:01.250000Z"  # broker.timestamps.iso: UTC, "Z"
T1 = "2024-05-01T12:05:00Z"
T2 = "2024-05-01T13:00:00Z"
AT0 = datetime(2024, 5, 1, 12, 0, 1, 250000, tzinfo=UTC)
AT1 = datetime(2024, 5, 1, 12, 5, tzinfo=UTC)
AT2 = datetime(2024, 5, 1, 13, 0, tzinfo=UTC)
DELIVERY_ID = uuid.UUID("0190a3b2-7c1d-7e3f-8a9b-0c1d2e3f4a5b")
WEBHOOK_ID = uuid.UUID("0190a3b2-7c1d-7e3f-8a9b-0c1d2e3f4a5c")
TASK_ID = "0190a3b2-7c1d-7e3f-8a9b-0c1d2e3f4a5d"

# broker.tasks.resource.render (_AS_STORED, "agent", _AS_STORED_AFTER_AGENT, _TIMES);
# api.schemas.TaskResource.
TASK: dict[str, Any] = {
    "task_id": TASK_ID,
    "capability": "invoice.extract",
    "status": "succeeded",
    "progress": {"percent": 100, "message": "done"},
    "result": {"total": 12},
    "error": None,
    "attempts": 1,
    "agent": {"agent_id": "invoice-extractor", "version": "2.3.1", "instance": "w1@host"},
    "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
    "session_id": None,
    "metadata": {"order": "7731"},
    "created_at": T0,
    "started_at": T0,
    "finished_at": T1,
    "expires_at": T2,
}

# broker.webhooks.delivery_log.render, its "attempts" items; api.schemas.DeliveryAttempt.
ATTEMPT: dict[str, Any] = {
    "attempt": 1,
    "at": T0,
    "status_code": 503,
    "error": "HTTP 503",
    "latency_ms": 41,
    "address": "203.0.113.7",
    "response_excerpt": "try later",
}

# broker.webhooks.delivery_log.render; api.schemas.Delivery.
DELIVERY: dict[str, Any] = {
    "delivery_id": str(DELIVERY_ID),
    "message_id": f"msg_{DELIVERY_ID.hex}",  # broker.webhooks.deliveries.message_id
    "webhook_id": str(WEBHOOK_ID),
    "kind": "subscription",
    "task_id": TASK_ID,
    "event_type": "task.succeeded",
    "url": "https://example.com/hooks/reach",
    "status": "pending",
    "attempt_count": 1,
    "next_attempt_at": T1,
    "last_status_code": 503,
    "last_error": "HTTP 503",
    "created_at": T0,
    "finished_at": T2,  # a finished one has no next attempt; both set here to see both read
    "attempts": [ATTEMPT],
}

# broker.webhooks.subscriptions.render; api.schemas.WebhookResource.
WEBHOOK: dict[str, Any] = {
    "webhook_id": str(WEBHOOK_ID),
    "url": "https://example.com/hooks/reach",
    "events": ["task.succeeded", "task.failed"],
    "capabilities": ["invoice.*"],
    "description": "billing",
    "status": "disabled",
    "disabled_at": T1,
    "disabled_reason": "410 Gone",
    "previous_secret_expires_at": T2,
    "created_at": T0,
}

# broker.registry.views.instance_view, as an operator key is shown it; api.schemas.InstanceView.
INSTANCE: dict[str, Any] = {
    "instance": "w1@host",
    "hostname": "host",
    "pid": 4242,
    "state": "offline",
    "seconds_since_heartbeat": 12.5,
    "active_tasks": 0,
    "lease_ttl_s": 30.0,
    "started_at": T0,
    "stopped_at": T1,
    "capabilities": ["invoice.extract"],
}
# views.seen_by for any other key: without views.INSTANCE_INTERNALS.
TENANT_INSTANCE = {k: v for k, v in INSTANCE.items() if k not in views.INSTANCE_INTERNALS}

# views._mark_revoked's "versions" items; api.schemas.VersionView.
VERSION: dict[str, Any] = {"version": "2.3.0", "lifecycle": "revoked", "revoked_at": T1}
# broker.registry.channels.of_agent's items; api.schemas.ChannelView.
CHANNEL: dict[str, Any] = {"versions": {"2.3.0": 0.25, "2.3.1": 0.75}, "updated_at": T0}

# broker.registry.views.agents, then seen_by; api.schemas.AgentResource.
AGENT: dict[str, Any] = {
    "agent_id": "invoice-extractor",
    "cards": [{"capability": "invoice.extract", "version": "2.3.1"}],  # CardView: Json
    "instances": [INSTANCE],
    "versions": [VERSION, {"version": "2.3.1", "lifecycle": "ready", "revoked_at": None}],
    "channels": {"stable": CHANNEL},
    "live_instances": 0,
}

# broker.registry.views.capabilities (queue_depth: operator keys only);
# api.schemas.CapabilityResource.
CAPABILITY: dict[str, Any] = {
    "capability": "invoice.extract",
    "cards": [{"agent_id": "invoice-extractor", "version": "2.3.1"}],
    "live_instances": 1,
    "window_s": 3600,
    "measured": {"tasks": 10, "success_rate": 0.9, "p50_run_s": 1.5, "p95_run_s": 4.0},
    "queue_depth": 3,
}

# broker.tasks.events.Event.sse's data line; api.schemas.StreamEvent (trace_id may be null).
STREAM_EVENT: dict[str, Any] = {
    "seq": 7,
    "type": "progress",
    "trace_id": None,
    "at": 1714564801.25,
    "data": {"percent": 40},
}

# broker.webhooks.fanout: {"type", "timestamp": iso(at), "data": render(task)}.
WEBHOOK_EVENT: dict[str, Any] = {"type": "task.succeeded", "timestamp": T1, "data": TASK}


def _names(model: type[Any]) -> set[str]:
    return {f.name for f in dataclasses.fields(model)} - {"raw"}


def test_the_documents_are_the_ones_the_api_answers() -> None:
    """Each document has exactly the schema's fields (all but the task's ``payload``, which
    only ``include=payload`` adds), so none below is made up or missed."""
    shapes: list[tuple[dict[str, Any], type[BaseModel], set[str]]] = [
        (TASK, schemas.TaskResource, {"payload"}),
        (ATTEMPT, schemas.DeliveryAttempt, set()),
        (DELIVERY, schemas.Delivery, set()),
        (WEBHOOK, schemas.WebhookResource, set()),
        (INSTANCE, schemas.InstanceView, set()),
        (VERSION, schemas.VersionView, set()),
        (CHANNEL, schemas.ChannelView, set()),
        (AGENT, schemas.AgentResource, set()),
        (CAPABILITY, schemas.CapabilityResource, set()),
        (STREAM_EVENT, schemas.StreamEvent, set()),
    ]
    for doc, schema, left_out in shapes:
        assert set(doc) == set(schema.model_fields) - left_out, schema.__name__


def test_the_documents_are_what_the_brokers_render_functions_render() -> None:
    row = {
        "id": DELIVERY_ID,
        "webhook_id": WEBHOOK_ID,
        "task_id": uuid.UUID(TASK_ID),
        "event_type": "task.succeeded",
        "url": DELIVERY["url"],
        "status": "pending",
        "attempts": 1,
        "next_attempt_at": AT1,
        "last_status_code": 503,
        "last_error": "HTTP 503",
        "created_at": AT0,
        "finished_at": AT2,
    }
    attempt = {**ATTEMPT, "at": AT0}
    assert delivery_log.render(row, [attempt]) == DELIVERY

    hook = {
        **WEBHOOK,
        "id": WEBHOOK_ID,
        "disabled_at": AT1,
        "previous_secret_expires_at": AT2,
        "created_at": AT0,
    }
    assert subscriptions.render(hook) == WEBHOOK

    instance_row = {
        "instance": "w1@host",
        "hostname": "host",
        "pid": 4242,
        "last_seen_at": AT0,
        "lease_ttl_s": 30.0,
        "started_at": AT0,
        "stopped_at": AT1,
        "cards": [{"agent_id": "invoice-extractor", "version": "2.3.1", "capability": "x"}],
    }
    rendered = views.instance_view(instance_row, None, AT0.timestamp() + 12.5)
    assert set(rendered) == set(INSTANCE)
    assert rendered["stopped_at"] == T1 and rendered["started_at"] == T0


def test_a_delivery_reads_every_field() -> None:
    delivery = Delivery.from_json(DELIVERY)
    assert set(DELIVERY) <= _names(Delivery)
    assert delivery.delivery_id == str(DELIVERY_ID)
    assert delivery.message_id == f"msg_{DELIVERY_ID.hex}"
    assert delivery.webhook_id == str(WEBHOOK_ID)
    assert delivery.kind == "subscription"
    assert delivery.task_id == TASK_ID
    assert delivery.event_type == "task.succeeded"
    assert delivery.url == "https://example.com/hooks/reach"
    assert delivery.status == "pending"
    assert delivery.attempt_count == 1
    assert delivery.next_attempt_at == AT1 and delivery.next_attempt_at.tzinfo is not None
    assert delivery.last_status_code == 503
    assert delivery.last_error == "HTTP 503"
    assert delivery.created_at == AT0
    assert delivery.finished_at == AT2
    assert delivery.raw is DELIVERY
    assert delivery.attempts == [
        DeliveryAttempt(
            attempt=1,
            status_code=503,
            error="HTTP 503",
            latency_ms=41,
            at=AT0,
            address="203.0.113.7",
            response_excerpt="try later",
        )
    ]
    assert delivery.attempts[0].raw is ATTEMPT


def test_a_callbacks_delivery_reads_as_one() -> None:
    doc = {**DELIVERY, "webhook_id": None, "kind": "callback", "next_attempt_at": None}
    delivery = Delivery.from_json(doc)
    assert (delivery.webhook_id, delivery.kind, delivery.next_attempt_at) == (
        None,
        "callback",
        None,
    )


def test_a_delivery_attempt_reads_on_its_own() -> None:
    found = DeliveryAttempt.from_json(ATTEMPT)
    assert set(ATTEMPT) <= _names(DeliveryAttempt)
    assert (found.address, found.response_excerpt, found.at) == ("203.0.113.7", "try later", AT0)
    assert found.raw is ATTEMPT


def test_a_webhook_reads_every_field() -> None:
    hook = Webhook.from_json(WEBHOOK)
    assert set(WEBHOOK) <= _names(Webhook)
    assert hook.previous_secret_expires_at == AT2
    assert hook.disabled_at == AT1 and hook.created_at == AT0
    assert (hook.status, hook.disabled_reason, hook.description) == (
        "disabled",
        "410 Gone",
        "billing",
    )
    assert hook.events == ["task.succeeded", "task.failed"] and hook.capabilities == ["invoice.*"]
    assert hook.secret is None
    assert (
        Webhook.from_json(
            {**WEBHOOK, "previous_secret_expires_at": None}
        ).previous_secret_expires_at
        is None
    )


def test_an_agent_reads_its_versions_channels_and_instances() -> None:
    agent = Agent.from_json(AGENT)
    assert set(AGENT) <= _names(Agent)
    assert agent.versions == [
        AgentVersion(version="2.3.0", lifecycle="revoked", revoked_at=AT1),
        AgentVersion(version="2.3.1", lifecycle="ready", revoked_at=None),
    ]
    assert agent.versions[0].raw is VERSION
    assert agent.channels == {
        "stable": Channel(versions={"2.3.0": 0.25, "2.3.1": 0.75}, updated_at=AT0)
    }
    assert agent.channels["stable"].raw is CHANNEL
    assert agent.live_instances == 0 and agent.capabilities == ["invoice.extract"]

    [instance] = agent.instances
    assert set(INSTANCE) <= _names(Instance)
    assert instance.lease_ttl_s == 30.0 and isinstance(instance.lease_ttl_s, float)
    assert instance.started_at == AT0
    assert instance.stopped_at == AT1
    assert (instance.instance, instance.hostname, instance.pid) == ("w1@host", "host", 4242)
    assert (instance.state, instance.seconds_since_heartbeat) == ("offline", 12.5)
    assert (instance.active_tasks, instance.capabilities) == (0, ["invoice.extract"])


def test_an_instance_as_a_tenant_key_is_shown_it() -> None:
    instance = Instance.from_json({**TENANT_INSTANCE, "state": "ready", "stopped_at": None})
    assert (instance.instance, instance.hostname, instance.pid, instance.active_tasks) == (
        None,
        None,
        None,
        None,
    )
    assert (instance.lease_ttl_s, instance.started_at, instance.stopped_at) == (30.0, AT0, None)


def test_an_older_servers_agent_without_versions_nor_channels_reads() -> None:
    older = {k: v for k, v in AGENT.items() if k not in ("versions", "channels")}
    agent = Agent.from_json(older)
    assert (agent.versions, agent.channels) == ([], {})


def test_a_capability_reads_its_window() -> None:
    capability = Capability.from_json(CAPABILITY)
    assert set(CAPABILITY) <= _names(Capability)
    assert capability.window_s == 3600
    assert (capability.live_instances, capability.queue_depth) == (1, 3)
    assert capability.success_rate == 0.9


def test_a_stream_event_with_no_trace_reads_as_none() -> None:
    event = Event.from_sse("7", "progress", json.dumps(STREAM_EVENT))
    assert event.trace_id is None
    assert (event.id, event.type, event.at, event.data) == (
        7,
        "progress",
        1714564801.25,
        {"percent": 40},
    )
    with_trace = Event.from_sse("7", "progress", json.dumps({**STREAM_EVENT, "trace_id": "tr"}))
    assert with_trace.trace_id == "tr"


def test_the_annotations_say_what_arrives() -> None:
    """What a type checker is told: a stream event's trace may be null (StreamEvent), a
    task's status is one of the contract's (TaskResource), a webhook event's time a time."""
    assert get_type_hints(Event)["trace_id"] == str | None
    assert get_type_hints(Task)["status"] == TaskStatus
    assert get_type_hints(WebhookEvent)["timestamp"] == datetime | None
    assert get_type_hints(Delivery)["next_attempt_at"] == datetime | None


def test_a_task_reads_every_field_and_any_status() -> None:
    task = Task.from_json(TASK)
    assert set(TASK) <= _names(Task)
    assert task.status == "succeeded" and task.final
    assert (task.created_at, task.started_at, task.finished_at, task.expires_at) == (
        AT0,
        AT0,
        AT1,
        AT2,
    )
    assert task.agent is not None and task.agent.version == "2.3.1"
    # A status a newer server adds is read as it is, never raised: not final, not failed.
    newer = Task.from_json({**TASK, "status": "paused"})
    assert str(newer.status) == "paused" and not newer.final
    assert newer.raise_for_status() is newer


def test_a_webhook_events_timestamp_is_a_datetime() -> None:
    event = WebhookEvent.from_json(WEBHOOK_EVENT)
    assert event.timestamp == AT1 and event.timestamp.tzinfo is not None
    assert event.task is not None and event.task.task_id == TASK_ID
    # One it cannot read is None, its text in raw: verify() raises nothing but its own error.
    odd = WebhookEvent.from_json({**WEBHOOK_EVENT, "timestamp": "x"})
    assert odd.timestamp is None and odd.raw["timestamp"] == "x"
    assert WebhookEvent.from_json({"type": "task.failed", "data": None}).timestamp is None
