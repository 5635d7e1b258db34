"""The example Node agent (examples/agents/node/agent.js) keeps the ``http`` remote-agent
protocol: started under ``node`` on a loopback port and called over real HTTP as the broker
calls it, signed with the reference Standard Webhooks library."""

from __future__ import annotations

import base64
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook

from tests.conftest import IN_CI
from tests.eventually import eventually
from tests.integration.stack import ROOT, free_port

pytestmark = pytest.mark.timeout(60)

AGENT_JS = ROOT / "examples" / "agents" / "node" / "agent.js"
STARTUP_TIMEOUT_S = 10
BROKER_ACCEPT = "text/event-stream, application/json"


@dataclass(frozen=True)
class Agent:
    url: str
    secret: str
    process: subprocess.Popen[str]


@pytest.fixture(scope="module")
def served_cards() -> None:
    """Overrides the package's autouse fixture, which needs Postgres and Redis: the agent
    needs neither, so this module runs alone without them."""


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def new_task_id() -> str:
    return f"task-{secrets.token_hex(8)}"


@contextmanager
def running_agent(**env: str) -> Iterator[Agent]:
    """The agent under ``node`` on a free loopback port, once it says it listens."""
    node = shutil.which("node")
    if node is None:
        if IN_CI:
            pytest.fail("node must be installed in CI: the Node example agent is tested there")
        pytest.skip("node is not installed")
    port = free_port()
    secret = new_secret()
    with subprocess.Popen(
        [node, str(AGENT_JS)],
        env={**os.environ, "PORT": str(port), "REACH_AGENT_SECRET": secret, **env},
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None
            ready, _, _ = select.select([process.stdout], [], [], STARTUP_TIMEOUT_S)
            line = process.stdout.readline() if ready else ""
            assert line.startswith("listening on "), f"the agent did not start: {line!r}"
            yield Agent(f"http://127.0.0.1:{port}", secret, process)
        finally:
            process.terminate()
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def agent() -> Iterator[Agent]:
    with running_agent() as started:
        yield started


@pytest.fixture
def http(agent: Agent) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=agent.url, timeout=10) as client:
        yield client


def call_body(payload: dict[str, Any], task_id: str, deadline_at: datetime | None = None) -> str:
    return json.dumps(
        {
            "task_id": task_id,
            "capability": "text.upper",
            "payload": payload,
            "attempt": 1,
            "deadline_at": deadline_at.isoformat() if deadline_at else None,
            "session": None,
            "metadata": {},
        }
    )


def signed_headers(secret: str, body: str, signed_at: datetime | None = None) -> dict[str, str]:
    """The Standard Webhooks headers the broker sends with ``body``."""
    msg_id = f"msg_{secrets.token_hex(8)}"
    signed_at = signed_at or datetime.now(UTC)
    return {
        "Content-Type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(signed_at.timestamp())),
        "webhook-signature": Webhook(secret).sign(msg_id, signed_at, body),
    }


def call(
    http: httpx.Client,
    agent: Agent,
    payload: dict[str, Any],
    task_id: str | None = None,
    accept: str = "application/json",
) -> httpx.Response:
    body = call_body(payload, task_id or new_task_id())
    headers = {**signed_headers(agent.secret, body), "Accept": accept}
    return http.post("/run", content=body, headers=headers)


