"""A task's A2A push config as its deliveries carry it, through the running stack: the API's
JSON-RPC binding, the webhooks worker and real receivers on loopback."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import httpx

from tests.integration.conftest import KeyMaker
from tests.integration.receiver import Receiver, Reply
from tests.integration.stack import CeleryProcess, ServedApp


def rpc(api: ServedApp, token: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """One JSON-RPC call of the A2A binding; its result (an error fails the test)."""
    answer = httpx.post(
        f"{api.url}/a2a/jsonrpc",
        json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params},
        headers={"Authorization": f"Bearer {token}", "A2A-Version": "1.0"},
        timeout=30,
    )
    assert answer.status_code == 200 and "result" in answer.json(), answer.text
    result: dict[str, Any] = answer.json()["result"]
    return result


def push_config(url: str, token: str, credentials: str) -> dict[str, Any]:
    return {
        "url": url,
        "token": token,
        "authentication": {"scheme": "Bearer", "credentials": credentials},
    }


def test_a_replaced_push_configs_credentials_never_reach_the_url_it_replaced(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    """The delivery kept its URL, but its headers were read at each attempt from the task's
    current push config: once replaced, retries to the old URL carried the new token."""
    tenant, token = make_key()
    _, admin = make_key(tenant=tenant, tenant_admin=True)
    made = httpx.post(f"{api.url}/callbacks/secret", headers={"Authorization": f"Bearer {admin}"})
    assert made.status_code == 201, made.text
    replaced = threading.Event()

    def down_until_replaced(n: int) -> Reply:
        if n == 1:
            replaced.wait(20)  # the first attempt is under way while the config is replaced
        return Reply(503)

    with Receiver(down_until_replaced) as old, Receiver() as new:
        # Given a task whose push config names a receiver that answers 503, token T1
        sent = rpc(
            api,
            token,
            "SendMessage",
            {
                "message": {
                    "messageId": str(uuid.uuid4()),
                    "role": "ROLE_USER",
                    "parts": [{"data": {"n": 1}}],
                    "metadata": {"capability": "echo"},
                },
                "configuration": {
                    "returnImmediately": True,
                    "taskPushNotificationConfig": push_config(old.url, "tok-T1", "cred-C1"),
                },
            },
        )
        task_id = sent["task"]["id"]
        old.wait_for(1)
        # When its push config is replaced by another receiver's, with a new token
        rpc(
            api,
            token,
            "CreateTaskPushNotificationConfig",
            {"taskId": task_id, **push_config(new.url, "tok-T2", "cred-C2")},
        )
        replaced.set()
        # Expect the old receiver's retry to carry neither the new token nor its credentials
        first, retry = old.wait_for(2)
    assert json.loads(first.body)["task"]["id"] == task_id
    assert first.headers["x-a2a-notification-token"] == "tok-T1"
    assert first.headers["authorization"] == "Bearer cred-C1"
    assert "tok-T2" not in str(retry.headers) and "cred-C2" not in str(retry.headers)
    assert retry.headers["webhook-id"] == first.headers["webhook-id"]
    # And the new receiver nothing: the event was fanned out before it was named
    assert new.requests == []
