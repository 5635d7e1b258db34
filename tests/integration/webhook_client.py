"""The webhook API as the tests drive it: register, submit, and wait on the delivery log."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.eventually import eventually

Deliveries = list[dict[str, Any]]


def register(client: httpx.Client, url: str, **spec: Any) -> tuple[dict[str, Any], str]:
    """A new subscription and its secret."""
    response = client.post("/webhooks", json={"url": url, **spec})
    assert response.status_code == 201, response.text
    body = response.json()
    return body, body.pop("secret")


def submit(client: httpx.Client, capability: str = "echo", **envelope: Any) -> dict[str, Any]:
    payload = envelope.pop("payload", {"hello": "webhooks"})
    response = client.post(
        "/tasks", json={"capability": capability, "payload": payload, **envelope}
    )
    assert response.status_code == 202, response.text
    task: dict[str, Any] = response.json()
    return task


def wait_deliveries(
    client: httpx.Client,
    path: str,
    done: Callable[[Deliveries], bool],
    timeout_s: float = 30,
) -> Deliveries:
    """Poll ``path`` until ``done`` holds for its deliveries; the timeout only bounds a hang."""

    def deliveries() -> Deliveries:
        response = client.get(path)
        assert response.status_code == 200, response.text
        found: Deliveries = response.json()["deliveries"]
        return found

    return eventually(deliveries, f"the deliveries of {path}", timeout_s, until=done)


def finished(status: str, count: int = 1) -> Callable[[Deliveries], bool]:
    """At least ``count`` deliveries, the newest in ``status``."""
    return lambda found: len(found) >= count and found[0]["status"] == status


def for_task(task_id: str, status: str) -> Callable[[Deliveries], bool]:
    return lambda found: any(d["task_id"] == task_id and d["status"] == status for d in found)
