"""A remote agent's call without a deadline or a timeout of its agent's: the bridge gives it
``REACH_DEFAULT_TASK_TIMEOUT_S``, as every worker gives such a handler, so an agent that
streams for ever cannot hold the bridge's capacity for ever. The bridge here has a time limit
of its own (2 s), so it is not the integration conftest's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.remote import AgentHandler, StreamAgent, start_bridge, wait_routed
from tests.integration.stack import CeleryProcess, wait_for_task

pytestmark = pytest.mark.timeout(120)


class EndlessAgent(StreamAgent):
    """An ``http`` agent that answers every call with an event stream of comments that never
    ends (and its health check with 200); ``closed``: the task ids whose call the bridge
    closed."""

    def __init__(self) -> None:
        self.closed: list[str] = []
        super().__init__()

    def write(self, handler: AgentHandler) -> None:
        try:
            for _ in range(1200):  # two minutes at most: the test's own bound
                handler.wfile.write(b": still working\n\n")
                handler.wfile.flush()
                time.sleep(0.1)
        except OSError:
            self.closed.append(handler.headers.get("idempotency-key", ""))


@pytest.fixture(scope="module")
def bridge(
    settings: Settings, log_dir: Path, system_workers: list[CeleryProcess]
) -> Iterator[CeleryProcess]:
    process = start_bridge(
        settings, log_dir / "bridge-time-limit.log", REACH_DEFAULT_TASK_TIMEOUT_S="2"
    )
    yield process
    process.stop()


def test_a_call_without_deadline_or_timeout_ends_at_the_default_time_limit(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    card = {"capability": "test.remote-endless", "streaming": True}
    registration = {
        "version": "1.0.0",
        "endpoint": {"protocol": "http", "url": ""},
        "capabilities": [card],
    }
    with EndlessAgent() as agent:
        registration["endpoint"] = {"protocol": "http", "url": agent.url}
        assert ops.put("/agents/endless", json=registration).status_code == 201
        try:
            wait_routed(ops, "endless")
            envelope = {"capability": "test.remote-endless", "payload": {}}
            task_id = caller.post("/tasks", json=envelope).json()["task_id"]
            done = wait_for_task(caller, task_id, {"succeeded", "failed", "expired"}, 60)
            assert done["status"] == "expired", done
            # Cut by its time limit (workers.runner._failure), not by a deadline it never had
            assert done["error"]["code"] == "timeout", done
            assert done["error"]["message"] == "the agent ran past its time limit", done
            eventually(lambda: task_id in agent.closed, "the agent to see the call closed")
        finally:
            ops.delete("/agents/endless")
