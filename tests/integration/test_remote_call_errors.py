"""What a tenant is told when the bridge's call of an ``http`` agent fails: a fixed message
for its code. The exception's text, which names the agent's address, went into the task's
error (``ClientConnectorError: Cannot connect to host 127.0.0.1:<port> ...``); tenants are
never otherwise shown where agents are. It is logged by the bridge, with the task's id."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from broker.remote.registration import remote_instance
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.receiver import Receiver
from tests.integration.remote import routable, start_bridge, stored_lease, wait_routed
from tests.integration.stack import CeleryProcess, wait_for_task

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def bridge(
    settings: Settings, log_dir: Path, system_workers: list[CeleryProcess]
) -> Iterator[CeleryProcess]:
    """The module's only bridge. An agent whose health checks fail stays routed (suspect)
    for as many as the module's tests take: a test closes its agent, then calls it."""
    process = start_bridge(
        settings, log_dir / "bridge-test_remote_call_errors.log", REACH_REMOTE_FAIL_AFTER="100000"
    )
    yield process
    process.stop()


def test_an_agent_at_a_closed_port_fails_its_task_without_showing_its_address(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    # Given an http agent, routed, whose port is then closed
    with Receiver() as agent:
        port = agent.port
        body = {
            "version": "1.0.0",
            "endpoint": {"protocol": "http", "url": agent.url},
            "capabilities": [{"capability": "test.remote-closed", "max_attempts": 1}],
        }
        assert ops.put("/agents/remote-closed", json=body).status_code == 201
        wait_routed(ops, "remote-closed")
    try:
        # When a task is sent to it
        answer = caller.post("/tasks", json={"capability": "test.remote-closed", "payload": {}})
        assert answer.status_code == 202, answer.text
        task_id = answer.json()["task_id"]
        wait_for_task(caller, task_id, {"succeeded", "failed", "expired"})
        task = caller.get(f"/tasks/{task_id}").json()
    finally:
        ops.delete("/agents/remote-closed")
    # Then it failed as unreachable, saying neither the agent's address nor its port
    assert task["status"] == "failed", task
    error = task["error"]
    assert error["code"] == "agent_unreachable", error
    shown = json.dumps(error)
    assert "127.0.0.1" not in shown and str(port) not in shown, error
    # And the bridge logged what happened, with the task's id
    logged = eventually(
        lambda: [line for line in bridge.output().splitlines() if task_id in line],
        "the bridge to log the failed call",
        until=lambda lines: any(f"127.0.0.1:{port}" in line for line in lines),
    )
    assert any("ClientConnectorError" in line for line in logged), logged


def test_an_agent_whose_checks_fail_is_routed_as_suspect_at_a_lower_score(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess, redis_url: str
) -> None:
    """Its lease said ``ready`` whatever its checks said: routed at the full score, while
    Postgres (and ``/agents``) said ``suspect``."""
    client = redis.Redis.from_url(redis_url)
    instance = remote_instance("remote-suspect")
    try:
        # Given an http agent, routed, whose port is then closed (this bridge never takes
        # it offline for failed checks)
        with Receiver() as agent:
            body = {
                "version": "1.0.0",
                "endpoint": {"protocol": "http", "url": agent.url},
                "capabilities": [{"capability": "test.remote-suspect"}],
            }
            assert ops.put("/agents/remote-suspect", json=body).status_code == 201
            wait_routed(ops, "remote-suspect")
            assert stored_lease(client, instance, "test.remote-suspect").state == "ready"
        # Then its lease says suspect once a check fails, and routing still may pick it
        eventually(
            lambda: stored_lease(client, instance, "test.remote-suspect").state,
            "the agent's lease to say suspect",
            until=lambda state: state == "suspect",
        )
        assert routable(client, instance, "test.remote-suspect")
        states = [i["state"] for i in ops.get("/agents/remote-suspect").json()["instances"]]
        assert states == ["suspect"]
    finally:
        ops.delete("/agents/remote-suspect")
        client.close()
