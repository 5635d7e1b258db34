"""Remote agents over the ``a2a`` protocol, end to end: registered through the API by their
card's URL, served by a real bridge worker (``celery -A workers.bridge``), called with the
a2a-sdk client. The agent is the example A2A agent (``examples/agents/a2a/agent.py``, the
a2a-sdk's server side) in a process of its own."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.eventually import eventually
from tests.integration.remote import (
    assert_refused_once_its_lease_is_gone,
    events_of,
    wait_routed,
)
from tests.integration.stack import ROOT, CeleryProcess, free_port, wait_for_task

pytestmark = pytest.mark.timeout(120)

A2A_AGENT = ROOT / "examples" / "agents" / "a2a" / "agent.py"
FINAL = {"succeeded", "failed", "expired", "cancelled"}
SENTENCES = ["Queues decouple callers.", "Workers scale out!", "Results wait in Postgres?"]


class A2AAgent:
    """``python examples/agents/a2a/agent.py`` on a loopback port, stopped and started again
    at will."""

    def __init__(self, log_path: Path, *flags: str) -> None:
        self.port, self.log_path, self.flags = free_port(), log_path, flags
        self.url = f"http://127.0.0.1:{self.port}"
        self.card_url = f"{self.url}/.well-known/agent-card.json"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> A2AAgent:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(A2A_AGENT), "--port", str(self.port), *self.flags],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            eventually(self._answers, "the A2A agent to serve its card", 20)
        except BaseException:
            self.stop()  # not left serving the tests after this one
            raise
        return self

    def _answers(self) -> bool:
        try:
            return httpx.get(self.card_url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stats(self) -> dict[str, Any]:
        answer: dict[str, Any] = httpx.get(f"{self.url}/stats", timeout=5).json()
        return answer


def registration(card_url: str, prefix: str, **more: Any) -> dict[str, Any]:
    return {
        "version": "1.0.0",
        "endpoint": {"protocol": "a2a", "url": card_url},
        "capability_prefix": prefix,
        **more,
    }


@pytest.fixture(scope="module")
def agent(bridge: CeleryProcess, ops: httpx.Client, log_dir: Path) -> Iterator[A2AAgent]:
    """The example agent, registered as ``a2a-travel`` with the prefix ``travel``."""
    with registered_agent(ops, log_dir / "a2a-agent.log", "a2a-travel", "travel") as served:
        yield served


@contextmanager
def registered_agent(
    ops: httpx.Client, log_path: Path, agent_id: str, prefix: str, *flags: str
) -> Iterator[A2AAgent]:
    """The example agent started, registered as ``agent_id`` with ``prefix`` and routed;
    stopped and deregistered after, whatever went wrong on the way."""
    served = A2AAgent(log_path, *flags).start()
    try:
        answer = ops.put(f"/agents/{agent_id}", json=registration(served.card_url, prefix))
        assert answer.status_code == 201, answer.text
        wait_routed(ops, agent_id)
        yield served
    finally:
        served.stop()
        ops.delete(f"/agents/{agent_id}")


def submit(caller: httpx.Client, skill: str, payload: Any, **envelope: Any) -> httpx.Response:
    body = {"capability": f"travel.{skill}", "payload": payload, **envelope}
    return caller.post("/tasks", json=body)


def test_each_skill_becomes_a_capability_under_the_prefix_with_its_description(
    ops: httpx.Client, agent: A2AAgent
) -> None:
    listed = [c["capability"] for c in ops.get("/capabilities").json()["capabilities"]]
    assert {"travel.summarize", "travel.echo"} <= set(listed)
    shown = ops.get("/agents/a2a-travel").json()
    cards = {c["capability"]: c for c in shown["cards"]}
    assert set(cards) == {"travel.summarize", "travel.echo"}
    assert cards["travel.summarize"]["description"] == "Streams a text back one sentence at a time."
    assert cards["travel.summarize"]["display_name"] == "Summarize"
    assert cards["travel.echo"]["description"] == "Answers with the data it was sent."
    assert cards["travel.echo"]["endpoint"] == {"protocol": "a2a", "skill": "echo"}
    assert cards["travel.summarize"]["streaming"] is True
    again = ops.put("/agents/a2a-travel", json=registration(agent.card_url, "travel"))
    assert again.status_code == 200, again.text
    assert again.json()["endpoint"] == {"protocol": "a2a", "url": agent.card_url}
    assert again.json()["capability_prefix"] == "travel"


def test_a_registration_bounds_every_skills_calls_in_time_and_at_once(
    ops: httpx.Client, agent: A2AAgent
) -> None:
    """An A2A card names no timeout: without one of the registration's, each skill's calls
    lasted up to REACH_DEFAULT_TASK_TIMEOUT_S (600 s)."""
    try:
        bounded = registration(agent.card_url, "travel", timeout_s=7, max_concurrency=3)
        assert ops.put("/agents/a2a-travel", json=bounded).status_code == 200
        cards = ops.get("/agents/a2a-travel").json()["cards"]
        assert {c["constraints"]["timeout_hint_ms"] for c in cards} == {7000}
        assert {c["max_concurrency"] for c in cards} == {3}
        refused = ops.put("/agents/a2a-travel", json={**bounded, "max_concurrency": 0})
        assert (refused.status_code, refused.json()["code"]) == (422, "registration_invalid")
    finally:
        again = ops.put("/agents/a2a-travel", json=registration(agent.card_url, "travel"))
        assert again.status_code == 200, again.text
    cards = ops.get("/agents/a2a-travel").json()["cards"]
    assert {c["max_concurrency"] for c in cards} == {None}


def test_echo_answers_with_the_payload_as_a_data_artifact(
    caller: httpx.Client, agent: A2AAgent
) -> None:
    payload = {"city": "Lisbon", "nights": 3, "price": 99.5, "tags": ["sea", None, True]}
    answer = submit(caller, "echo", payload, reply_mode="sync")
    assert answer.status_code == 200, answer.text
    result = answer.json()["result"]
    assert [a["parts"] for a in result["artifacts"]] == [[{"data": payload}]]
    assert result["text"] == ""


def test_summarize_streams_one_output_per_sentence_then_the_artifacts_as_result(
    caller: httpx.Client, agent: A2AAgent
) -> None:
    with caller.stream(
        "POST",
        "/tasks",
        json={
            "capability": "travel.summarize",
            "payload": {"text": " ".join(SENTENCES)},
            "reply_mode": "stream",
        },
    ) as stream:
        assert stream.status_code == 200
        task_id = stream.headers["location"].rsplit("/", 1)[-1]
        body = "".join(stream.iter_text())
    assert "event: succeeded" in body
    events = events_of(caller, task_id)
    outputs = [data for kind, data in events if kind == "output"]
    assert [o["parts"] for o in outputs[:3]] == [[{"text": s}] for s in SENTENCES]
    assert [o.get("append", False) for o in outputs[:3]] == [False, True, True]
    assert outputs[3]["parts"] == [{"data": {"sentences": 3}}]
    assert len(outputs) == 4
    progress = [data["message"] for kind, data in events if kind == "progress"]
    assert progress == ["summarizing 3 sentences"]
    done = caller.get(f"/tasks/{task_id}").json()
    assert done["result"]["text"] == "\n".join(SENTENCES)
    artifacts = done["result"]["artifacts"]
    assert [a["name"] for a in artifacts] == ["summary", "stats"]
    assert artifacts[0]["parts"] == [{"text": s} for s in SENTENCES]


def test_a_cancel_ends_the_task_cancelled_and_the_agent_hears_cancel_task(
    caller: httpx.Client, agent: A2AAgent
) -> None:
    text = " ".join(f"Sentence {i}." for i in range(50))
    task_id = submit(caller, "summarize", {"text": text, "delay_s": 0.3}).json()["task_id"]
    eventually(
        lambda: caller.get(f"/tasks/{task_id}").json().get("progress"),
        "the agent to start working",
        30,
    )
    assert caller.post(f"/tasks/{task_id}/cancel").status_code == 200
    assert wait_for_task(caller, task_id, {"cancelled", "succeeded"})["status"] == "cancelled"
    eventually(
        lambda: task_id in [c["reach_task_id"] for c in agent.stats()["cancelled"]],
        "the agent's executor to be cancelled",
        10,
    )


def test_a_deadline_ends_the_task_expired_and_the_agent_hears_cancel_task(
    caller: httpx.Client, agent: A2AAgent
) -> None:
    text = " ".join(f"Sentence {i}." for i in range(50))
    payload = {"text": text, "delay_s": 0.3}
    task_id = submit(caller, "summarize", payload, deadline_ms=1500).json()["task_id"]
    done = wait_for_task(caller, task_id, {"succeeded", "failed", "expired"})
    assert done["status"] == "expired", done.get("error")
    eventually(
        lambda: task_id in [c["reach_task_id"] for c in agent.stats()["cancelled"]],
        "the agent's executor to be cancelled",
        10,
    )


@pytest.mark.parametrize("flags", [(), ("--no-streaming",)], ids=["streamed", "polled"])
def test_a_cancel_before_the_agent_named_its_task_reaches_it_once_it_does(
    ops: httpx.Client,
    caller: httpx.Client,
    bridge: CeleryProcess,
    log_dir: Path,
    flags: tuple[str, ...],
) -> None:
    """The agent takes 2 s to name its task; the cancel comes while the bridge waits for it.
    The bridge had no task id to send ``CancelTask`` for: the agent worked on."""
    name = f"slow{len(flags)}"
    with registered_agent(ops, log_dir / f"{name}.log", name, name, *flags) as served:
        text = " ".join(f"Sentence {i}." for i in range(50))
        payload = {"text": text, "delay_s": 0.3, "start_delay_s": 2}
        body = {"capability": f"{name}.summarize", "payload": payload}
        task_id = caller.post("/tasks", json=body).json()["task_id"]
        eventually(
            lambda: caller.get(f"/tasks/{task_id}").json()["status"] == "running",
            "the bridge to call the agent",
            30,
        )
        assert caller.post(f"/tasks/{task_id}/cancel").status_code == 200
        assert wait_for_task(caller, task_id, FINAL)["status"] == "cancelled"
        eventually(
            lambda: task_id in [c["reach_task_id"] for c in served.stats()["cancelled"]],
            "the agent's executor to be cancelled",
            15,
        )


def test_a_task_the_agent_fails_fails_at_once(caller: httpx.Client, agent: A2AAgent) -> None:
    task_id = submit(caller, "echo", {"fail": "no rooms left"}).json()["task_id"]
    done = wait_for_task(caller, task_id, {"succeeded", "failed"})
    assert done["status"] == "failed"
    assert done["error"]["code"] == "agent_task_failed"
    assert done["error"]["message"] == "no rooms left"
    assert done["attempts"] == 1


def test_the_trace_the_session_and_the_task_reach_the_agent(
    caller: httpx.Client, agent: A2AAgent
) -> None:
    trace_id = uuid.uuid4().hex
    session_id = caller.post("/sessions").json()["session_id"]
    answer = caller.post(
        "/tasks",
        json={
            "capability": "travel.echo",
            "payload": {"x": 1},
            "reply_mode": "sync",
            "session_id": session_id,
        },
        headers={"traceparent": f"00-{trace_id}-{'1' * 16}-01"},
    )
    assert answer.status_code == 200, answer.text
    seen = agent.stats()
    assert seen["last_message"]["context_id"] == session_id
    assert seen["last_message"]["metadata"]["skill"] == "echo"
    assert seen["last_message"]["metadata"]["reach"]["task_id"] == answer.json()["task_id"]
    headers = seen["last_request"]["headers"]
    assert headers["traceparent"].split("-")[1] == trace_id
    assert headers["a2a-version"] == "1.0"
    assert headers["webhook-signature"].startswith("v1,")


def test_each_request_of_a_polled_call_carries_the_trace_with_a_parent_id_of_its_own(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess, log_dir: Path
) -> None:
    """W3C: a request's parent id is that request's, as an ``http`` call's is. The bridge
    sent its SendMessage's with every GetTask poll (and the cancel)."""
    trace_id = uuid.uuid4().hex
    with registered_agent(ops, log_dir / "traced.log", "traced", "traced", "--no-streaming") as a:
        text = " ".join(f"Sentence {i}." for i in range(4))
        answer = caller.post(
            "/tasks",
            json={"capability": "traced.summarize", "payload": {"text": text, "delay_s": 0.3}},
            headers={"traceparent": f"00-{trace_id}-{'1' * 16}-01"},
        )
        assert answer.status_code == 202, answer.text
        assert wait_for_task(caller, answer.json()["task_id"], FINAL)["status"] == "succeeded"
        sent = [t.split("-") for t in a.stats()["traceparents"] if t]
    ours = [parts for parts in sent if parts[1] == trace_id]
    assert len(ours) >= 2, sent  # SendMessage, then GetTask until the task ended
    parents = [parts[2] for parts in ours]
    assert len(set(parents)) == len(parents), parents
    assert "1" * 16 not in parents


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (registration("http://127.0.0.1:{free}/.well-known/agent-card.json", "t"), "invalid"),
        (registration("{agent}/stats", "t"), "invalid"),  # JSON, but not a card
        (registration("{agent}/.well-known/agent-card.json", "reach"), "invalid"),
        (registration("{card}", "t", capabilities=[{"capability": "t.x"}]), "invalid"),
        (registration("http://169.254.169.254/.well-known/agent-card.json", "t"), "not_allowed"),
    ],
)
def test_a_card_that_cannot_be_read_or_used_gets_422_and_writes_nothing(
    ops: httpx.Client, agent: A2AAgent, body: dict[str, Any], code: str
) -> None:
    url = body["endpoint"]["url"].format(free=free_port(), agent=agent.url, card=agent.card_url)
    answer = ops.put("/agents/a2a-bad", json={**body, "endpoint": {"protocol": "a2a", "url": url}})
    assert answer.status_code == 422, answer.text
    expected = {"invalid": "registration_invalid", "not_allowed": "endpoint_not_allowed"}
    assert answer.json()["code"] == expected[code]
    assert ops.get("/agents/a2a-bad").status_code == 404


