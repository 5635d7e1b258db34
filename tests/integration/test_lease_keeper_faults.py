"""The lease keeper against faults of the workers' own making, with real processes: a
readiness check that stops answering, one that answers slowly, and two workers started under
one name. The first and the last made the tasks a live worker was running look lost, so they
were taken back while they ran; the second kept its capability out of routing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from broker.settings import Settings
from tests.agents import HANG_READINESS_KEY, SLOW_READINESS_ANSWERS_KEY
from tests.eventually import eventually
from tests.integration.stack import CeleryProcess, start_worker, wait_for_task

FINAL = {"succeeded", "failed", "cancelled", "expired"}


def runs(redis_url: str, task_id: str) -> int:
    return int(redis.Redis.from_url(redis_url).get(f"reach:test:runs:{task_id}") or 0)


def live_instances(client: httpx.Client, capability: str) -> int:
    shown = client.get("/capabilities").json()["capabilities"]
    return next((c["live_instances"] for c in shown if c["capability"] == capability), 0)


def submit(client: httpx.Client, capability: str, sleep_s: float) -> str:
    answer = client.post("/tasks", json={"capability": capability, "payload": {"sleep_s": sleep_s}})
    assert answer.status_code == 202, answer.text
    task_id: str = answer.json()["task_id"]
    return task_id


@pytest.fixture
def started(settings: Settings) -> Iterator[list[CeleryProcess]]:
    """The workers a test starts, all stopped after it."""
    processes: list[CeleryProcess] = []
    yield processes
    for process in processes:
        process.stop()


@pytest.fixture
def hang(redis_url: str) -> Iterator[redis.Redis]:
    """A Redis client; the readiness of ``test.hung-ready`` answers again after the test."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.delete(HANG_READINESS_KEY)


def test_a_task_on_a_worker_whose_readiness_check_hangs_runs_once_and_succeeds(
    client: httpx.Client,
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    started: list[CeleryProcess],
    hang: redis.Redis,
    system_beat: CeleryProcess,  # the reaper
) -> None:
    capability = "test.hung-ready"
    started.append(start_worker(settings, capability, f"hung-{uuid.uuid4().hex[:6]}", log_dir))
    eventually(lambda: live_instances(client, capability) == 1, "the worker in routing")
    task_id = submit(client, capability, sleep_s=8)
    eventually(lambda: runs(redis_url, task_id) == 1, "the task to start")
    # Given the readiness check of the worker running it stops answering
    hang.set(HANG_READINESS_KEY, 1)
    # Then its capability leaves routing, as a check that says no takes it out
    eventually(lambda: live_instances(client, capability) == 0, "the capability out of routing")
    # And the worker keeps its lease: the task it runs is not taken back, and ends once
    done = wait_for_task(client, task_id, FINAL)
    assert (done["status"], done["error"]) == ("succeeded", None)
    assert (done["attempts"], runs(redis_url, task_id)) == (1, 1)
    # When the check answers again, the capability is routed and served again
    hang.delete(HANG_READINESS_KEY)
    eventually(lambda: live_instances(client, capability) == 1, "the capability back in routing")
    later = submit(client, capability, sleep_s=0.1)
    assert wait_for_task(client, later, FINAL)["status"] == "succeeded"


def test_a_capability_whose_readiness_check_answers_slower_than_a_renewal_is_routed(
    client: httpx.Client,
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    started: list[CeleryProcess],
) -> None:
    """Before, each round of upkeep waited a renewal interval (TTL/3) for the check it
    started, counted one still running as not ready and threw its answer away when it came:
    a check that said yes in two thirds of the TTL kept its capability out of routing for as
    long as the worker ran."""
    capability = "test.slow-ready"
    answers = redis.Redis.from_url(redis_url)
    answers.delete(SLOW_READINESS_ANSWERS_KEY)
    # Given a worker whose readiness check says ready, each time after two renewal intervals
    started.append(start_worker(settings, capability, f"slow-{uuid.uuid4().hex[:6]}", log_dir))
    # When its check has answered twice (each round of upkeep has judged it by then)
    eventually(lambda: int(answers.get(SLOW_READINESS_ANSWERS_KEY) or 0) >= 2, "two answers", 60)
    # Then its capability is routed, and a task sent to it is served
    eventually(lambda: live_instances(client, capability) == 1, "the capability in routing")
    task_id = submit(client, capability, sleep_s=0.1)
    assert wait_for_task(client, task_id, FINAL)["status"] == "succeeded"


def start_named(
    settings: Settings, queues: str, node: str, log_path: Path, started: list[CeleryProcess]
) -> CeleryProcess:
    """A worker named ``node`` exactly, logging to a file of its own."""
    args = ["worker", "-Q", queues, "-n", node, "-c", "2", "-l", "INFO"]
    args += ["--without-gossip", "--without-mingle"]
    process = CeleryProcess(args, settings, log_path).start(" ready.")
    started.append(process)
    return process


def test_a_second_worker_of_the_same_name_leaves_the_first_ones_tasks_and_routing_alone(
    client: httpx.Client,
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    started: list[CeleryProcess],
    system_beat: CeleryProcess,  # the reaper
) -> None:
    node = f"twin-{uuid.uuid4().hex[:6]}@%h"
    start_named(settings, "test.slow-once,test.slow-idem", node, log_dir / "twin-a.log", started)
    eventually(lambda: live_instances(client, "test.slow-once") == 1, "the first in routing")
    once = submit(client, "test.slow-once", sleep_s=10)
    idem = submit(client, "test.slow-idem", sleep_s=10)
    eventually(lambda: runs(redis_url, once) == runs(redis_url, idem) == 1, "both to start")
    # Given a second worker started under the same name, for another capability
    second = start_named(settings, "test.late", node, log_dir / "twin-b.log", started)
    # Then the first one's tasks are not taken back: each ends once, as it ran
    for task_id in (once, idem):
        done = wait_for_task(client, task_id, FINAL)
        assert (done["status"], done["error"], done["attempts"]) == ("succeeded", None, 1)
        assert runs(redis_url, task_id) == 1
    # And the second one tells the operator to name each worker
    assert "-n <name>@%h" in second.output()
    # And the first one's capabilities stay routed while both run
    assert live_instances(client, "test.slow-once") == 1
    after = submit(client, "test.slow-once", sleep_s=0.1)
    assert wait_for_task(client, after, FINAL)["status"] == "succeeded"
    # When the second one stops, the first one's lease still routes its capabilities
    second.stop()
    last = submit(client, "test.slow-once", sleep_s=0.1)
    assert wait_for_task(client, last, FINAL)["status"] == "succeeded"
