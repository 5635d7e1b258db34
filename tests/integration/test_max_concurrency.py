"""A card's ``max_concurrency``: the most runs of the card one worker process (threads pool)
or one bridge process holds at once (``workers.loop_consumer``). Its other messages wait in
its queue, in their order, while the process's other cards run."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import redis
from sqlalchemy import Engine, select

from broker.db.models import tasks_table
from broker.settings import Settings
from tests.agents import GATE_KEY
from tests.eventually import eventually
from tests.integration.remote import AgentHandler, LoopbackAgent, wait_routed
from tests.integration.stack import CeleryProcess, start_worker
from tests.integration.test_async_agents import all_final, runs, submit

BOUNDED, PEER = "test.async-bounded", "test.async-unbounded"  # this test's worker's alone


def statuses(engine: Engine, ids: list[str]) -> list[str]:
    query = select(tasks_table.c.id, tasks_table.c.status).where(
        tasks_table.c.id.in_([uuid.UUID(t) for t in ids])
    )
    with engine.connect() as conn:
        found = {str(i): status for i, status in conn.execute(query)}
    return [found[t] for t in ids]


def two_running(engine: Engine, ids: list[str]) -> None:
    """Until two of the card's tasks ``ids`` run (its ``max_concurrency``)."""
    eventually(
        lambda: statuses(engine, ids),
        "two of the card's tasks running",
        60,
        0.05,
        until=lambda found: found.count("running") == 2,
    )


def test_a_cards_max_concurrency_bounds_its_runs_and_the_rest_wait_in_order(
    client: httpx.Client, settings: Settings, engine: Engine, log_dir: Path, redis_url: str
) -> None:
    gates = redis.Redis.from_url(redis_url)
    broker = redis.Redis.from_url(settings.celery_broker_url)
    worker: CeleryProcess | None = None
    gate = uuid.uuid4().hex
    try:
        # Given a worker of 10 slots serving a card of max_concurrency 2, and one of none
        worker = start_worker(
            settings, f"{BOUNDED},{PEER}", "bounded", log_dir, concurrency=10, pool="threads"
        )
        # When 6 of the card's tasks come, each waiting for the gate
        bounded = [submit(client, BOUNDED, {"gate": gate, "sleep_s": 0}) for _ in range(6)]
        # Then 2 run and 4 wait in its queue, in the order they came (none set aside)
        two_running(engine, bounded)
        assert statuses(engine, bounded) == ["running"] * 2 + ["queued"] * 4
        waiting = [m for m in broker.lrange(BOUNDED, 0, -1)]
        assert len(waiting) == 4 and broker.llen(f"{BOUNDED}\x06\x169") == 0
        # And the worker's other card runs meanwhile, as many as it is sent
        peers = [submit(client, PEER, {"gate": gate, "sleep_s": 0}) for _ in range(5)]
        eventually(
            lambda: statuses(engine, peers),
            "the other card's five running",
            60,
            0.05,
            until=lambda found: found == ["running"] * 5,
        )
        assert statuses(engine, bounded).count("running") == 2
        # When the gate opens, every task runs, once, the card's in the order they came
        gates.set(GATE_KEY.format(gate), 1, ex=300)
        done = all_final(client, bounded + peers, "all eleven done", 60)
    finally:
        if worker is not None:
            worker.stop()
        gates.close()
        broker.close()
    assert {(t["status"], t["attempts"]) for t in done.values()} == {("succeeded", 1)}
    assert {runs(redis_url, t) for t in bounded + peers} == {1}
    with engine.connect() as conn:
        started = conn.execute(
            select(tasks_table.c.id)
            .where(tasks_table.c.id.in_([uuid.UUID(t) for t in bounded[2:]]))
            .order_by(tasks_table.c.started_at)
        ).scalars()
        assert [str(t) for t in started] == bounded[2:]


class CountingAgent(LoopbackAgent):
    """An ``http`` agent that holds each call ``hold_s`` and counts the calls in flight."""

    hold_s = 0.3

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = self.most = self.calls = 0
        super().__init__()

    def _handler(self) -> type[AgentHandler]:
        agent = self

        class Handler(AgentHandler):
            def do_POST(self) -> None:
                self.read_call()
                with agent.lock:
                    agent.in_flight += 1
                    agent.calls += 1
                    agent.most = max(agent.most, agent.in_flight)
                time.sleep(agent.hold_s)
                with agent.lock:
                    agent.in_flight -= 1
                self.answer({"result": {"ok": True}})

        return Handler


