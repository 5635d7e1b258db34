"""A remote agent whose lease ran out comes back dampened, as after failed checks. The
issue's rule: an agent goes offline after failures in a row *or at lease expiry*, and comes
back only after ``recover_after_s`` and ``recover_passes`` passes in a row. A bridge stopped
(SIGSTOP: a stall, a VM pause) for longer than the lease's TTL lets its agents' leases run
out, and routing refuses them. Before, the bridge renewed them at its first tick once awake,
as if nothing had happened, so a bridge that kept stalling made the routing table flap (the
seeds' bug 5.4)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from broker.remote.registration import remote_instance
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.remote import JsonAgent, routable, start_bridge, wait_routed
from tests.integration.stack import CeleryProcess

pytestmark = pytest.mark.timeout(120)

AGENT = "lapse-agent"
CAPABILITY = "test.lapse"
RECOVER_AFTER_S = 5  # the refusal below is seen within it


class Agent(JsonAgent):
    def on_call(self, body: bytes) -> object:
        return {"result": {"agent": AGENT}}


@pytest.fixture(scope="module")
def bridge(
    settings: Settings, log_dir: Path, system_workers: list[CeleryProcess]
) -> Iterator[CeleryProcess]:
    """A bridge of this module's own: the test stops it."""
    process = start_bridge(
        settings,
        log_dir / "bridge-lease-lapse.log",
        REACH_REMOTE_RECOVER_AFTER_S=str(RECOVER_AFTER_S),
    )
    yield process
    os.kill(process.pid, signal.SIGCONT)
    process.stop()


def states(ops: httpx.Client) -> list[str]:
    answer = ops.get(f"/agents/{AGENT}")
    assert answer.status_code == 200, answer.text
    return [i.get("state") for i in answer.json().get("instances", [])]


def test_an_agent_whose_lease_ran_out_while_its_bridge_stalled_comes_back_dampened(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    with Agent() as agent:
        registration = {
            "version": "1.0.0",
            "endpoint": {"protocol": "http", "url": agent.url},
            "capabilities": [{"capability": CAPABILITY}],
        }
        assert ops.put(f"/agents/{AGENT}", json=registration).status_code == 201
        try:
            wait_routed(ops, AGENT)
            # Given the bridge stopped until the agent's lease has run out
            os.kill(bridge.pid, signal.SIGSTOP)
            try:
                eventually(
                    lambda: not routable(client, remote_instance(AGENT), CAPABILITY),
                    "the agent's lease to run out",
                    30,
                    0.1,
                )
            finally:
                os.kill(bridge.pid, signal.SIGCONT)
            # When the bridge runs again, its agent's checks passing all along
            # Then it takes the agent offline, for the lapse
            eventually(
                lambda: "(its lease ran out" in bridge.output(), "the bridge to see the lapse"
            )
            assert f"remote agent {AGENT}: ready -> offline (its lease ran out" in bridge.output()
            eventually(lambda: states(ops) == ["offline"], "the agent recorded offline")
            envelope = {"capability": CAPABILITY, "payload": {}, "reply_mode": "sync"}
            refused = caller.post("/tasks", json=envelope)
            assert (refused.status_code, refused.json()["code"]) == (503, "no_agent_available")
            # And it comes back as after failed checks: once passes have held it offline
            # for recover_after_s, and only then
            back = eventually(
                lambda: caller.post("/tasks", json=envelope),
                "the agent to be served again",
                30,
                0.2,
                lambda answer: answer.status_code == 200,
            )
            assert back.json()["result"] == {"agent": AGENT}
            log = bridge.output()
            lapse = log.index(f"remote agent {AGENT}: ready -> offline (its lease ran out")
            assert log.index(f"remote agent {AGENT}: offline -> ready", lapse) > lapse
        finally:
            assert ops.delete(f"/agents/{AGENT}").status_code == 204