def read_events(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    """(event name, decoded data) for each SSE event in ``lines``."""
    name, data = "message", ""
    for line in lines:
        if line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data = line.removeprefix("data:").strip()
        elif line == "" and data:
            yield name, json.loads(data)
            name, data = "message", ""


def stream_events(
    http: httpx.Client, agent: Agent, payload: dict[str, Any], deadline_at: datetime | None = None
) -> list[tuple[str, Any]]:
    body = call_body(payload, new_task_id(), deadline_at)
    headers = {**signed_headers(agent.secret, body), "Accept": BROKER_ACCEPT}
    with http.stream("POST", "/run", content=body, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(read_events(response.iter_lines()))


def test_text_upper_answers_json_when_the_caller_accepts_only_json(
    http: httpx.Client, agent: Agent
) -> None:
    response = call(http, agent, {"text": "hello remote world"})

    assert response.status_code == 200
    assert response.json() == {"result": {"text": "HELLO REMOTE WORLD"}}


def test_text_upper_streams_words_in_order_then_progress_100_then_the_result(
    http: httpx.Client, agent: Agent
) -> None:
    events = stream_events(http, agent, {"text": "one two three four", "delay_ms": 5})

    outputs = "".join(data["text"] for name, data in events if name == "output")
    percents = [data["percent"] for name, data in events if name == "progress"]
    assert outputs == "ONE TWO THREE FOUR"
    assert percents == [25, 50, 75, 100]
    assert events[-1] == ("result", {"text": "ONE TWO THREE FOUR"})


def test_a_wrong_signature_is_refused_with_401_bad_signature(
    http: httpx.Client, agent: Agent
) -> None:
    body = call_body({"text": "hi"}, new_task_id())

    response = http.post("/run", content=body, headers=signed_headers(new_secret(), body))

    assert response.status_code == 401
    assert response.json()["error"]["code"] == "bad_signature"


def test_a_stale_timestamp_is_refused_with_401(http: httpx.Client, agent: Agent) -> None:
    body = call_body({"text": "hi"}, new_task_id())
    ten_minutes_ago = datetime.now(UTC) - timedelta(minutes=10)

    response = http.post(
        "/run", content=body, headers=signed_headers(agent.secret, body, ten_minutes_ago)
    )

    assert response.status_code == 401


def test_healthz_fails_after_admin_health_false_and_recovers_after_true(
    http: httpx.Client,
) -> None:
    before = http.get("/healthz")
    http.post("/admin/health", json={"ok": False}).raise_for_status()
    failing = http.get("/healthz")
    http.post("/admin/health", json={"ok": True}).raise_for_status()
    after = http.get("/healthz")

    assert (before.status_code, before.json()) == (200, {"status": "ok"})
    assert (failing.status_code, failing.json()) == (503, {"status": "failing"})
    assert (after.status_code, after.json()) == (200, {"status": "ok"})


def test_healthz_fails_from_the_start_with_health_fail_1() -> None:
    with running_agent(HEALTH_FAIL="1") as failing:
        response = httpx.get(f"{failing.url}/healthz", timeout=10)

    assert response.status_code == 503


def test_an_injected_503_fails_the_first_call_of_a_task_and_not_the_second(
    http: httpx.Client, agent: Agent
) -> None:
    task_id = new_task_id()
    payload = {"text": "again", "fail_status": 503, "fail_times": 1}

    first = call(http, agent, payload, task_id)
    second = call(http, agent, payload, task_id)

    assert first.status_code == 503
    assert first.json()["error"] == {
        "code": "injected",
        "message": "asked to answer 503",
        "retryable": True,
    }
    assert (second.status_code, second.json()) == (200, {"result": {"text": "AGAIN"}})


def test_closing_the_stream_midway_records_the_task_as_cancelled(
    http: httpx.Client, agent: Agent
) -> None:
    task_id = new_task_id()
    body = call_body({"text": "a b c d e f g h", "delay_ms": 200}, task_id)
    headers = {**signed_headers(agent.secret, body), "Accept": BROKER_ACCEPT}

    # A client of its own, so closing the response closes the only connection it had.
    with (
        httpx.Client(base_url=agent.url, timeout=10) as caller,
        caller.stream("POST", "/run", content=body, headers=headers) as response,
    ):
        first = next(read_events(response.iter_lines()))
    assert first == ("output", {"text": "A "})

    eventually(
        lambda: task_id in http.get("/stats").json()["cancelled"],
        f"{task_id} among the agent's cancelled calls",
        timeout_s=5,
    )


def test_traceparent_and_idempotency_key_reach_the_agent(http: httpx.Client, agent: Agent) -> None:
    task_id = new_task_id()
    traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    body = call_body({"text": "traced"}, task_id)
    headers = {
        **signed_headers(agent.secret, body),
        "traceparent": traceparent,
        "Idempotency-Key": task_id,
    }

    http.post("/run", content=body, headers=headers).raise_for_status()
    seen = http.get("/stats").json()["last_headers"]

    assert seen["traceparent"] == traceparent
    assert seen["idempotency-key"] == task_id


def test_a_deadline_passing_midstream_ends_with_a_deadline_exceeded_error_event(
    http: httpx.Client, agent: Agent
) -> None:
    deadline_at = datetime.now(UTC) + timedelta(milliseconds=300)
    payload = {"text": "w " * 20, "delay_ms": 100}  # 2 s of words

    events = stream_events(http, agent, payload, deadline_at)

    name, data = events[-1]
    assert name == "error" and data["code"] == "deadline_exceeded"
    assert "result" not in [name for name, _ in events]


def test_the_agent_exits_with_0_on_sigterm() -> None:
    with running_agent() as started:
        started.process.send_signal(signal.SIGTERM)
        code = started.process.wait(timeout=10)

    assert code == 0
