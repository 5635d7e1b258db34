"""Where a bridge's calls to an A2A agent go: only to the interface of its card that was
checked, at an address agents may reach. The bridge here may reach 127.0.0.1 alone
(``REACH_AGENT_NETWORKS``), while the API, as the other tests', allows all of 127.0.0.0/8: so
an agent registered through it may name 127.0.0.2, where a canary counts what reaches it.
The agent is the example A2A agent (the a2a-sdk's server side), its card served apart so a
test can write it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.settings import Settings
from tests.integration.receiver import Receiver, Reply
from tests.integration.remote import start_bridge, wait_routed
from tests.integration.stack import CeleryProcess, wait_for_task
from tests.integration.test_remote_a2a import A2AAgent, registration

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def bridge(
    settings: Settings, log_dir: Path, system_workers: list[CeleryProcess]
) -> Iterator[CeleryProcess]:
    """The module's only bridge: 127.0.0.2 is loopback, refused as any local address is. Its
    health checks, which fail a card naming such an address, come every 2 s (five failures
    take an agent out of routing): a task's three attempts, checked at each call, end first."""
    process = start_bridge(
        settings,
        log_dir / "bridge-test_remote_addresses.log",
        REACH_AGENT_NETWORKS="127.0.0.1/32",
        REACH_REMOTE_HEALTH_INTERVAL_S="2",
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def agent(bridge: CeleryProcess, log_dir: Path) -> Iterator[A2AAgent]:
    served = A2AAgent(log_dir / "a2a-agent-addresses.log").start()
    yield served
    served.stop()


def serving(card: dict[str, Any]) -> Receiver:
    """A server of ``card`` as it is at each request: a test may change it."""
    headers = {"Content-Type": "application/json"}
    return Receiver(lambda _n: Reply(headers=headers, body=json.dumps(card).encode()))


def card_naming(agent: A2AAgent, *interfaces: dict[str, str]) -> dict[str, Any]:
    """The example agent's card, with ``interfaces`` for its own."""
    card: dict[str, Any] = httpx.get(agent.card_url, timeout=5).json()
    return {**card, "supportedInterfaces": list(interfaces)}


def its_json_rpc(agent: A2AAgent) -> dict[str, str]:
    """The agent's JSON-RPC interface, with no protocol version (the SDK reads it as 1.0)."""
    card = httpx.get(agent.card_url, timeout=5).json()
    (url,) = [i["url"] for i in card["supportedInterfaces"] if i["protocolBinding"] == "JSONRPC"]
    return {"url": url, "protocolBinding": "JSONRPC"}


def version_1_0_at(canary: Receiver) -> dict[str, str]:
    return {"url": canary.url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}


def echo(caller: httpx.Client, prefix: str, payload: Any) -> dict[str, Any]:
    """The task, once ended, of ``<prefix>.echo`` with ``payload``."""
    body = {"capability": f"{prefix}.echo", "payload": payload}
    task_id = caller.post("/tasks", json=body).json()["task_id"]
    wait_for_task(caller, task_id, {"succeeded", "failed", "expired"})
    task: dict[str, Any] = caller.get(f"/tasks/{task_id}").json()
    return task


def test_the_bridge_calls_the_interface_registration_checked_not_the_one_the_sdk_prefers(
    ops: httpx.Client, caller: httpx.Client, agent: A2AAgent
) -> None:
    """Registration checks the card's first interface; the a2a-sdk, given the whole card,
    called the one of protocol version 1.0, which nobody had checked."""
    card: dict[str, Any] = {}
    with Receiver(host="127.0.0.2") as canary, serving(card) as card_server:
        # Given a card whose first interface is the agent's, and then one of version 1.0
        card.update(card_naming(agent, its_json_rpc(agent), version_1_0_at(canary)))
        answer = ops.put("/agents/a2a-preferred", json=registration(card_server.url, "preferred"))
        assert answer.status_code == 201, answer.text
        try:
            wait_routed(ops, "a2a-preferred")
            # When a task is sent to it
            done = echo(caller, "preferred", {"city": "Porto"})
        finally:
            ops.delete("/agents/a2a-preferred")
    # Then the agent at the interface checked answered it, and nothing reached the other
    assert done["status"] == "succeeded", done.get("error")
    assert [a["parts"] for a in done["result"]["artifacts"]] == [[{"data": {"city": "Porto"}}]]
    assert canary.requests == []


def test_a_card_changed_after_registration_to_an_address_not_allowed_fails_its_task(
    ops: httpx.Client, caller: httpx.Client, agent: A2AAgent, bridge: CeleryProcess
) -> None:
    """The card is read again at the bridge's first call, and after each failure that may
    mean the agent moved: each time its interface is checked, as registration checks it."""
    card: dict[str, Any] = {}
    with Receiver(host="127.0.0.2") as canary, serving(card) as card_server:
        # Given an agent registered with its own interface, and routed
        card.update(card_naming(agent, its_json_rpc(agent)))
        answer = ops.put("/agents/a2a-moved", json=registration(card_server.url, "moved"))
        assert answer.status_code == 201, answer.text
        try:
            wait_routed(ops, "a2a-moved")
            # When its card now names an address agents may not reach, and a task is sent
            card.update(card_naming(agent, version_1_0_at(canary)))
            done = echo(caller, "moved", {"city": "Faro"})
        finally:
            ops.delete("/agents/a2a-moved")
    # Then the task fails saying so, and nothing reached that address; the tenant is not
    # told the address, the bridge's log is
    assert done["status"] == "failed"
    error = done["error"]
    assert error["code"] == "endpoint_not_allowed", error
    assert "127.0.0.2" not in error["message"]
    assert "127.0.0.2 is an address agents may not reach" in bridge.output()
    assert canary.requests == []
