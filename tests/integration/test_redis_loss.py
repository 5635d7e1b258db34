"""Redis lost under running tasks: its data (FLUSHDB), or the worker's connections to it.

Neither is a dead worker. A worker whose lease a FLUSHDB removed lives on: the reaper used to
take it for dead before its next renewal (a non-idempotent task ended ``worker_lost`` though
its handler finished, an idempotent one ran again beside itself). A prefork worker whose
broker connection broke terminated every task it was running (Celery's
``worker_cancel_long_running_tasks_on_connection_loss``), so a sub-second blip ended each
one ``worker_lost``. The bridge, whose calls are claimed under its own name, is no dead
worker either. Each test runs its own stack (API, agent worker or bridge, maintenance worker
and beat, so the reaper runs) on a Redis db of its own.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import Engine

from api.app import create_app
from broker.registry.model import lease_key
from broker.settings import Settings
from broker.tasks.dispatch import MAINTENANCE_QUEUE
from broker.tenancy import key_store
from tests.eventually import eventually
from tests.integration.remote import JsonAgent, start_bridge, wait_routed
from tests.integration.stack import (
    CeleryProcess,
    ServedApp,
    start_beat,
    start_worker,
    wait_for_task,
)
from tests.integration.test_lost_replies import WithholdingProxy, pipe

FINAL = {"succeeded", "failed", "cancelled", "expired"}
SLOW = "test.slow-once,test.slow-idem"


class ResettingProxy(WithholdingProxy):
    """TCP to Redis on loopback, in a thread of its own; ``reset`` breaks every connection
    open through it (as a Redis restart, a failover or a load balancer's reset does), and
    new ones are let through as before."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(redis_url)
        self.open: set[asyncio.StreamWriter] = set()

    def reset(self) -> int:
        """Break every open connection (RST); how many there were."""
        return asyncio.run_coroutine_threadsafe(self._cut(), self.loop).result(timeout=10)

    async def _cut(self) -> int:
        writers, self.open = list(self.open), set()
        for writer in writers:
            writer.transport.abort()
        return len(writers)

    async def _close(self) -> None:
        await self._cut()
        await super()._close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        redis_r, redis_w = await asyncio.open_connection(*self.upstream)
        ends = {client_w, redis_w}
        self.open |= ends
        try:
            await asyncio.gather(pipe(client_r, redis_w), pipe(redis_r, client_w))
        finally:
            self.open -= ends


class Stack:
    """An API, an agent worker for the slow test agents, a maintenance worker and beat (the
    reaper, every second), on ``settings``; the agent worker on ``worker_settings``."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.processes: list[CeleryProcess] = []
        self.name = f"loss-{uuid.uuid4().hex[:6]}"

    def start(self, worker_settings: Settings, pool: str) -> CeleryProcess:
        self.start_reaper()
        agents = start_worker(
            worker_settings, SLOW, self.name, self.log_dir, concurrency=3, pool=pool
        )
        self.processes.append(agents)
        return agents

    def start_reaper(self) -> None:
        """The maintenance worker and beat."""
        self.processes.append(
            start_worker(
                self.settings, MAINTENANCE_QUEUE, f"{self.name}-m", self.log_dir, concurrency=1
            )
        )
        self.processes.append(start_beat(self.settings, self.log_dir, name=f"{self.name}-beat"))

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


@pytest.fixture
def stack(settings: Settings, own_redis: str, log_dir: Path) -> Iterator[Stack]:
    own = settings.model_copy(update={"redis_url": own_redis, "reaper_interval_s": 1})
    started = Stack(own, log_dir)
    yield started
    started.stop()


@pytest.fixture
def api(stack: Stack) -> Iterator[ServedApp]:
    with ServedApp(create_app(stack.settings)) as served:
        yield served


@pytest.fixture
def http(api: ServedApp, engine: Engine) -> Iterator[httpx.Client]:
    _, token = key_store.create_key(engine, f"loss-{uuid.uuid4().hex[:6]}", ["*"])
    with httpx.Client(
        base_url=api.url, timeout=30, headers={"Authorization": f"Bearer {token}"}
    ) as client:
        yield client


@pytest.fixture
def ops(api: ServedApp, engine: Engine) -> Iterator[httpx.Client]:
    """An operator's client (registering agents is theirs), on the stack's API."""
    name = f"loss-ops-{uuid.uuid4().hex[:6]}"
    _, token = key_store.create_key(engine, name, ["*"], is_admin=True)
    with httpx.Client(
        base_url=api.url, timeout=30, headers={"Authorization": f"Bearer {token}"}
    ) as client:
        yield client


def submit(http: httpx.Client, capability: str, sleep_s: float) -> str:
    answer = http.post("/tasks", json={"capability": capability, "payload": {"sleep_s": sleep_s}})
    assert answer.status_code == 202, answer.text
    task_id: str = answer.json()["task_id"]
    return task_id


def statuses(http: httpx.Client, ids: list[str]) -> list[dict[str, object]]:
    return [http.get(f"/tasks/{task_id}").json() for task_id in ids]


def test_a_flushdb_while_tasks_run_takes_no_worker_for_dead_and_each_task_runs_once(
    stack: Stack, http: httpx.Client, own_redis: str
) -> None:
    # Given a worker with a 60 s lease (renewed every 20 s), the reaper running every second,
    # and two non-idempotent tasks and an idempotent one running on it
    worker_settings = stack.settings.model_copy(update={"lease_ttl_s": 60})
    stack.start(worker_settings, "prefork")
    ids = [
        submit(http, "test.slow-once", 8),
        submit(http, "test.slow-once", 8),
        submit(http, "test.slow-idem", 8),
    ]
    running = eventually(
        lambda: statuses(http, ids),
        "the three tasks running",
        until=lambda tasks: all(t["status"] == "running" for t in tasks),
    )
    instance = running[0]["agent"]["instance"]  # type: ignore[index]
    client = redis.Redis.from_url(own_redis)
    # A lease renewed in the last 2 s: its next renewal is 18 s away, long after the reaper's
    # next run and after the tasks end
    eventually(lambda: client.pttl(lease_key(instance)) > 58_000, "a renewal", 30)

    # When Redis loses every key
    client.flushdb()

    # Then the worker writes its lease again while its tasks still run
    eventually(
        lambda: (
            client.exists(lease_key(instance))
            or any(t["status"] in FINAL for t in statuses(http, ids))
        ),
        "the lease back or a task ended",
    )
    assert [t["status"] for t in statuses(http, ids)] == ["running"] * 3
    # And each task succeeds, run once: none taken for lost
    done = [wait_for_task(http, task_id, FINAL, timeout_s=60) for task_id in ids]
    assert [(t["status"], t["error"], t["attempts"]) for t in done] == [("succeeded", None, 1)] * 3


@pytest.fixture
def proxy(own_redis: str) -> Iterator[ResettingProxy]:
    """Set up before the stack, so that the workers stop before it does."""
    with ResettingProxy(own_redis) as started:
        yield started


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_redis_connection_reset_mid_run_leaves_the_task_running_and_it_succeeds_once(
    pool: str, proxy: ResettingProxy, stack: Stack, http: httpx.Client, own_redis: str
) -> None:
    # Given a worker whose every Redis connection (broker, lease, events) goes through a proxy,
    # and a non-idempotent task running on it
    worker = stack.start(stack.settings.model_copy(update={"redis_url": proxy.url}), pool)
    task_id = submit(http, "test.slow-once", 6)
    client = redis.Redis.from_url(own_redis)
    runs = f"reach:test:runs:{task_id}"
    eventually(lambda: client.get(runs) == b"1", "the handler to start")

    # When every connection to Redis is reset under it
    assert proxy.reset() > 0
    eventually(lambda: "Connection to broker lost" in worker.output(), "the consumer to see it")

    # Then the task's message (on prefork, put back when its channel closed, and taken again)
    # finds it running and does nothing, and the run that was cut off ends it, once
    done = wait_for_task(http, task_id, FINAL, timeout_s=60)
    assert (done["status"], done["error"], done["attempts"]) == ("succeeded", None, 1)
    assert done["result"] == {"runs": 1}
    assert client.get(runs) == b"1"
    # And no message of it is left unacked (one would come again after the visibility
    # timeout), and the worker goes on taking tasks
    eventually(lambda: client.hlen("unacked") == 0, "every message acked")
    after = wait_for_task(http, submit(http, "test.slow-once", 0), FINAL)
    assert (after["status"], after["attempts"]) == ("succeeded", 1)
    assert "cannot be acknowledged after a connection loss" not in worker.output()


class SlowAgent(JsonAgent):
    """An ``http`` agent whose every call takes ``sleep_s``; ``calls`` counts them."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s
        self.calls = 0
        super().__init__()

    def on_call(self, body: bytes) -> object:
        self.calls += 1
        time.sleep(self.sleep_s)
        return {"result": {"ok": True}}


@dataclass
class Bridged:
    bridge: CeleryProcess
    agent: SlowAgent
    capability: str


@pytest.fixture
def bridged(stack: Stack, ops: httpx.Client, log_dir: Path) -> Iterator[Bridged]:
    """A bridge whose own lease (6 s) it renews every 2 s, the reaper running every second,
    and a non-idempotent remote agent whose calls take 8 s, routed."""
    stack.start_reaper()
    clocks = {"REACH_REMOTE_HEALTH_INTERVAL_S": "2", "REACH_REMOTE_FIRST_BYTE_TIMEOUT_S": "30"}
    bridge = start_bridge(stack.settings, log_dir / f"{stack.name}-bridge.log", **clocks)
    stack.processes.append(bridge)
    agent_id = f"loss-bridge-{uuid.uuid4().hex[:6]}"
    capability = f"test.{agent_id}"
    with SlowAgent(sleep_s=8) as agent:
        registration = {
            "version": "1.0.0",
            "endpoint": {"protocol": "http", "url": agent.url},
            "capabilities": [{"capability": capability, "idempotent": False}],
        }
        assert ops.put(f"/agents/{agent_id}", json=registration).status_code == 201
        try:
            wait_routed(ops, agent_id, timeout_s=60)
            yield Bridged(bridge, agent, capability)
        finally:
            ops.delete(f"/agents/{agent_id}")


def call_in_flight(http: httpx.Client, bridged: Bridged) -> tuple[str, str]:
    """Submit a call and wait for it to reach the agent; its task's id and instance."""
    answer = http.post("/tasks", json={"capability": bridged.capability, "payload": {}})
    assert answer.status_code == 202, answer.text
    task_id: str = answer.json()["task_id"]
    eventually(lambda: bridged.agent.calls == 1, "the call to reach the agent")
    instance: str = http.get(f"/tasks/{task_id}").json()["agent"]["instance"]
    return task_id, instance


def test_a_flushdb_while_a_bridge_call_runs_takes_no_bridge_for_dead_and_the_call_runs_once(
    bridged: Bridged, http: httpx.Client, own_redis: str
) -> None:
    # Given a call running on the bridge
    task_id, instance = call_in_flight(http, bridged)
    client = redis.Redis.from_url(own_redis)
    # And a renewal in the last half second: the next is 1.5 s or more away, after the
    # reaper's next run (the task is more than a second old by then)
    eventually(lambda: client.pttl(lease_key(instance)) > 5_500, "a renewal", 30, 0.05)

    # When Redis loses every key
    client.flushdb()

    # Then the bridge writes its lease again while the call still runs
    eventually(
        lambda: (
            client.exists(lease_key(instance))
            or http.get(f"/tasks/{task_id}").json()["status"] in FINAL
        ),
        "the lease back or the task ended",
    )
    task = http.get(f"/tasks/{task_id}").json()
    assert (task["status"], task["error"]) == ("running", None)
    # And the call succeeds at its first attempt, the agent called once
    done = wait_for_task(http, task_id, FINAL, timeout_s=60)
    assert (done["status"], done["error"], done["attempts"]) == ("succeeded", None, 1)
    assert bridged.agent.calls == 1


def test_a_bridge_killed_mid_call_still_has_its_call_taken_for_lost(
    bridged: Bridged, http: httpx.Client
) -> None:
    # Given a call running on the bridge
    task_id, _ = call_in_flight(http, bridged)

    # When the bridge is killed with -9 (its lease and its row in Postgres age from then)
    bridged.bridge.kill_hard()

    # Then the reaper takes the call for lost, a TTL later: not idempotent, it fails
    done = wait_for_task(http, task_id, FINAL, timeout_s=60)
    error = done["error"]
    assert done["status"] == "failed" and isinstance(error, dict), done
    assert error["code"] == "worker_lost"
    assert bridged.agent.calls == 1
