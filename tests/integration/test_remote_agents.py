"""Remote agents over the ``http`` protocol, end to end: registered through the API, served by
a real bridge worker (``celery -A workers.bridge``), called over real HTTP. The agent is the
example Node.js agent under ``node`` (``examples/agents/node``), or a loopback receiver where
a test must see the raw requests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import Engine, func, select, text
from sqlalchemy.dialects.postgresql import insert
from standardwebhooks import Webhook

from broker.db.models import agent_revocations_table, tasks_table
from broker.registry import leases, revocations
from broker.registry.model import (
    OFFLINE,
    READY,
    CardRef,
    Lease,
    card_queue,
    lease_key,
    live_key,
    now_s,
)
from broker.remote.registration import remote_instance
from broker.settings import Settings
from broker.tasks.dispatch import Dispatcher, send_run
from tests.conftest import IN_CI
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.receiver import Receiver, Reply, always
from tests.integration.remote import (
    AgentHandler,
    JsonAgent,
    LoopbackAgent,
    StreamAgent,
    assert_refused_once_its_lease_is_gone,
    events_of,
    start_bridge,
    wait_routed,
)
from tests.integration.rows import a_task_row
from tests.integration.stack import (
    ROOT,
    CeleryProcess,
    ServedApp,
    consumed_queues,
    free_port,
    wait_for_task,
)

pytestmark = pytest.mark.timeout(120)

NODE_AGENT = ROOT / "examples" / "agents" / "node" / "agent.js"
UPPER_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
}


def registration(url: str, capability: str = "text.upper", **more: Any) -> dict[str, Any]:
    return {
        "version": "1.0.0",
        "endpoint": {"protocol": "http", "url": url},
        "capabilities": [
            {
                "capability": capability,
                "input_schema": UPPER_SCHEMA if capability == "text.upper" else None,
                "timeout_s": 30,
                "idempotent": True,
                "streaming": True,
                **more,
            }
        ],
    }


class NodeAgent:
    """``node examples/agents/node/agent.js`` on a loopback port, stopped and started again
    at will (same port, same secret)."""

    def __init__(self, port: int, secret: str, log_path: Path) -> None:
        self.port, self.secret, self.log_path = port, secret, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> NodeAgent:
        node = shutil.which("node")
        if node is None:
            if IN_CI:
                pytest.fail("node is not installed: the remote agent tests need it")
            pytest.skip("node is not installed")
        env = {**os.environ, "PORT": str(self.port), "REACH_AGENT_SECRET": self.secret}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [node, str(NODE_AGENT)], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        eventually(lambda: self._healthy(), "the Node agent to answer /healthz", 15)
        return self

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stats(self) -> dict[str, Any]:
        answer: dict[str, Any] = httpx.get(f"{self.url}/stats", timeout=5).json()
        return answer


@pytest.fixture(scope="module")
def node(bridge: CeleryProcess, ops: httpx.Client, log_dir: Path) -> Iterator[NodeAgent]:
    port = free_port()
    answer = ops.put("/agents/node-upper", json=registration(f"http://127.0.0.1:{port}/run"))
    assert answer.status_code == 201, answer.text
    agent = NodeAgent(port, answer.json()["secret"], log_dir / "node-agent.log").start()
    wait_routed(ops, "node-upper")
    yield agent
    agent.stop()
    ops.delete("/agents/node-upper")


def submit(caller: httpx.Client, payload: dict[str, Any], **envelope: Any) -> httpx.Response:
    return caller.post("/tasks", json={"capability": "text.upper", "payload": payload, **envelope})


def test_registering_answers_the_secret_once_and_shows_the_agent_like_any_other(
    ops: httpx.Client, node: NodeAgent
) -> None:
    again = ops.put("/agents/node-upper", json=registration(f"{node.url}/run"))
    assert again.status_code == 200, again.text
    assert "secret" not in again.json()
    agent = ops.get("/agents/node-upper").json()
    cards = agent["cards"]
    assert [c["capability"] for c in cards] == ["text.upper"]
    assert cards[0]["endpoint"]["protocol"] == "http"
    capabilities = ops.get("/capabilities").json()["capabilities"]
    assert "text.upper" in [c["capability"] for c in capabilities]


def test_each_reply_mode_gets_the_agents_result(caller: httpx.Client, node: NodeAgent) -> None:
    queued = submit(caller, {"text": "hello remote world"})
    assert queued.status_code == 202, queued.text
    done = wait_for_task(caller, queued.json()["task_id"], {"succeeded", "failed", "expired"})
    assert done["status"] == "succeeded", done
    assert done["result"] == {"text": "HELLO REMOTE WORLD"}

    waited = submit(caller, {"text": "sync call"}, reply_mode="sync")
    assert waited.status_code == 200, waited.text
    assert waited.json()["result"] == {"text": "SYNC CALL"}

    with caller.stream(
        "POST",
        "/tasks",
        json={"capability": "text.upper", "payload": {"text": "a b c"}, "reply_mode": "stream"},
    ) as stream:
        assert stream.status_code == 200
        body = "".join(stream.iter_text())
    outputs = [
        json.loads(line[5:])["data"]
        for block in body.split("\n\n")
        if "event: output" in block
        for line in block.splitlines()
        if line.startswith("data:")
    ]
    assert [o["text"] for o in outputs] == ["A ", "B ", "C"]
    assert "event: succeeded" in body


def test_streamed_output_and_progress_arrive_as_events_in_order(
    caller: httpx.Client, node: NodeAgent
) -> None:
    words = [f"w{i}" for i in range(8)]
    task = submit(caller, {"text": " ".join(words), "delay_ms": 10}).json()
    wait_for_task(caller, task["task_id"], {"succeeded"})
    events = events_of(caller, task["task_id"])
    outputs = [data["text"].strip() for kind, data in events if kind == "output"]
    assert outputs == [w.upper() for w in words]
    progress = [data["percent"] for kind, data in events if kind == "progress"]
    assert progress == sorted(progress) and progress[-1] == 100


def test_a_long_call_is_held_by_the_bridge_and_never_reaped(
    caller: httpx.Client, node: NodeAgent, system_beat: CeleryProcess
) -> None:
    """The reaper fails a task running over a second on an instance with no lease; the
    bridge holds one for itself, so a 3 s call ends as the agent answers it."""
    text = " ".join(f"w{i}" for i in range(10))
    task = submit(caller, {"text": text, "delay_ms": 300}).json()
    done = wait_for_task(caller, task["task_id"], {"succeeded", "failed", "expired"})
    assert done["status"] == "succeeded", done.get("error")
    assert done["attempts"] == 1


def test_a_4xx_fails_at_once(caller: httpx.Client, node: NodeAgent) -> None:
    task = submit(caller, {"text": "x", "fail_status": 400, "fail_times": 5}).json()
    done = wait_for_task(caller, task["task_id"], {"succeeded", "failed"})
    assert done["status"] == "failed"
    assert done["error"]["code"] == "agent_http_400"
    assert done["attempts"] == 1


def test_a_503_is_retried_then_succeeds(caller: httpx.Client, node: NodeAgent) -> None:
    task = submit(caller, {"text": "again", "fail_status": 503, "fail_times": 1}).json()
    done = wait_for_task(caller, task["task_id"], {"succeeded", "failed"}, timeout_s=60)
    assert done["status"] == "succeeded", done
    assert done["attempts"] == 2
    assert done["result"] == {"text": "AGAIN"}


def test_the_trace_and_the_task_id_reach_the_agent(caller: httpx.Client, node: NodeAgent) -> None:
    trace_id = uuid.uuid4().hex
    answer = caller.post(
        "/tasks",
        json={"capability": "text.upper", "payload": {"text": "t"}, "reply_mode": "sync"},
        headers={"traceparent": f"00-{trace_id}-{'1' * 16}-01"},
    )
    assert answer.status_code == 200, answer.text
    seen = node.stats()["last_headers"]
    assert seen["idempotency-key"] == answer.json()["task_id"]
    assert seen["traceparent"].split("-")[1] == trace_id


def test_a_cancel_closes_the_call(caller: httpx.Client, node: NodeAgent) -> None:
    text = " ".join(f"w{i}" for i in range(100))
    task_id = submit(caller, {"text": text, "delay_ms": 200}).json()["task_id"]
    eventually(
        lambda: caller.get(f"/tasks/{task_id}").json().get("progress"),
        "the first progress",
        30,
    )
    assert caller.post(f"/tasks/{task_id}/cancel").status_code == 200
    eventually(lambda: task_id in node.stats()["cancelled"], "the agent to see the call closed")


def test_a_deadline_ends_the_call(caller: httpx.Client, node: NodeAgent) -> None:
    text = " ".join(f"w{i}" for i in range(100))
    task_id = submit(caller, {"text": text, "delay_ms": 200}, deadline_ms=1500).json()["task_id"]
    done = wait_for_task(caller, task_id, {"succeeded", "failed", "expired"})
    assert done["status"] == "expired", done

    def stopped() -> bool:  # by the deadline it was sent, or by the broker closing the call
        stats = node.stats()
        return task_id in stats["deadline_exceeded"] or task_id in stats["cancelled"]

    eventually(stopped, "the agent to stop the call at its deadline")


def test_the_signature_verifies_with_the_standard_webhooks_library(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    body = json.dumps({"result": {"ok": True}}).encode()
    reply = Reply(headers={"Content-Type": "application/json"}, body=body)
    with Receiver(always(reply)) as receiver:
        answer = ops.put(
            "/agents/sig-check", json=registration(receiver.url, capability="test.remote-sig")
        )
        assert answer.status_code == 201, answer.text
        secret = answer.json()["secret"]
        try:
            wait_routed(ops, "sig-check")
            done = caller.post(
                "/tasks",
                json={"capability": "test.remote-sig", "payload": {"n": 1}, "reply_mode": "sync"},
            )
            assert done.status_code == 200, done.text
            assert done.json()["result"] == {"ok": True}
            call = next(r for r in receiver.requests if r.path == "/hook")
            verified = Webhook(secret).verify(call.body, call.headers)
            assert verified["task_id"] == done.json()["task_id"]
            assert verified["payload"] == {"n": 1}
            assert verified["capability"] == "test.remote-sig"
        finally:
            ops.delete("/agents/sig-check")


def test_numbers_and_text_reach_the_agent_and_come_back_exactly(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    """Integers beyond 64 bits and text beyond ASCII, through every JSON step of a call: the
    claim's payload, the call's body, the agent's answer, the result row and the final
    event (``broker.jsoncodec`` reads long numbers with Python's ``json``)."""
    big = 123456789012345678901234567890
    payload = {"n": big, "m": -big, "i": 2**63 - 1, "f": 0.1, "text": "héllo ✓ \u2028"}
    result = {"echo": payload, "more": big * 10, "list": [2**64, -(2**70)]}
    reply = Reply(
        headers={"Content-Type": "application/json"}, body=json.dumps({"result": result}).encode()
    )
    with Receiver(always(reply)) as receiver:
        answer = ops.put(
            "/agents/exact", json=registration(receiver.url, capability="test.remote-exact")
        )
        assert answer.status_code == 201, answer.text
        try:
            wait_routed(ops, "exact")
            done = caller.post(
                "/tasks",
                json={"capability": "test.remote-exact", "payload": payload, "reply_mode": "sync"},
            )
            assert done.status_code == 200, done.text
            task_id = done.json()["task_id"]
            assert done.json()["result"] == result
            call = next(r for r in receiver.requests if r.path == "/hook")
            assert json.loads(call.body)["payload"] == payload
            assert caller.get(f"/tasks/{task_id}").json()["result"] == result
            final = events_of(caller, task_id)[-1]
            assert final[0] == "succeeded"
            assert final[1]["result"] == result
        finally:
            ops.delete("/agents/exact")


@pytest.mark.parametrize(
    ("agent_id", "body"),
    [
        ("bad@id", registration("http://127.0.0.1:9/run")),
        ("ok-id", {"version": "1.0.0", "endpoint": {"protocol": "http", "url": "http://x/"}}),
        ("ok-id", registration("http://127.0.0.1:9/run", capability="reach.mine")),
        # RabbitMQ refuses to declare a queue named amq.…: the bridge stopped
        ("ok-id", registration("http://127.0.0.1:9/run", capability="amq.probe")),
        # each part within its own limit, the agent's own queue past RabbitMQ's 255 bytes
        ("a" * 64, registration("http://127.0.0.1:9/run", capability=".".join(["c" * 63] * 2))),
        ("ok-id", registration("http://127.0.0.1:9/run", capability="Not A Name")),
        ("ok-id", registration("http://127.0.0.1:9/run", input_schema={"type": 12})),
        # no payload (a JSON object) passes it, and MCP's listing of every tool failed on it
        ("ok-id", registration("http://127.0.0.1:9/run", input_schema={"type": ["array"]})),
        # a reference that resolves nowhere (every submit's check then failed: a 500), or
        # only by fetching (which jsonschema would do itself, from the API's event loop)
        ("ok-id", registration("http://127.0.0.1:9/run", input_schema={"$ref": "#/$defs/no"})),
        ("ok-id", registration("http://127.0.0.1:9/run", output_schema={"$dynamicRef": "#x"})),
        ("ok-id", registration("http://127.0.0.1:9/run", input_schema={"$ref": "urn:x:y"})),
        (
            "ok-id",
            registration("http://127.0.0.1:9/run", input_schema={"$ref": "http://127.0.0.1:9/"}),
        ),
        ("ok-id", {**registration("http://127.0.0.1:9/run"), "surprise": 1}),
        ("ok-id", registration("ftp://127.0.0.1/run")),
        ("ok-id", registration("http://127.0.0.1:109593/run")),  # 109593 - 65536: a port
        ("ok-id", registration("http://169.254.169.254/latest")),
        ("ok-id", registration("http://user:pw@127.0.0.1:9/run")),
        # a tenant no key can have: its card was registered and never routed to
        ("ok-id", {**registration("http://127.0.0.1:9/run"), "tenants": ["acme\x01"]}),
    ],
)
def test_a_bad_registration_gets_422_and_writes_nothing(
    ops: httpx.Client, agent_id: str, body: dict[str, Any]
) -> None:
    answer = ops.put(f"/agents/{agent_id}", json=body)
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.json()["code"] in ("registration_invalid", "endpoint_not_allowed")
    assert ops.get(f"/agents/{agent_id}").status_code == 404


def test_a_registration_under_a_workers_agent_id_is_refused_and_its_cards_stay(
    ops: httpx.Client,
) -> None:
    # Given a worker's agent (its cards advertised, no endpoint): the dormant test capabilities'
    before = ops.get("/agents/test-dormant").json()["cards"]
    assert before and not any("endpoint" in card for card in before)
    version, capability = before[0]["version"], before[0]["capability"]
    # When an operator registers a remote agent under its id, at its version and capability
    body = {
        "version": version,
        "endpoint": {"protocol": "http", "url": "http://127.0.0.1:9/run"},
        "capabilities": [{"capability": capability}],
    }
    answer = ops.put("/agents/test-dormant", json=body)
    # Then it is refused (it used to write an endpoint over the worker's card, and routing
    # then took the worker's agent for a remote one), and the worker's cards are as they were
    assert answer.status_code == 409, answer.text
    assert answer.json()["code"] == "agent_conflict"
    assert ops.get("/agents/test-dormant").json()["cards"] == before
    assert ops.delete("/agents/test-dormant").status_code == 404


def test_only_an_operator_registers_or_removes_agents(caller: httpx.Client) -> None:
    answer = caller.put("/agents/mine", json=registration("http://127.0.0.1:9/run"))
    assert answer.status_code == 403
    assert answer.json()["code"] == "admin_required"
    assert caller.delete("/agents/mine").status_code == 403


def test_deregistering_takes_the_agent_out_of_routing(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    reply = Reply(headers={"Content-Type": "application/json"}, body=b'{"result": 1}')
    with Receiver(always(reply)) as receiver:
        created = ops.put(
            "/agents/gone-soon", json=registration(receiver.url, capability="test.remote-gone")
        )
        assert created.status_code == 201, created.text
        wait_routed(ops, "gone-soon")
        envelope = {"capability": "test.remote-gone", "payload": {}, "reply_mode": "sync"}
        assert caller.post("/tasks", json=envelope).status_code == 200
        assert ops.delete("/agents/gone-soon").status_code == 204
        refused = caller.post("/tasks", json=envelope)
        assert refused.status_code == 503
        assert refused.json()["code"] == "no_agent_available"
        assert ops.delete("/agents/gone-soon").status_code == 404


def json_reply(result: Any) -> Reply:
    body = json.dumps({"result": result}).encode()
    return Reply(headers={"Content-Type": "application/json"}, body=body)


@contextmanager
def registered(ops: httpx.Client, capability: str, agents: dict[str, Receiver]) -> Iterator[None]:
    """Each agent registered for ``capability``, in order, at its receiver; removed after."""
    try:
        for agent_id, receiver in agents.items():
            body = registration(receiver.url, capability=capability)
            assert ops.put(f"/agents/{agent_id}", json=body).status_code == 201
        yield
    finally:
        for agent_id in agents:
            ops.delete(f"/agents/{agent_id}")


def calls_to(receiver: Receiver) -> list[str]:
    """The paths of the calls the bridge made to ``receiver``, its health checks left out."""
    return [r.path for r in receiver.requests if r.path != "/healthz"]


def test_a_hint_naming_one_of_two_agents_of_a_capability_calls_that_agent(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    """Each remote agent's lease is an instance (``<agent_id>@remote``) with a queue of its own:
    a hint naming the second agent of a capability must call that agent, not the first."""
    with (
        Receiver(always(json_reply("first"))) as one,
        Receiver(always(json_reply("second"))) as two,
        registered(ops, "test.remote-hint", {"hint-first": one, "hint-second": two}),
    ):
        wait_routed(ops, "hint-first")
        wait_routed(ops, "hint-second")
        envelope = {
            "capability": "test.remote-hint",
            "payload": {},
            "reply_mode": "sync",
            "hint": remote_instance("hint-second"),
        }
        answers = [caller.post("/tasks", json=envelope).json() for _ in range(5)]
        ran = [(a.get("result"), (a.get("agent") or {}).get("agent_id")) for a in answers]
        assert ran == [("second", "hint-second")] * 5
        assert (len(calls_to(one)), len(calls_to(two))) == (0, 5)


def test_the_agent_left_in_routing_serves_its_capability_when_another_is_down(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    """With one of two agents of a capability down, routing sends to the capability's own
    queue: the bridge must call the agent that is up there, not the first it served."""
    with (
        Receiver(always(Reply(status=503, body=b"down"))) as down,
        Receiver(always(json_reply("up"))) as up,
        registered(ops, "test.remote-failover", {"failover-first": down, "failover-second": up}),
    ):
        wait_routed(ops, "failover-second")
        # Given the first agent never answered its health check, so routing has one card
        states = [i["state"] for i in ops.get("/agents/failover-first").json()["instances"]]
        assert "ready" not in states
        envelope = {"capability": "test.remote-failover", "payload": {}, "reply_mode": "sync"}
        answers = [caller.post("/tasks", json=envelope) for _ in range(5)]
        assert [(a.status_code, a.json().get("result")) for a in answers] == [(200, "up")] * 5
        assert calls_to(down) == []


def test_a_renewal_from_a_read_before_the_removal_does_not_route_to_it_again(
    ops: httpx.Client, caller: httpx.Client, redis_url: str
) -> None:
    """A bridge's tick reads the registrations, checks their health, then renews their
    leases: a removal in between must win over that renewal."""
    body = registration("http://127.0.0.1:9/run", capability="test.remote-stale")
    assert ops.put("/agents/stale-read", json=body).status_code == 201
    card = CardRef(agent_id="stale-read", version="1.0.0", capability="test.remote-stale")
    read_before = Lease(
        instance=remote_instance("stale-read"),
        state=READY,
        heartbeat_at=now_s(),
        started_at=now_s(),
        lease_ttl_s=30,
        cards=(card,),
    )
    client = redis.Redis.from_url(redis_url)
    assert leases.renew(client, read_before, removable=True).state == READY
    assert ops.delete("/agents/stale-read").status_code == 204
    assert leases.renew(client, read_before, removable=True).state == OFFLINE  # the stale tick
    assert not client.exists(lease_key(read_before.instance))
    assert client.zscore(live_key("test.remote-stale"), read_before.instance) is None
    refused = caller.post("/tasks", json={"capability": "test.remote-stale", "payload": {}})
    assert (refused.status_code, refused.json()["code"]) == (503, "no_agent_available")
    # registered again, its renewals count again
    assert ops.put("/agents/stale-read", json=body).status_code == 201
    assert leases.renew(client, read_before, removable=True).state == READY
    assert ops.delete("/agents/stale-read").status_code == 204


def test_a_killed_agent_is_refused_once_its_lease_is_gone_and_served_again_once_back(
    caller: httpx.Client, node: NodeAgent, bridge: CeleryProcess, redis_url: str
) -> None:
    """Last in this module: it stops the shared agent (and starts it again)."""
    assert_refused_once_its_lease_is_gone(
        redis.Redis.from_url(redis_url),
        bridge,
        "node-upper",
        "text.upper",
        stop=node.stop,
        submit=lambda: submit(caller, {"text": "anyone?"}),
    )
    node.start()
    back = eventually(
        lambda: submit(caller, {"text": "back"}, reply_mode="sync"),
        "the agent to be served again",
        30,
        0.2,
        lambda answer: answer.status_code == 200,
    )
    assert back.json()["result"] == {"text": "BACK"}


def test_a_remote_agents_tenants_hide_it_and_a_revoked_version_leaves_its_lease(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess, redis_url: str
) -> None:
    reply = Reply(headers={"Content-Type": "application/json"}, body=b'{"result": 1}')
    with Receiver(always(reply)) as receiver:
        # Given an agent only another tenant may use, and one every tenant may
        hidden = registration(receiver.url, capability="test.remote-hidden")
        hidden["tenants"] = ["someone-else"]
        assert ops.put("/agents/remote-hidden", json=hidden).status_code == 201
        public = registration(receiver.url, capability="test.remote-revoked")
        assert ops.put("/agents/remote-revoked", json=public).status_code == 201
        wait_routed(ops, "remote-revoked")
        # Then the hidden one is 404 to this tenant, as agent and as target
        assert caller.get("/agents/remote-hidden").json()["code"] == "agent_not_found"
        assert ops.get("/agents/remote-hidden").json()["cards"][0]["tenants"] == ["someone-else"]
        envelope = {"capability": "test.remote-hidden", "payload": {}, "reply_mode": "sync"}
        targeted = caller.post("/tasks", json={**envelope, "target": "remote-hidden@1.0.0"})
        assert targeted.status_code == 404
        assert targeted.json()["code"] == "agent_not_found"
        # When the public one's version is revoked
        envelope = {"capability": "test.remote-revoked", "payload": {}, "reply_mode": "sync"}
        assert caller.post("/tasks", json=envelope).status_code == 200
        assert ops.post("/agents/remote-revoked/versions/1.0.0/revoke").status_code == 200
        # Then the bridge's lease for it lists no card, and no request reaches it
        client = redis.Redis.from_url(redis_url)

        def cards_in_lease() -> list[Any] | None:
            raw = client.get("reach:lease:remote-revoked@remote")
            return list(json.loads(raw)["cards"]) if raw else None

        eventually(cards_in_lease, "the bridge's lease to drop the card", until=lambda c: c == [])
        refused = caller.post("/tasks", json=envelope)
        assert (refused.status_code, refused.json()["code"]) == (503, "no_agent_available")
        pinned = caller.post("/tasks", json={**envelope, "target": "remote-revoked@1.0.0"})
        assert (pinned.status_code, pinned.json()["code"]) == (410, "version_revoked")


def test_a_remote_agent_private_to_one_tenant_is_called_with_no_other_tenants_task(
    ops: httpx.Client,
    bridge: CeleryProcess,
    api: ServedApp,
    make_key: KeyMaker,
    settings: Settings,
    engine: Engine,
) -> None:
    owner, owner_key = make_key()
    stranger, stranger_key = make_key()
    with Receiver(always(json_reply("private"))) as receiver:
        # Given an agent registered for one tenant only
        body = registration(receiver.url, capability="test.remote-private")
        body["tenants"] = [owner]
        assert ops.put("/agents/remote-private", json=body).status_code == 201
        try:
            wait_routed(ops, "remote-private")
            instance = remote_instance("remote-private")
            own_queue = card_queue("test.remote-private", "remote-private", "1.0.0")
            # Then the bridge takes its tasks from its card's queue and its own, never from
            # the capability's, where any tenant's task may wait
            queues = set().union(*consumed_queues(settings).values())
            assert {own_queue, f"{own_queue}@{instance}"} <= queues
            assert "test.remote-private" not in queues
            # And a stranger's task that reaches its card's queue fails, the agent never
            # called, while its tenant's task is
            task_id = a_task_row(engine, tenant=stranger, capability="test.remote-private")
            dispatcher = Dispatcher(settings)
            try:
                send_run(
                    dispatcher.app, task_id, own_queue, trace_id=uuid.uuid4().hex, tenant=stranger
                )
            finally:
                dispatcher.close()
            with client_for(api, stranger_key) as http:
                failed = wait_for_task(http, str(task_id), {"failed", "succeeded"})
            assert (failed["error"]["code"], failed["agent"]) == ("agent_not_found", None)
            assert calls_to(receiver) == []
            envelope = {"capability": "test.remote-private", "payload": {}, "reply_mode": "sync"}
            with client_for(api, owner_key) as http:
                assert http.post("/tasks", json=envelope).json()["result"] == "private"
            assert len(calls_to(receiver)) == 1
        finally:
            ops.delete("/agents/remote-private")


def test_a_payload_its_schema_cannot_be_computed_on_is_refused_not_a_500(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    """A number the schema's check cannot compute (jsonschema's ``multipleOf`` of a float
    against a 400-digit integer raised OverflowError: a 500) is a 422 ``payload_invalid``,
    the API's connection still usable after it."""
    schema = {"type": "object", "properties": {"n": {"multipleOf": 0.5}}}
    with Receiver(always(json_reply("ok"))) as receiver:
        body = registration(receiver.url, capability="test.remote-multiple", input_schema=schema)
        assert ops.put("/agents/remote-multiple", json=body).status_code == 201
        try:
            wait_routed(ops, "remote-multiple")
            envelope = {"capability": "test.remote-multiple", "reply_mode": "sync"}
            huge = caller.post("/tasks", json={**envelope, "payload": {"n": 10**400}})
            assert huge.status_code == 422, huge.text
            assert huge.json()["code"] == "payload_invalid"
            wrong = caller.post("/tasks", json={**envelope, "payload": {"n": 1.25}})
            assert (wrong.status_code, wrong.json()["code"]) == (422, "payload_invalid")
            right = caller.post("/tasks", json={**envelope, "payload": {"n": 3}})
            assert (right.status_code, right.json()["result"]) == (200, "ok")
        finally:
            ops.delete("/agents/remote-multiple")


def test_an_agents_error_that_postgres_cannot_store_as_given_still_ends_its_task(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    """An error whose code holds a NUL and whose message a lone surrogate failed the final
    write, and the task stayed running for good; now both are stored, each such character
    replaced, and the code cut to 64 characters."""
    error = b'{"error": {"code": "bad\\u0000code' + b"x" * 100 + b'", "message": "m\\ud800"}}'
    reply = Reply(headers={"Content-Type": "application/json"}, body=error)
    with Receiver(always(reply)) as receiver:
        body = registration(receiver.url, capability="test.remote-unstorable")
        assert ops.put("/agents/remote-unstorable", json=body).status_code == 201
        try:
            wait_routed(ops, "remote-unstorable")
            envelope = {"capability": "test.remote-unstorable", "payload": {}, "reply_mode": "sync"}
            done = caller.post("/tasks", json=envelope).json()
            assert done["status"] == "failed", done
            assert done["error"]["code"] == ("bad\ufffdcode" + "x" * 100)[:64]
            assert done["error"]["message"] == "m\ufffd"
        finally:
            ops.delete("/agents/remote-unstorable")


def test_a_call_the_bridge_no_longer_holds_ends_while_the_bridge_lives_on(
    bridge: CeleryProcess, engine: Engine, caller: httpx.Client
) -> None:
    """A call whose final write failed past its retries (Postgres away) left its task
    running for good: the bridge's own lease stays renewed, so the reaper never takes it.
    The bridge now recovers what runs under its name and it does not hold."""
    # Given a task claimed under the bridge's name a minute ago, that no call of it holds
    task_id = a_task_row(engine, tenant="t-orphan", capability="test.remote-orphan")
    with engine.begin() as conn:
        conn.execute(
            tasks_table.update()
            .where(tasks_table.c.id == task_id)
            .values(
                status="running",
                attempts=1,
                instance=f"bridge@{socket.gethostname()}",
                started_at=func.now() - timedelta(minutes=1),
            )
        )
    # Then the bridge ends it: its agent is not idempotent, so it does not run again
    with engine.connect() as conn:
        ended = eventually(
            lambda: conn.execute(
                select(tasks_table.c.status, tasks_table.c.error).where(tasks_table.c.id == task_id)
            ).one(),
            "the orphaned call's task ended",
            until=lambda row: row.status != "running",
        )
    assert ended.status == "failed"
    assert ended.error["code"] == "worker_lost"


def test_two_bridges_started_with_one_name_take_none_of_each_others_calls(
    bridge: CeleryProcess,
    caller: httpx.Client,
    node: NodeAgent,
    settings: Settings,
    log_dir: Path,
) -> None:
    """Each takes the tasks running under its name that it does not hold for orphans, so two
    bridges sharing a name would end each other's calls: they see the other renewing the
    name's lease, and hold off."""
    twin = start_bridge(settings, log_dir / "bridge-twin.log")
    try:
        eventually(
            lambda: "another process renews" in bridge.output() + twin.output(),
            "either bridge to see the other renewing its name",
        )
        text = " ".join(f"w{i}" for i in range(10))  # 3 s a call
        tasks = [submit(caller, {"text": text, "delay_ms": 300}).json() for _ in range(6)]
        final = {"succeeded", "failed", "cancelled", "expired"}
        done = [wait_for_task(caller, t["task_id"], final) for t in tasks]
    finally:
        twin.stop()
    assert [(d["status"], d["attempts"]) for d in done] == [("succeeded", 1)] * 6


def test_an_agent_deregistered_ends_the_tasks_waiting_in_its_capabilitys_queue_and_takes_no_more(
    ops: httpx.Client,
    caller: httpx.Client,
    bridge: CeleryProcess,
    system_beat: CeleryProcess,
    engine: Engine,
) -> None:
    """The only agent of a capability, every tenant's: a task waiting for it waits in the
    capability's own queue, not a card's. Deregistered, the agent left its card behind, and
    the task waited there until its row expired (a day), while new ones were still taken."""
    name = uuid.uuid4().hex[:6]
    capability, agent_id = f"test.dereg-{name}", f"dereg-{name}"
    envelope = {"capability": capability, "payload": {}, "queue_if_unavailable": True}
    # nothing answers there: the agent is never up
    body = registration("http://127.0.0.1:9/run", capability=capability)
    assert ops.put(f"/agents/{agent_id}", json=body).status_code == 201
    try:
        sent = caller.post("/tasks", json=envelope)
        assert sent.status_code == 202, sent.text
        task_id = sent.json()["task_id"]
        query = select(tasks_table.c.queue).where(tasks_table.c.id == uuid.UUID(task_id))
        with engine.connect() as conn:
            assert conn.execute(query).scalar_one() == capability
        # When the agent is deregistered
        assert ops.delete(f"/agents/{agent_id}").status_code == 204
        # Then its waiting task ends, and a new one is refused at once
        ended = wait_for_task(caller, task_id, {"failed"})
        assert ended["error"]["code"] == "agent_not_found"
        refused = caller.post("/tasks", json=envelope)
        assert (refused.status_code, refused.json()["code"]) == (503, "no_agent_available")
    finally:
        ops.delete(f"/agents/{agent_id}")


def test_a_private_agent_left_does_not_keep_the_capabilitys_queue_waiting(
    ops: httpx.Client,
    caller: httpx.Client,
    bridge: CeleryProcess,
    system_beat: CeleryProcess,
    make_key: KeyMaker,
) -> None:
    """A card that names its tenants never takes from the capability's own queue: the
    public agent that did deregistered, and its tasks waited there for good while a private
    agent of the capability was registered."""
    name = uuid.uuid4().hex[:6]
    capability, public, private = f"test.left-{name}", f"left-{name}", f"mine-{name}"
    envelope = {"capability": capability, "payload": {}, "queue_if_unavailable": True}
    body = registration("http://127.0.0.1:9/run", capability=capability)
    assert ops.put(f"/agents/{public}", json=body).status_code == 201
    try:
        task_id = caller.post("/tasks", json=envelope).json()["task_id"]
        owner, _ = make_key()
        mine = {**body, "tenants": [owner]}
        assert ops.put(f"/agents/{private}", json=mine).status_code == 201
        assert ops.delete(f"/agents/{public}").status_code == 204
        ended = wait_for_task(caller, task_id, {"failed"})
        assert ended["error"]["code"] == "agent_not_found"
    finally:
        ops.delete(f"/agents/{public}")
        ops.delete(f"/agents/{private}")


def test_a_revoked_version_cannot_be_registered_again(
    ops: httpx.Client, caller: httpx.Client
) -> None:
    """Accepted (a fresh secret and all), it would never have been routed."""
    agent_id = f"rerevoked-{uuid.uuid4().hex[:6]}"
    body = registration("http://127.0.0.1:9/run", capability=f"test.{agent_id}")
    assert ops.put(f"/agents/{agent_id}", json=body).status_code == 201
    try:
        assert ops.post(f"/agents/{agent_id}/versions/1.0.0/revoke").status_code == 200
        again = ops.put(f"/agents/{agent_id}", json=body)
        assert (again.status_code, again.json()["code"]) == (410, "version_revoked")
        assert ops.delete(f"/agents/{agent_id}").status_code == 204
        fresh = ops.put(f"/agents/{agent_id}", json=body)
        assert (fresh.status_code, fresh.json()["code"]) == (410, "version_revoked")
        assert ops.get(f"/agents/{agent_id}").json()["versions"][0]["lifecycle"] == "revoked"
        # Another version is welcome
        assert ops.put(f"/agents/{agent_id}", json={**body, "version": "1.0.1"}).status_code == 201
    finally:
        ops.delete(f"/agents/{agent_id}")


def test_a_revocation_written_during_a_registration_of_its_version_is_seen(
    ops: httpx.Client, engine: Engine
) -> None:
    """A revocation of version 1.0.0 is under way (its row written, not yet committed) when a
    registration of 1.0.0 arrives. The registration read no revocation and stored the version
    anyway, never to be routed. It now waits for the revocation's turn and answers 410."""
    agent_id = f"racing-{uuid.uuid4().hex[:6]}"
    body = registration("http://127.0.0.1:9/run", capability=f"test.{agent_id}")
    assert ops.put(f"/agents/{agent_id}", json=body).status_code == 201
    try:
        # The pool last out: a failure rolls the revocation back before waiting for the PUT
        with ThreadPoolExecutor(1) as pool, engine.connect() as revoking:
            revoking.execute(revocations.agent_lock(agent_id))
            revoking.execute(
                insert(agent_revocations_table).values(
                    agent_id=agent_id, version="1.0.0", revoked_by="test"
                )
            )
            put = pool.submit(ops.put, f"/agents/{agent_id}", json=body)
            eventually(
                lambda: put.done() or _waits_for_an_advisory_lock(engine),
                "the registration answered or waits for the revocation",
            )
            revoking.commit()
            answer = put.result()
        assert (answer.status_code, answer.json()["code"]) == (410, "version_revoked")
    finally:
        ops.delete(f"/agents/{agent_id}")


def _waits_for_an_advisory_lock(engine: Engine) -> bool:
    waiting = text(
        "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
        " WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = current_database()"
    )
    with engine.connect() as conn:
        return bool(conn.execute(waiting).scalar_one())


def test_a_refusal_names_the_stable_channel_that_pins_untargeted_requests(
    ops: httpx.Client, caller: httpx.Client
) -> None:
    """A ``stable`` channel left at a version a new registration replaced refuses every
    untargeted request; the 503 said only that no live agent serves the capability."""
    agent_id = f"pinned-{uuid.uuid4().hex[:6]}"
    capability = f"test.{agent_id}"
    body = registration("http://127.0.0.1:9/run", capability=capability)
    assert ops.put(f"/agents/{agent_id}", json=body).status_code == 201
    try:
        stable = {"versions": {"1.0.0": 1}}
        assert ops.put(f"/agents/{agent_id}/channels/stable", json=stable).status_code == 200
        assert ops.put(f"/agents/{agent_id}", json={**body, "version": "2.0.0"}).status_code == 200
        refused = caller.post("/tasks", json={"capability": capability, "payload": {}})
        assert (refused.status_code, refused.json()["code"]) == (503, "no_agent_available")
        assert f"the stable channel of {agent_id} routes only to 1.0.0" in refused.json()["detail"]
    finally:
        ops.delete(f"/agents/{agent_id}")


def test_queued_tasks_of_a_remote_version_gone_for_good_move_to_its_new_version_or_end(
    ops: httpx.Client,
    caller: httpx.Client,
    bridge: CeleryProcess,
    system_beat: CeleryProcess,
    engine: Engine,
) -> None:
    """They waited in that version's queue, which no bridge consumes any more: a task with
    no deadline stayed queued until its row expired, with no final state. The sweep (every
    second here) moves or ends them."""
    name = uuid.uuid4().hex[:6]
    capability, moved_id, revoked_id = f"test.gone-{name}", f"gone-{name}", f"revoked-{name}"

    def queue_of(task_id: str) -> str:
        query = select(tasks_table.c.queue).where(tasks_table.c.id == uuid.UUID(task_id))
        with engine.connect() as conn:
            return str(conn.execute(query).scalar_one())

    def queued_for(agent_id: str) -> str:
        # nothing answers there: the agent is never up, and its task waits in its card's queue
        body = registration("http://127.0.0.1:9/run", capability=capability)
        assert ops.put(f"/agents/{agent_id}", json=body).status_code == 201
        envelope = {"capability": capability, "payload": {}, "queue_if_unavailable": True}
        sent = caller.post("/tasks", json={**envelope, "target": f"{agent_id}@1.0.0"})
        assert sent.status_code == 202, sent.text
        task_id: str = sent.json()["task_id"]
        assert queue_of(task_id) == card_queue(capability, agent_id, "1.0.0")
        return task_id

    try:
        moved, revoked = queued_for(moved_id), queued_for(revoked_id)
        # When one agent is registered again at another version, the other's version revoked
        again = {
            **registration("http://127.0.0.1:9/run", capability=capability),
            "version": "2.0.0",
        }
        assert ops.put(f"/agents/{moved_id}", json=again).status_code == 200
        assert ops.post(f"/agents/{revoked_id}/versions/1.0.0/revoke").status_code == 200
        # Then the first's task waits in the new version's queue, and the other's ends
        eventually(
            lambda: queue_of(moved),
            "the task to move to the new version's queue",
            until=lambda queue: queue == card_queue(capability, moved_id, "2.0.0"),
        )
        ended = wait_for_task(caller, revoked, {"failed"})
        assert ended["error"]["code"] == "version_revoked"
        assert caller.get(f"/tasks/{moved}").json()["status"] == "queued"
        # When the first agent is removed, its task ends too
        assert ops.delete(f"/agents/{moved_id}").status_code == 204
        ended = wait_for_task(caller, moved, {"failed"})
        assert ended["error"]["code"] == "agent_not_found"
    finally:
        ops.delete(f"/agents/{moved_id}")
        ops.delete(f"/agents/{revoked_id}")


def test_a_sessions_turns_reach_the_agent_in_order_and_what_it_writes_is_kept(
    caller: httpx.Client, node: NodeAgent
) -> None:
    """A remote agent holds a conversation as a Python agent does: each turn is sent the
    session as the turn before it left it, and writes the next revision (the Node agent
    counts the turns, in a ``session`` event before its result). It was sent the session's
    id alone, and could neither read the state nor write it."""
    made = caller.post("/sessions", json={"state": {"topic": "shouting"}})
    assert made.status_code == 201, made.text
    session_id = made.json()["session_id"]
    said = ["one", "two two", "three three three"]
    queued = [submit(caller, {"text": words}, session_id=session_id) for words in said]
    assert [q.status_code for q in queued] == [202] * 3, [q.text for q in queued]
    for answer, words in zip(queued, said, strict=True):
        done = wait_for_task(caller, answer.json()["task_id"], {"succeeded", "failed", "expired"})
        assert (done["status"], done["result"]) == ("succeeded", {"text": words.upper()}), done
    session = caller.get(f"/sessions/{session_id}").json()
    assert session["revision"] == 4
    assert session["state"] == {"topic": "shouting", "turns": 3, "last": "three three three"}


class SessionAgent(JsonAgent):
    """Answers JSON: each call's ``session`` noted, and answered with ``answer(session)``."""

    def __init__(self, answer: Any) -> None:
        self.answer, self.seen = answer, []
        super().__init__()

    def on_call(self, body: bytes) -> object:
        session = json.loads(body)["session"]
        self.seen.append(session)
        return self.answer(session)


@contextmanager
def serving(ops: httpx.Client, agent: LoopbackAgent, capability: str) -> Iterator[None]:
    """``agent`` running, registered for ``capability`` and routed to; removed after."""
    agent_id = f"sess-{uuid.uuid4().hex[:8]}"
    with agent:
        registration = {
            "version": "1.0.0",
            "endpoint": {"protocol": "http", "url": agent.url},
            "capabilities": [{"capability": capability, "timeout_s": 30, "idempotent": True}],
        }
        assert ops.put(f"/agents/{agent_id}", json=registration).status_code == 201
        try:
            wait_routed(ops, agent_id)
            yield
        finally:
            ops.delete(f"/agents/{agent_id}")


@contextmanager
def session_agent(ops: httpx.Client, answer: Any, capability: str) -> Iterator[SessionAgent]:
    agent = SessionAgent(answer)
    with serving(ops, agent, capability):
        yield agent


class CountedStreamAgent(StreamAgent):
    """A ``StreamAgent`` that counts its calls."""

    def __init__(self, events: bytes) -> None:
        self.calls = 0
        super().__init__(events)

    def write(self, handler: AgentHandler) -> None:
        self.calls += 1
        super().write(handler)


def test_a_stream_that_breaks_off_after_its_session_write_is_not_retried(
    caller: httpx.Client, ops: httpx.Client, bridge: CeleryProcess
) -> None:
    """A retry would send the revision the call wrote, and the agent apply its turn to it
    again: once written, as once output was sent, the call is not retried."""
    capability = f"test.session-{uuid.uuid4().hex[:6]}"
    agent = CountedStreamAgent(b'event: session\ndata: {"state": {"turns": 1}}\n\n')
    with serving(ops, agent, capability):
        session_id = caller.post("/sessions", json={"state": {}}).json()["session_id"]
        envelope = {"capability": capability, "payload": {}, "session_id": session_id}
        done = caller.post("/tasks", json={**envelope, "reply_mode": "sync"}).json()
    assert (done["status"], done["error"]["code"]) == ("failed", "agent_stream_broken"), done
    assert agent.calls == 1
    session = caller.get(f"/sessions/{session_id}").json()
    assert (session["revision"], session["state"]) == (2, {"turns": 1})


def test_a_json_answer_writes_the_session_beside_its_result_and_a_wrong_write_fails(
    caller: httpx.Client, ops: httpx.Client, bridge: CeleryProcess
) -> None:
    capability = f"test.session-{uuid.uuid4().hex[:6]}"

    def answer(session: Any) -> object:
        if session is None:  # a task of no session, written all the same
            return {"result": "none", "session": {"state": {}}}
        if session["state"].get("bad"):
            return {"result": "bad", "session": {"state": ["not", "an", "object"]}}
        if session["state"].get("quiet"):  # null: no write
            return {"result": "quiet", "session": None}
        return {"result": session["revision"], "session": {"state": {"n": session["revision"]}}}

    with session_agent(ops, answer, capability) as agent:
        session_id = caller.post("/sessions", json={"state": {"n": 0}}).json()["session_id"]
        envelope = {"capability": capability, "payload": {}, "reply_mode": "sync"}
        first = caller.post("/tasks", json={**envelope, "session_id": session_id}).json()
        second = caller.post("/tasks", json={**envelope, "session_id": session_id}).json()
        assert (first["result"], second["result"]) == (1, 2), (first, second)
        assert [s["revision"] for s in agent.seen] == [1, 2]
        assert agent.seen[0] == {"session_id": session_id, "revision": 1, "state": {"n": 0}}
        assert caller.get(f"/sessions/{session_id}").json()["state"] == {"n": 2}

        alone = caller.post("/tasks", json=envelope).json()
        assert (alone["status"], alone["error"]["code"]) == ("failed", "agent_protocol"), alone

        bad_id = caller.post("/sessions", json={"state": {"bad": True}}).json()["session_id"]
        bad = caller.post("/tasks", json={**envelope, "session_id": bad_id}).json()
        assert (bad["status"], bad["error"]["code"]) == ("failed", "agent_protocol"), bad
        assert caller.get(f"/sessions/{bad_id}").json()["revision"] == 1

        quiet_id = caller.post("/sessions", json={"state": {"quiet": True}}).json()["session_id"]
        quiet = caller.post("/tasks", json={**envelope, "session_id": quiet_id}).json()
        assert (quiet["status"], quiet["result"]) == ("succeeded", "quiet"), quiet
        assert caller.get(f"/sessions/{quiet_id}").json()["revision"] == 1
