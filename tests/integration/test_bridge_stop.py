"""A bridge stopped cleanly says so, as a worker does: once its calls in flight have ended,
its own row in ``agent_instances`` goes ``offline`` with a ``stopped_at``, and its lease
leaves Redis. Before, the row stayed ``ready`` until it aged out, and the lease until its
TTL."""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import Engine, select

from broker.db.models import agent_instances_table
from broker.registry.model import lease_key
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.remote import JsonAgent, start_bridge, wait_routed
from tests.integration.stack import wait_for_task
from tests.integration.test_api_outages import CuttableProxy

pytestmark = pytest.mark.timeout(120)

# How long the row is watched with a call in flight after the stop began: a bridge going
# offline at the signal (not once its calls ended) would show it within this
WATCH_S = 2.0


def own_row(engine: Engine, instance: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            select(agent_instances_table).where(agent_instances_table.c.instance == instance)
        ).first()


def states_over(engine: Engine, instance: str, seconds: float) -> set[str]:
    """Every state the instance's row had, read again and again for ``seconds``."""
    seen: set[str] = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen.add(own_row(engine, instance).state)
        time.sleep(0.05)
    return seen


class GatedAgent(JsonAgent):
    """An ``http`` agent that answers each call once ``gate`` is set; ``called`` is set when a
    call has come."""

    def __init__(self) -> None:
        self.gate, self.called = threading.Event(), threading.Event()
        super().__init__()

    def on_call(self, body: bytes) -> object:
        self.called.set()
        self.gate.wait(60)
        return {"result": {"answered": True}}


def test_a_bridge_stopped_cleanly_ends_its_calls_then_goes_offline_and_gives_up_its_lease(
    settings: Settings,
    engine: Engine,
    redis_url: str,
    log_dir: Any,
    ops: httpx.Client,
    caller: httpx.Client,
) -> None:
    instance = f"bridge@{socket.gethostname()}"
    client = redis.Redis.from_url(redis_url)
    with GatedAgent() as agent:
        registration = {
            "version": "1.0.0",
            "endpoint": {"protocol": "http", "url": agent.url},
            "capabilities": [{"capability": "test.gated-stop"}],
        }
        assert ops.put("/agents/gated-stop", json=registration).status_code == 201
        # Given a bridge that wrote its row, holds its lease and has a call in flight
        bridge = start_bridge(settings, log_dir / "bridge-clean-stop.log")
        try:
            assert bridge.process is not None
            pid = bridge.process.pid
            eventually(
                lambda: own_row(engine, instance),
                "the bridge's row, ready",
                until=lambda row: row is not None and row.pid == pid and row.state == "ready",
            )
            assert client.exists(lease_key(instance))
            wait_routed(ops, "gated-stop")
            submitted = caller.post("/tasks", json={"capability": "test.gated-stop", "payload": {}})
            assert submitted.status_code == 202, submitted.text
            assert agent.called.wait(30), "the call did not reach the agent"
            # When it is stopped cleanly, the call still in flight
            bridge.process.send_signal(signal.SIGTERM)
            eventually(lambda: "Warm shutdown" in bridge.output(), "the bridge to begin its stop")
            while_in_flight = states_over(engine, instance, WATCH_S)
            agent.gate.set()
            bridge.process.wait(60)
        finally:
            agent.gate.set()
            bridge.stop()
            ops.delete("/agents/gated-stop")
    assert bridge.process.returncode == 0, bridge.output()
    # Then the call ended with its answer, not taken for lost, the row ready until then
    assert while_in_flight == {"ready"}, "the row went offline with a call in flight"
    done = wait_for_task(caller, submitted.json()["task_id"], {"succeeded", "failed"})
    assert (done["status"], done["result"]) == ("succeeded", {"answered": True}), done
    # And its row says it stopped, and routing and the reaper find no lease of it
    row = own_row(engine, instance)
    assert (row.pid, row.state) == (pid, "offline")
    assert row.stopped_at is not None
    assert not client.exists(lease_key(instance))


def test_a_bridge_stopped_while_postgres_is_away_still_stops(
    settings: Settings, log_dir: Any
) -> None:
    """Its row cannot be written then: it says so in its log and ends as usual (before, the
    error left its stop from the consumer's shutdown on)."""
    with CuttableProxy(settings.database_url) as proxy:
        through_proxy = settings.model_copy(update={"database_url": proxy.url})
        bridge = start_bridge(through_proxy, log_dir / "bridge-stop-no-postgres.log")
        try:
            assert bridge.process is not None
            # Given a bridge whose Postgres is gone
            proxy.cut()
            # When it is stopped cleanly
            bridge.process.send_signal(signal.SIGTERM)
            bridge.process.wait(60)
        finally:
            bridge.stop()
            proxy.restore()
    # Then it ends as a clean stop does, having said why its row was not written
    assert bridge.process.returncode == 0, bridge.output()
    assert "marking bridge@" in bridge.output()