def test_an_agent_that_does_not_stream_is_polled_at_its_preferred_interface(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess, log_dir: Path
) -> None:
    flags = ("--no-streaming", "--binding", "rest")
    with registered_agent(ops, log_dir / "a2a-plain.log", "a2a-plain", "plain", *flags) as plain:
        done = caller.post(
            "/tasks",
            json={
                "capability": "plain.summarize",
                "payload": {"text": " ".join(SENTENCES)},
                "reply_mode": "sync",
            },
        )
        assert done.status_code == 200, done.text
        assert done.json()["result"]["text"] == "\n".join(SENTENCES)
        outputs = [k for k, _ in events_of(caller, done.json()["task_id"]) if k == "output"]
        assert outputs == []
        assert plain.stats()["last_request"]["path"].startswith("/a2a/rest/")


def test_a_killed_agent_is_refused_once_its_lease_is_gone(
    caller: httpx.Client, agent: A2AAgent, bridge: CeleryProcess, redis_url: str
) -> None:
    """Last in this module: it stops the shared agent."""
    assert_refused_once_its_lease_is_gone(
        redis.Redis.from_url(redis_url),
        bridge,
        "a2a-travel",
        "travel.echo",
        stop=agent.stop,
        submit=lambda: submit(caller, "echo", {"anyone": "?"}),
    )


def test_an_agent_that_stops_streaming_is_called_from_its_card_as_it_is_now(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess, log_dir: Path
) -> None:
    # Given an agent whose card says it streams, called once (the bridge keeps its card)
    with registered_agent(ops, log_dir / "a2a-turned.log", "a2a-turned", "turned") as served:
        first = caller.post("/tasks", json={"capability": "turned.echo", "payload": {"n": 1}})
        done = wait_for_task(caller, first.json()["task_id"], FINAL)
        assert done["status"] == "succeeded", done
        # When it is started again on the same address without streaming (SendStreamingMessage
        # is refused now)
        served.stop()
        served.flags = ("--no-streaming",)
        served.start()
        # (a health check while it was down may have taken it offline: back once one passes)
        wait_routed(ops, "a2a-turned")
        # Then its next task is called as its card says now, and succeeds on its first attempt
        again = caller.post("/tasks", json={"capability": "turned.echo", "payload": {"n": 2}})
        done = wait_for_task(caller, again.json()["task_id"], FINAL)
        assert done["status"] == "succeeded", done.get("error")
        assert done["attempts"] == 1
        assert [a["parts"] for a in done["result"]["artifacts"]] == [[{"data": {"n": 2}}]]
