"""Tenant-wide webhook subscriptions and their delivery log."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reach_client.models import Delivery, Page, Webhook
from reach_client.plans import Plan, Request, path, query, send
from reach_client.retries import RetryPolicy


def create(
    policy: RetryPolicy,
    url: str,
    events: Sequence[str] | None = None,
    capabilities: Sequence[str] | None = None,
    description: str | None = None,
) -> Plan[Webhook]:
    """Subscribe ``url``; the answer's ``secret`` is shown this once."""
    body: dict[str, Any] = {"url": url}
    if events is not None:
        body["events"] = list(events)
    if capabilities is not None:
        body["capabilities"] = list(capabilities)
    if description is not None:
        body["description"] = description
    answer = yield from send(Request("POST", "/webhooks", body=body), policy)
    return Webhook.from_json(answer.json())


def list_all(policy: RetryPolicy) -> Plan[list[Webhook]]:
    answer = yield from send(Request("GET", "/webhooks"), policy)
    return [Webhook.from_json(w) for w in answer.json()["webhooks"]]


def get(policy: RetryPolicy, webhook_id: str) -> Plan[Webhook]:
    answer = yield from send(Request("GET", path("webhooks", webhook_id)), policy)
    return Webhook.from_json(answer.json())


def delete(policy: RetryPolicy, webhook_id: str) -> Plan[None]:
    yield from send(Request("DELETE", path("webhooks", webhook_id)), policy)


def deliveries(
    policy: RetryPolicy, webhook_id: str, *, limit: int | None = None, cursor: str | None = None
) -> Plan[Page[Delivery]]:
    params = query(limit=limit, cursor=cursor)
    request = Request("GET", path("webhooks", webhook_id, "deliveries"), params=params)
    answer = yield from send(request, policy)
    doc = answer.json()
    return Page([Delivery.from_json(d) for d in doc["deliveries"]], doc.get("next_cursor"))
