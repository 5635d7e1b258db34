"""One remote agent's health check cannot take the others offline: a real bridge checks two
``http`` agents on loopback, one of which starts answering its ``/healthz`` a byte at a time
(each byte well within the per-read timeout httpx had). Before, those checks held every
thread of the check pool, every other agent's check then failed, and every agent went
offline; now each check ends at its deadline and only the dripping agent fails."""

from __future__ import annotations

import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest

from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.remote import AgentHandler, LoopbackAgent, start_bridge, wait_routed
from tests.integration.stack import CeleryProcess

pytestmark = pytest.mark.timeout(120)

FAIL_AFTER = 2
DRIP_S = 0.5  # under the 1 s health timeout of the tests' bridge (``remote.FAST``)


class Agent(LoopbackAgent):
    """An ``http`` agent on loopback answering its calls with its name; its ``/healthz``
    answers 200 at once, or, once ``drip`` is set, a byte every ``DRIP_S`` for as long as
    the client listens. ``health_checks`` counts the health requests it got."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.drip = False
        self.health_checks = 0
        super().__init__()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        agent = self

        class Handler(AgentHandler):
            def do_GET(self) -> None:
                agent.health_checks += 1
                self.send_response(200)
                self.send_header("Content-Length", "100000" if agent.drip else "2")
                self.end_headers()
                if not agent.drip:
                    self.wfile.write(b"ok")
                    return
                try:
                    for _ in range(240):  # two minutes at most: the test's own bound
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(DRIP_S)
                except OSError:
                    pass  # the check hung up

            def do_POST(self) -> None:
                self.read_call()
                self.answer({"result": {"agent": agent.name}})

        return Handler


@pytest.fixture(scope="module")
def bridge(
    settings: Settings, log_dir: Path, system_workers: list[CeleryProcess]
) -> Iterator[CeleryProcess]:
    """A bridge with a pool of two check threads (before) that takes an agent offline after
    two failed checks, so that the old failure shows within seconds."""
    process = start_bridge(
        settings,
        log_dir / "bridge-health-checks.log",
        REACH_REMOTE_HEALTH_THREADS="2",
        REACH_REMOTE_FAIL_AFTER=str(FAIL_AFTER),
    )
    yield process
    process.stop()


def register(ops: httpx.Client, agent: Agent) -> None:
    registration = {
        "version": "1.0.0",
        "endpoint": {"protocol": "http", "url": agent.url},
        "capabilities": [{"capability": f"test.{agent.name}"}],
    }
    answer = ops.put(f"/agents/{agent.name}", json=registration)
    assert answer.status_code == 201, answer.text


def states(ops: httpx.Client, agent: Agent) -> list[str]:
    """The states of the agent's instances as the bridge recorded them."""
    answer = ops.get(f"/agents/{agent.name}")
    assert answer.status_code == 200, answer.text
    return [i.get("state") for i in answer.json().get("instances", [])]


def test_given_one_agent_dripping_its_health_answer_expect_only_it_offline(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    with Agent("health-drip") as dripping, Agent("health-steady") as steady:
        register(ops, dripping)
        register(ops, steady)
        try:
            wait_routed(ops, dripping.name)
            wait_routed(ops, steady.name)
            # When the first agent's health answer starts dripping
            dripping.drip = True
            # Then it goes offline, and routing refuses its tasks
            eventually(
                lambda: states(ops, dripping) == ["offline"], "the dripping agent offline", 60
            )
            envelope = {"capability": "test.health-drip", "payload": {}}
            refused = eventually(
                lambda: caller.post("/tasks", json=envelope),
                "routing to refuse its tasks",
                until=lambda answer: answer.status_code == 503,
            )
            assert refused.json()["code"] == "no_agent_available"
            # And the other agent's checks go on, and it stays ready, for three times as
            # many rounds as would have taken it offline
            wanted = steady.health_checks + 3 * FAIL_AFTER

            def steady_checks() -> int:
                assert states(ops, steady) == ["ready"]
                return steady.health_checks

            eventually(steady_checks, "more checks of the steady agent", 60, 0.1, wanted.__le__)
            assert "remote agent health-steady: ready ->" not in bridge.output()
            # And its tasks are answered
            answer = caller.post(
                "/tasks",
                json={"capability": "test.health-steady", "payload": {}, "reply_mode": "sync"},
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["result"] == {"agent": "health-steady"}
        finally:
            dripping.drip = False
            ops.delete(f"/agents/{dripping.name}")
            ops.delete(f"/agents/{steady.name}")
