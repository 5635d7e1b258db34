"""A remote agent's lost secret is replaced the way the README says (no route rotates it):
``DELETE /agents/{agent_id}``, then ``PUT`` it again, which answers a new secret. The agent
still running with the old one refuses the calls signed with the new one, so their tasks
fail ``agent_http_401``; restarted with the new secret, it serves again. The bridge signs
with the new secret from its next read of the registrations (every health interval): until
then its lease of the agent is the one it held, so the test waits for that read (its log)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.eventually import eventually
from tests.integration.remote import wait_routed
from tests.integration.stack import CeleryProcess, free_port, wait_for_task
from tests.integration.test_remote_agents import NodeAgent, registration, submit

pytestmark = pytest.mark.timeout(120)
AGENT = "node-rekeyed"
ENDED = {"succeeded", "failed", "expired"}


def run_once(caller: httpx.Client) -> dict[str, Any]:
    queued = submit(caller, {"text": "new key"}, target=f"{AGENT}@1.0.0")
    assert queued.status_code == 202, queued.text
    task: dict[str, Any] = wait_for_task(caller, queued.json()["task_id"], ENDED)
    return task


def served(bridge: CeleryProcess) -> int:
    """How many times the bridge began serving a registration of the agent."""
    return bridge.output().count(f"serving remote agent {AGENT} ")


def test_a_lost_secret_is_replaced_by_removing_the_agent_and_registering_it_again(
    bridge: CeleryProcess, ops: httpx.Client, caller: httpx.Client, log_dir: Path
) -> None:
    # Given a Node agent registered and serving with the secret its registration answered
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}/run"
    first = ops.put(f"/agents/{AGENT}", json=registration(endpoint))
    assert first.status_code == 201, first.text
    agent = NodeAgent(port, first.json()["secret"], log_dir / "node-rekeyed.log").start()
    try:
        wait_routed(ops, AGENT)
        assert run_once(caller)["status"] == "succeeded"
        # When the operator removes it and registers it again
        before = served(bridge)
        assert ops.delete(f"/agents/{AGENT}").status_code in (200, 204)
        again = ops.put(f"/agents/{AGENT}", json=registration(endpoint))
        # Then the registration is new, with a new secret
        assert again.status_code == 201, again.text
        assert again.json()["secret"] != first.json()["secret"]
        eventually(
            lambda: served(bridge),
            "the bridge to serve the new registration",
            until=lambda n: n > before,
        )
        wait_routed(ops, AGENT)
        # and the agent still holding the old one refuses the calls: the task fails 401
        refused = run_once(caller)
        assert (refused["status"], refused["error"]["code"]) == ("failed", "agent_http_401")
        # until it is restarted with the new secret
        agent.stop()
        agent = NodeAgent(port, again.json()["secret"], log_dir / "node-rekeyed.log").start()
        wait_routed(ops, AGENT)
        assert run_once(caller)["status"] == "succeeded"
    finally:
        agent.stop()
        ops.delete(f"/agents/{AGENT}")
