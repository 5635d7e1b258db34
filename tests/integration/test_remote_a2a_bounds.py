"""What one A2A agent may cost a bridge whose calls, every tenant's, share one event loop: an
answer or event holding more JSON elements than the bridge parses (``MAX_ANSWER_ELEMENTS``)
fails its task before the a2a-sdk parses it, and the bridge goes on serving the others; a
payload an A2A message cannot carry fails its task without a traceback. A real bridge worker
(``celery -A workers.bridge``), a loopback agent speaking JSON-RPC, and the example A2A agent
(the a2a-sdk's server side) as the well-behaved one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from broker.remote.connections import MAX_ANSWER_ELEMENTS
from broker.settings import Settings
from tests.integration import remote
from tests.integration.remote import LoopbackAgent, QuietHandler, wait_routed
from tests.integration.stack import CeleryProcess, ServedApp, wait_for_task
from tests.integration.test_remote_a2a import A2AAgent, registered_agent, registration

pytestmark = pytest.mark.timeout(120)

TOO_MANY = [0] * (MAX_ANSWER_ELEMENTS + 50_000)  # 300 KB: far from the 16 MiB byte cap
WORKING = {"id": "t1", "contextId": "c1", "status": {"state": "TASK_STATE_WORKING"}}
ARTIFACT = {"artifactId": "a1", "parts": [{"data": TOO_MANY}]}
COMPLETED = {"taskId": "t1", "contextId": "c1", "status": {"state": "TASK_STATE_COMPLETED"}}
WORKING_NOW = {"status": WORKING["status"]}
# What the agent sends past the cap, by the way it answers: an event of its stream (an
# artifact update, or a status update's metadata), or the task GetTask answers.
EVENTS = {
    "artifact": {"artifactUpdate": {"taskId": "t1", "contextId": "c1", "artifact": ARTIFACT}},
    "status": {"statusUpdate": {**COMPLETED, **WORKING_NOW, "metadata": {"junk": TOO_MANY}}},
}


class PastTheCap(LoopbackAgent):
    """An A2A agent whose card is at ``card_url``, its JSON-RPC interface at ``/rpc``: it
    streams ``EVENTS[kind]`` then completes its task, or for ``"polled"`` (a card that does not
    stream) answers GetTask with its task completed, holding ``TOO_MANY`` in its artifact."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        super().__init__()
        self.origin = self.url.removesuffix("/run")
        self.card_url = f"{self.origin}/card"

    def card(self) -> dict[str, Any]:
        return {
            "name": "Past the cap",
            "description": "Answers more than the bridge parses.",
            "version": "1",
            "supportedInterfaces": [{"url": f"{self.origin}/rpc", "protocolBinding": "JSONRPC"}],
            "capabilities": {"streaming": self.kind != "polled"},
            "skills": [{"id": "echo", "name": "Echo", "description": "Echoes."}],
        }

    def answer(self, request: dict[str, Any]) -> tuple[str, bytes]:
        def result(value: dict[str, Any]) -> bytes:
            return json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": value}).encode()

        if request["method"] == "SendStreamingMessage":
            events = [{"task": WORKING}, EVENTS[self.kind], {"statusUpdate": COMPLETED}]
            stream = b"".join(b"data: " + result(e) + b"\n\n" for e in events)
            return "text/event-stream", stream
        if request["method"] == "GetTask":
            done = {**WORKING, "status": COMPLETED["status"], "artifacts": [ARTIFACT]}
            return "application/json", result(done)
        return "application/json", result({"task": WORKING})

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        agent = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                self.reply("application/json", json.dumps(agent.card()).encode())

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                self.reply(*agent.answer(json.loads(self.rfile.read(length))))

            def reply(self, kind: str, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler


@pytest.fixture(scope="module")
def api(settings: Settings) -> Iterator[ServedApp]:
    """The API at the default payload limit, 1 MiB (the tests' settings say 64 KiB): a payload
    past the element cap is one a caller may send."""
    with ServedApp(create_app(settings.model_copy(update={"max_payload_bytes": 2**20}))) as api:
        yield api


@pytest.fixture(scope="module")
def bridge(
    settings: Settings, log_dir: Path, system_workers: list[CeleryProcess]
) -> Iterator[CeleryProcess]:
    """A bridge that waits 30 s for an agent's first event, not the tests' 5: a payload of
    300,000 elements is converted in pure Python on both sides (ParseDict), which took past
    5 s three times running on a loaded 2-core machine (CI, 2026-12-08: ``agent_timeout``)."""
    process = remote.start_bridge(
        settings, log_dir / "bridge-a2a-bounds.log", REACH_REMOTE_FIRST_BYTE_TIMEOUT_S="30"
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def calm(bridge: CeleryProcess, ops: httpx.Client, log_dir: Path) -> Iterator[A2AAgent]:
    """The example agent, registered as ``a2a-calm`` with the prefix ``calm``."""
    with registered_agent(ops, log_dir / "a2a-agent-bounds.log", "a2a-calm", "calm") as served:
        yield served


def ended(caller: httpx.Client, capability: str, payload: Any) -> dict[str, Any]:
    task_id = caller.post("/tasks", json={"capability": capability, "payload": payload})
    assert task_id.status_code == 202, task_id.text
    done = wait_for_task(
        caller, task_id.json()["task_id"], {"succeeded", "failed", "expired"}, timeout_s=60
    )
    return dict(done)


@pytest.mark.parametrize("kind", ["artifact", "status", "polled"])
def test_an_answer_past_the_element_cap_fails_its_task_and_the_bridge_serves_the_others(
    kind: str, ops: httpx.Client, caller: httpx.Client, calm: A2AAgent
) -> None:
    """The a2a-sdk parsed each answer and event into protobuf in Python, on the loop every
    tenant's calls share: 16 MiB of ``[0,0,...]`` held it 20 s. These were parsed, and their
    tasks succeeded."""
    with PastTheCap(kind) as agent:
        # Given an agent that sends more elements than the cap, in one event or answer
        answer = ops.put(f"/agents/a2a-{kind}", json=registration(agent.card_url, kind))
        assert answer.status_code == 201, answer.text
        try:
            wait_routed(ops, f"a2a-{kind}")
            # When a task is sent to it
            done = ended(caller, f"{kind}.echo", {"x": 1})
        finally:
            ops.delete(f"/agents/a2a-{kind}")
    # Then it fails, refused before parsing, at once
    assert done["status"] == "failed", done
    assert done["error"]["code"] == "agent_protocol"
    assert done["error"]["message"] == (
        f"the agent's answer holds more than {MAX_ANSWER_ELEMENTS} elements"
    )
    assert done["attempts"] == 1
    # And another agent's task through the same bridge succeeds
    echoed = ended(caller, "calm.echo", {"city": "Braga"})
    assert echoed["status"] == "succeeded", echoed.get("error")
    assert [a["parts"] for a in echoed["result"]["artifacts"]] == [[{"data": {"city": "Braga"}}]]


def test_a_payload_an_a2a_message_cannot_carry_fails_payload_invalid_without_a_traceback(
    caller: httpx.Client, calm: A2AAgent, bridge: CeleryProcess
) -> None:
    """The API takes integers of up to 4,300 digits; protobuf's ``Value`` holds a double:
    the bridge raised OverflowError, logged its traceback and failed the task
    ``agent_error: OverflowError: ...``."""
    done = ended(caller, "calm.echo", {"n": 10**400})
    assert done["status"] == "failed", done
    assert done["error"]["code"] == "payload_invalid"
    assert done["error"]["retryable"] is False
    assert done["attempts"] == 1
    assert f"failed on task {done['task_id']}" not in bridge.output()  # the runner's traceback


@pytest.mark.parametrize("flags", [(), ("--no-streaming",)], ids=["streamed", "polled"])
def test_a_payload_past_the_element_cap_reaches_the_agent_and_its_small_answer_comes_back(
    ops: httpx.Client,
    caller: httpx.Client,
    bridge: CeleryProcess,
    log_dir: Path,
    flags: tuple[str, ...],
) -> None:
    """The a2a-sdk agent keeps the message in its task's history, and answered it with the
    task (the first event, the answer at once, every GetTask): the bridge refused its own
    payload coming back, ``agent_protocol``, for every payload of more elements than the cap.
    The bridge asks for no history now."""
    # Given an agent (streaming, or polled) and a payload of more elements than the cap
    name = "history-" + ("polled" if flags else "streamed")
    payload = {"text": "One. Two.", "pad": TOO_MANY}
    with registered_agent(ops, log_dir / f"a2a-{name}.log", name, name, *flags):
        # When a task takes it to the agent, which answers with its summary
        done = ended(caller, f"{name}.summarize", payload)
    # Then the task succeeds with that answer
    assert done["status"] == "succeeded", done.get("error")
    assert done["result"]["text"] == "One.\nTwo."
