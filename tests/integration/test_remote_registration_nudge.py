"""A remote agent registered while the bridge waits out its health interval is checked, and
routed once it answers, at once: the registration moves a count the bridge looks at between
its ticks (``workers.bridge.keeper``). Before, a call right after the registration was 503
``no_agent_available`` until the bridge's next tick (5 s by default).

The bridge here ticks once a minute, so only the count can route the agent within the
test's wait; the same holds for a removal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.receiver import Receiver, Reply, always
from tests.integration.remote import start_bridge, wait_routed
from tests.integration.stack import CeleryProcess

pytestmark = pytest.mark.timeout(120)

INTERVAL_S = "60"  # the bridge's ticks: none falls within the test's waits but its first


@pytest.fixture(scope="module")
def slow_bridge(
    settings: Settings, log_dir: Path, system_workers: list[CeleryProcess]
) -> Iterator[CeleryProcess]:
    process = start_bridge(
        settings,
        log_dir / "bridge-nudge.log",
        REACH_REMOTE_HEALTH_INTERVAL_S=INTERVAL_S,
        REACH_REMOTE_LEASE_TTL_S="180",
    )
    yield process
    process.stop()


def test_an_agent_registered_between_ticks_is_routed_at_once_and_removed_at_once(
    ops: httpx.Client, caller: httpx.Client, slow_bridge: CeleryProcess
) -> None:
    # Given an agent already answering, and a bridge whose next tick is a minute away
    reply = Reply(headers={"Content-Type": "application/json"}, body=b'{"result": "up"}')
    with Receiver(always(reply)) as agent:
        body = {
            "version": "1.0.0",
            "endpoint": {"protocol": "http", "url": agent.url},
            "capabilities": [{"capability": "test.nudged", "timeout_s": 10}],
        }
        # When it is registered
        assert ops.put("/agents/nudged", json=body).status_code == 201
        try:
            # Then the bridge checks it and routes it, long before its next tick
            wait_routed(ops, "nudged", timeout_s=30)
            envelope = {"capability": "test.nudged", "payload": {}, "reply_mode": "sync"}
            answer = caller.post("/tasks", json=envelope)
            assert answer.status_code == 200, answer.text
            assert answer.json()["result"] == "up"
            checks = [r for r in agent.requests if r.path == "/healthz"]
            assert checks, "the bridge routed an agent it never checked"
        finally:
            assert ops.delete("/agents/nudged").status_code == 204
        # and once removed, the bridge lets it go at once too: it stops checking it
        eventually(
            slow_bridge.output,
            "the bridge to let the agent go",
            30,
            0.2,
            lambda log: "remote agent nudged deregistered" in log,
        )
