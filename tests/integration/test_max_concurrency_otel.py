"""A card's ``max_concurrency`` where Celery's consumer takes the messages, not the loop
consumer: OpenTelemetry on (here) or a broker that is not Redis (``test_rabbitmq.py``). The
consumer takes as many messages as its prefetch allows, and the runs past the card's bound
wait in the process (``workers.card_runs``); before, they all ran at once."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import Engine

from broker.settings import Settings
from tests.agents import GATE_KEY
from tests.eventually import eventually
from tests.integration import remote
from tests.integration.stack import CeleryProcess, start_worker
from tests.integration.test_async_agents import all_final, runs, submit
from tests.integration.test_max_concurrency import (
    assert_an_agent_of_one_has_four_calls_one_at_a_time,
    statuses,
    two_running,
)

BOUNDED = "test.async-bounded"  # max_concurrency 2
OTEL = {"REACH_OTEL": "true"}  # no OTEL_EXPORTER_OTLP_ENDPOINT: spans made, sent nowhere


def held_to_two(
    client: httpx.Client, engine: Engine, gates: redis.Redis, all_taken: Callable[[], bool]
) -> list[str]:
    """Six tasks of the card of 2, each waiting for a gate: two run while the other four,
    taken by the worker (``all_taken()`` true), wait in it; then the gate opens. The ids."""
    gate = uuid.uuid4().hex
    ids = [submit(client, BOUNDED, {"gate": gate, "sleep_s": 0}) for _ in range(6)]
    two_running(engine, ids)
    eventually(all_taken, "every message in the worker", 60, 0.05)
    time.sleep(2)  # a run not held back would have started by now
    assert sorted(statuses(engine, ids)) == ["queued"] * 4 + ["running"] * 2
    gates.set(GATE_KEY.format(gate), 1, ex=300)
    return ids


def test_a_cards_max_concurrency_holds_on_a_worker_with_opentelemetry(
    client: httpx.Client, settings: Settings, engine: Engine, log_dir: Path, redis_url: str
) -> None:
    gates = redis.Redis.from_url(redis_url)
    broker = redis.Redis.from_url(settings.celery_broker_url)
    worker: CeleryProcess | None = None
    try:
        worker = start_worker(
            settings, BOUNDED, "bounded-otel", log_dir, OTEL, concurrency=10, pool="threads"
        )
        ids = held_to_two(client, engine, gates, lambda: broker.llen(BOUNDED) == 0)
        done = all_final(client, ids, "all six done", 60)
    finally:
        if worker is not None:
            worker.stop()
        gates.close()
        broker.close()
    assert {(t["status"], t["attempts"]) for t in done.values()} == {("succeeded", 1)}
    assert {runs(redis_url, t) for t in ids} == {1}


def test_a_warm_shutdown_puts_the_runs_waiting_for_their_cards_room_back(
    client: httpx.Client, settings: Settings, engine: Engine, log_dir: Path, redis_url: str
) -> None:
    """A worker told to stop started the runs waiting in its card's line one after another on
    its way out (the stop lasted as long as the line took), where Celery leaves the messages
    it has not started for another worker."""
    gates = redis.Redis.from_url(redis_url)
    broker = redis.Redis.from_url(settings.celery_broker_url)
    gate = uuid.uuid4().hex
    queues, name = BOUNDED, "bounded-otel-stop"
    worker = start_worker(settings, queues, name, log_dir, OTEL, concurrency=10, pool="threads")
    try:
        # Given two of the card's tasks running and four waiting in the worker for room
        ids = [submit(client, BOUNDED, {"gate": gate, "sleep_s": 0}) for _ in range(6)]
        two_running(engine, ids)
        eventually(lambda: broker.llen(BOUNDED) == 0, "every message in the worker", 60, 0.05)
        # When it is told to stop, and the two running end
        assert worker.process is not None
        worker.process.send_signal(signal.SIGTERM)
        # Its drain is logged by the handler of the stop after the one that closes the card's
        # line (Celery says "Warm shutdown" before either runs: a run that ended in between,
        # on a loaded machine, let a waiting one start)
        eventually(lambda: ": draining" in worker.output(), "the warm shutdown", 30, 0.05)
        gates.set(GATE_KEY.format(gate), 1, ex=300)
        worker.process.wait(timeout=90)
        # Then the four never started: they wait in their queue again
        assert sorted(statuses(engine, ids)) == ["queued"] * 4 + ["succeeded"] * 2
        assert broker.llen(BOUNDED) == 4
        # And the next worker runs them, each once
        worker = start_worker(settings, queues, name, log_dir, OTEL, concurrency=10, pool="threads")
        done = all_final(client, ids, "all six done", 60)
    finally:
        worker.stop()
        gates.close()
        broker.close()
    assert {(t["status"], t["attempts"]) for t in done.values()} == {("succeeded", 1)}
    assert {runs(redis_url, t) for t in ids} == {1}


@pytest.fixture(scope="module")
def otel_bridge(
    settings: Settings, log_dir: Path, system_workers: list[CeleryProcess]
) -> Iterator[CeleryProcess]:
    process = remote.start_bridge(settings, log_dir / "bridge-otel.log", **OTEL)
    yield process
    process.stop()


def test_a_remote_agents_max_concurrency_holds_on_a_bridge_with_opentelemetry(
    ops: httpx.Client, caller: httpx.Client, otel_bridge: CeleryProcess
) -> None:
    """Celery's consumer takes the bridge's messages: the agent had the four at once."""
    assert_an_agent_of_one_has_four_calls_one_at_a_time(ops, caller)