@contextmanager
def bounded_to_one(ops: httpx.Client, agent: LoopbackAgent) -> Iterator[str]:
    """``agent`` registered with ``max_concurrency`` 1 for a capability of its own, routed:
    the capability; deregistered after."""
    capability = f"test.bounded-{uuid.uuid4().hex[:6]}"
    body = {
        "version": "1.0.0",
        "endpoint": {"protocol": "http", "url": agent.url},
        "max_concurrency": 1,
        "capabilities": [{"capability": capability, "idempotent": True}],
    }
    agent_id = f"bounded-{uuid.uuid4().hex[:6]}"
    answer = ops.put(f"/agents/{agent_id}", json=body)
    assert answer.status_code == 201, answer.text
    try:
        cards = ops.get(f"/agents/{agent_id}").json()["cards"]
        assert [c["max_concurrency"] for c in cards] == [1]
        wait_routed(ops, agent_id)
        yield capability
    finally:
        ops.delete(f"/agents/{agent_id}")


def all_sent(caller: httpx.Client, capability: str, count: int) -> list[str]:
    """``count`` tasks of ``capability`` submitted at once: their ids."""
    ids = []
    for _ in range(count):
        sent = caller.post("/tasks", json={"capability": capability, "payload": {}})
        assert sent.status_code == 202, sent.text
        ids.append(sent.json()["task_id"])
    return ids


def assert_an_agent_of_one_has_four_calls_one_at_a_time(
    ops: httpx.Client, caller: httpx.Client
) -> None:
    """An agent registered with ``max_concurrency`` 1 has the four calls that come at once to a
    bridge of 50 slots one at a time, and every one answers."""
    with CountingAgent() as agent, bounded_to_one(ops, agent) as capability:
        done = all_final(caller, all_sent(caller, capability, 4), "the four calls done", 60)
    assert {t["status"] for t in done.values()} == {"succeeded"}
    assert (agent.calls, agent.most) == (4, 1)


def test_a_remote_agents_max_concurrency_bounds_the_bridges_calls_to_it(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    assert_an_agent_of_one_has_four_calls_one_at_a_time(ops, caller)


class SlowCountingAgent(CountingAgent):
    hold_s = 3.0


def test_a_remote_agents_max_concurrency_holds_while_it_moves_to_a_new_version(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    """Runs were counted by capability, agent and version: an agent registered again at
    2.0.0 with a call in flight had a second call at once, past its bound of 1."""
    capability, agent_id = f"test.moved-{uuid.uuid4().hex[:6]}", f"moved-{uuid.uuid4().hex[:6]}"
    with SlowCountingAgent() as agent:
        body = {
            "version": "1.0.0",
            "endpoint": {"protocol": "http", "url": agent.url},
            "max_concurrency": 1,
            "capabilities": [{"capability": capability, "idempotent": True}],
        }
        assert ops.put(f"/agents/{agent_id}", json=body).status_code == 201
        try:
            wait_routed(ops, agent_id)
            first = all_sent(caller, capability, 1)
            eventually(lambda: agent.in_flight, "the first call at the agent", 20, 0.05)
            moved = ops.put(f"/agents/{agent_id}", json={**body, "version": "2.0.0"})
            assert moved.status_code == 200, moved.text
            eventually(
                lambda: f"serving remote agent {agent_id} 2.0.0" in bridge.output(),
                "the bridge to serve 2.0.0",
                20,
            )
            second = all_sent(caller, capability, 1)
            done = all_final(caller, first + second, "both calls done", 60)
        finally:
            ops.delete(f"/agents/{agent_id}")
    assert {t["status"] for t in done.values()} == {"succeeded"}
    assert (agent.calls, agent.most) == (2, 1)


class BusyFirstAgent(CountingAgent):
    """Answers each task's first call 503 with ``Retry-After: 1`` (an agent overloaded), then
    holds its next ``hold_s`` and counts the calls in flight."""

    hold_s = 1.0

    def __init__(self) -> None:
        self.refused: set[str] = set()
        super().__init__()

    def _handler(self) -> type[AgentHandler]:
        agent, counting = self, super()._handler()

        class Handler(counting):  # type: ignore[valid-type, misc]
            def do_POST(self) -> None:
                task = self.headers.get("Idempotency-Key", "")
                with agent.lock:
                    first = task not in agent.refused
                    agent.refused.add(task)
                if not first:
                    super().do_POST()
                    return
                self.read_call()
                self.send_response(503)
                self.send_header("Retry-After", "1")
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler


def test_a_remote_agents_retries_keep_within_its_max_concurrency(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess
) -> None:
    """A retry's back-off was Celery's timer's, which ran it when due whatever the bridge
    held: the agent that answered 503 got its retries all at once, past its bound, exactly
    when it was overloaded."""
    with BusyFirstAgent() as agent, bounded_to_one(ops, agent) as capability:
        # When 3 calls come at once, each answered 503 first: three retries due together
        done = all_final(caller, all_sent(caller, capability, 3), "the three calls done", 60)
    # Then each was retried once, and the agent had one call at a time all along
    assert {(t["status"], t["attempts"]) for t in done.values()} == {("succeeded", 2)}
    assert (len(agent.refused), agent.calls, agent.most) == (3, 3, 1)
