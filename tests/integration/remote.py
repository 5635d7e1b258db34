"""What the remote-agent tests share: a bridge worker with its clocks shortened, a wait for
an agent to be routed, and an ``http`` agent of a test's own on loopback. Their fixtures
(``bridge``, ``ops``, ``caller``) are in the integration conftest."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import httpx
import redis

from broker.registry.model import Lease, lease_key, live_key, now_s
from broker.remote.registration import remote_instance
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.stack import CeleryProcess

# The bridge's clocks, shortened so that the dampening shows within seconds.
FAST = {
    "REACH_REMOTE_HEALTH_INTERVAL_S": "0.2",
    "REACH_REMOTE_HEALTH_TIMEOUT_S": "1",
    "REACH_REMOTE_RECOVER_AFTER_S": "1",
    "REACH_REMOTE_LEASE_TTL_S": "3",
    "REACH_REMOTE_FIRST_BYTE_TIMEOUT_S": "5",
}


def start_bridge(settings: Settings, log_path: Path, **env: str) -> CeleryProcess:
    """``celery -A workers.bridge worker -P threads``, with the ``FAST`` clocks and ``env``."""
    args = ["worker", "-P", "threads", "-c", "50", "-n", "bridge@%h", "-l", "INFO"]
    args += ["--without-gossip", "--without-mingle"]
    environment = {**FAST, **env}
    return CeleryProcess(args, settings, log_path, environment, app="workers.bridge").start(
        " ready."
    )


def wait_routed(ops: httpx.Client, agent_id: str, timeout_s: float = 30) -> None:
    """Until the bridge holds the agent's lease and routing may pick it."""

    def states() -> list[str]:
        answer = ops.get(f"/agents/{agent_id}")
        if answer.status_code != 200:
            return []
        return [i.get("state") for i in answer.json().get("instances", [])]

    eventually(states, f"{agent_id} to be ready", timeout_s, 0.1, lambda s: "ready" in s)


def stored_lease(client: redis.Redis, instance: str, capability: str) -> Lease:
    """The instance's lease as the bridge stored it, read in one transaction with its entry in
    the capability's live index and its key's time to live. Asserts the store bounds it: the
    index names it until its heartbeat plus its TTL, and its key lives no longer than the TTL,
    so routing takes it past that only if the bridge renews it."""
    with client.pipeline(transaction=True) as pipe:
        pipe.get(lease_key(instance))
        pipe.zscore(live_key(capability), instance)
        pipe.pttl(lease_key(instance))
        raw, expires_at, ttl_ms = pipe.execute()
    assert raw is not None, f"{instance} holds no lease"
    lease = Lease.from_json(raw)
    assert expires_at == lease.heartbeat_at + lease.lease_ttl_s, (expires_at, lease)
    assert 0 < ttl_ms <= lease.lease_ttl_s * 1000, (ttl_ms, lease)
    return lease


def routable(client: redis.Redis, instance: str, capability: str) -> bool:
    """Whether routing could take the instance's lease now: named in the capability's live
    index until now or later, and its key still there (``routing.LIVE_LEASES_LUA``)."""
    with client.pipeline(transaction=True) as pipe:
        pipe.zscore(live_key(capability), instance)
        pipe.exists(lease_key(instance))
        expires_at, exists = pipe.execute()
    return expires_at is not None and expires_at >= now_s() and bool(exists)


def assert_refused_once_its_lease_is_gone(
    client: redis.Redis,
    bridge: CeleryProcess,
    agent_id: str,
    capability: str,
    *,
    stop: Callable[[], None],
    submit: Callable[[], httpx.Response],
) -> None:
    """Stop the agent (``stop``), and see routing refuse ``submit`` because no lease of the
    agent is left: the bridge's checks found it down and gave the lease up."""
    instance = remote_instance(agent_id)
    # Given the agent's lease as stored at the kill: routable until its heartbeat + its TTL
    held = stored_lease(client, instance, capability)
    assert held.lease_ttl_s == float(FAST["REACH_REMOTE_LEASE_TTL_S"])
    stop()
    # When routing refuses it
    refused = eventually(
        submit, "routing to refuse the dead agent", 30, 0.1, lambda a: a.status_code == 503
    )
    assert refused.json()["code"] == "no_agent_available"
    # Then it is because no lease of the agent is left to route to
    assert not routable(client, instance, capability)
    eventually(
        lambda: f"remote agent {agent_id}: suspect -> offline" in bridge.output(),
        "the bridge to have found the agent down",
    )


def events_of(caller: httpx.Client, task_id: str) -> list[tuple[str, Any]]:
    """The task's events, read from its stream to the end."""
    found: list[tuple[str, Any]] = []
    with caller.stream("GET", f"/tasks/{task_id}/events", timeout=30) as stream:
        event = None
        for line in stream.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event is not None:
                found.append((event, json.loads(line.split(":", 1)[1])["data"]))
    return found


class LoopbackAgent:
    """An ``http`` agent on a threaded HTTP server of its own on loopback, answering with the
    handler ``_handler`` gives (a ``QuietHandler``); ``url`` is its ``/run``. Set a
    subclass's own attributes before calling ``__init__``: the handler may read them."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/run"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError

    def __enter__(self) -> Self:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class JsonAgent(LoopbackAgent):
    """A ``LoopbackAgent`` whose health check answers 200 at once and whose every call is
    answered with the JSON document ``on_call`` makes of its body."""

    def on_call(self, body: bytes) -> object:
        raise NotImplementedError

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        agent = self

        class Handler(AgentHandler):
            def do_POST(self) -> None:
                self.answer(agent.on_call(self.read_call()))

        return Handler


class StreamAgent(LoopbackAgent):
    """A ``LoopbackAgent`` whose every call is answered with a text/event-stream whose body
    ``write`` sends (by default ``events``, raw, at once), then the connection closed."""

    def __init__(self, events: bytes = b"") -> None:
        self.events = events
        super().__init__()

    def write(self, handler: AgentHandler) -> None:
        handler.wfile.write(self.events)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        agent = self

        class Handler(AgentHandler):
            def do_POST(self) -> None:
                self.read_call()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                agent.write(self)

        return Handler


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing (the test's output stays the test's)."""

    def log_message(self, *args: Any) -> None:
        pass


class AgentHandler(QuietHandler):
    """A remote agent's request handler: its health check (any ``GET``) answers 200 at once,
    and ``answer`` sends a JSON document."""

    def do_GET(self) -> None:
        self.answer({"ok": True})

    def answer(self, document: object) -> None:
        body = json.dumps(document).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def read_call(self) -> bytes:
        """The call's body, read whole."""
        return self.rfile.read(int(self.headers.get("Content-Length", "0")))
