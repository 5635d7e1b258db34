"""The threads pool's loop consumer (``workers.loop_consumer``): a worker's run messages taken
from Redis on its event loop, on a connection of its own, which comes back when it is lost;
and a cold shutdown that puts the messages of the runs in flight back on their queues."""

from __future__ import annotations

import base64
import json
import signal
from pathlib import Path
from typing import Any

import httpx
import redis

from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.stack import CeleryProcess, start_worker, wait_for_task
from tests.integration.test_async_agents import FINAL, all_final, runs, submit

CAPABILITY = "test.loop-consumer"  # no other worker serves it


def loop_connections(settings: Settings, name: str) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(settings.celery_broker_url)
    try:
        found = client.client_list()
    finally:
        client.close()
    return [c for c in found if str(c.get("name", "")).startswith(f"reach-loop-consumer:{name}@")]


def brpop_by_the_loop(settings: Settings, name: str) -> list[dict[str, Any]]:
    return eventually(
        lambda: [c for c in loop_connections(settings, name) if c.get("cmd") == "brpop"],
        "the loop consumer's connection waiting in BRPOP",
        30,
        0.1,
        until=bool,
    )


def test_the_run_queues_are_taken_on_the_event_loop_on_a_connection_of_its_own(
    client: httpx.Client, settings: Settings, log_dir: Path, redis_url: str
) -> None:
    worker = start_worker(settings, CAPABILITY, "loop-own", log_dir, concurrency=10, pool="threads")
    try:
        assert len(brpop_by_the_loop(settings, "loop-own")) == 1
        ids = [submit(client, CAPABILITY, {"sleep_s": 0.05}) for _ in range(20)]
        done = [wait_for_task(client, t, FINAL) for t in ids]
    finally:
        worker.stop()
    assert {(d["status"], d["attempts"]) for d in done} == {("succeeded", 1)}
    assert {runs(redis_url, t) for t in ids} == {1}
    taken = [line for line in worker.output().splitlines() if "taken on the event loop" in line]
    assert CAPABILITY in taken[0]  # and Celery's channel does not BRPOP them
    assert "taken on the event loop: none" in taken[-1]  # the warm shutdown stopped taking


def test_a_lost_loop_consumer_connection_is_made_again_and_work_flows(
    client: httpx.Client, settings: Settings, log_dir: Path, redis_url: str
) -> None:
    worker = start_worker(
        settings, CAPABILITY, "loop-lost", log_dir, concurrency=10, pool="threads"
    )
    try:
        (lost,) = brpop_by_the_loop(settings, "loop-lost")
        killer = redis.Redis.from_url(settings.celery_broker_url)
        assert killer.client_kill_filter(_id=lost["id"]) == 1
        killer.close()
        again = brpop_by_the_loop(settings, "loop-lost")
        assert [c["id"] for c in again] != [lost["id"]]
        ids = [submit(client, CAPABILITY, {"sleep_s": 0.05}) for _ in range(10)]
        done = [wait_for_task(client, t, FINAL) for t in ids]
    finally:
        worker.stop()
    assert {d["status"] for d in done} == {"succeeded"}
    assert {runs(redis_url, t) for t in ids} == {1}
    assert "the loop consumer could not take messages" in worker.output()


def test_a_cold_shutdown_puts_the_messages_of_the_runs_in_flight_back_on_their_queues(
    client: httpx.Client,
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    system_beat: CeleryProcess,
) -> None:
    """SIGQUIT (Celery's cold shutdown) with five runs in flight: their messages go back to
    their queues marked redelivered, none stays unacked, and the tasks run again once (the
    agent is idempotent): the reaper finds them lost with the instance, or the next worker of
    the same name finds them no longer running there, whichever comes first."""
    name = "loop-cold"
    broker = redis.Redis.from_url(settings.celery_broker_url)
    worker: CeleryProcess | None = None
    after: CeleryProcess | None = None
    try:
        worker = start_worker(settings, CAPABILITY, name, log_dir, concurrency=5, pool="threads")
        ids = [submit(client, CAPABILITY, {"sleep_s": 60}) for _ in range(5)]
        all_running(client, ids)
        worker.stop(signal.SIGQUIT)
        assert worker.process is not None and worker.process.returncode is not None
        assert "5 messages in flight put back on their queues" in worker.output()
        waiting = [json.loads(m) for key in queue_keys(broker) for m in broker.lrange(key, 0, -1)]
        # the reaper may have sent the tasks again already (the instance went offline): those
        # messages are new ones, not marked redelivered
        back = [m for m in waiting if m["headers"].get("redelivered")]
        assert sorted(task_of(m) for m in back) == sorted(ids)
        tags = [m["properties"]["delivery_tag"] for m in back]
        assert not any(broker.hexists("unacked", tag) for tag in tags)
        after = start_worker(settings, CAPABILITY, name, log_dir, concurrency=5, pool="threads")
        done = all_final(client, ids, "the five run again by the next worker", 90)
    finally:
        for process in (worker, after):
            if process is not None:
                process.stop()
        broker.close()
    assert {(t["status"], t["attempts"]) for t in done.values()} == {("succeeded", 2)}
    assert {runs(redis_url, t) for t in ids} == {2}


def test_a_cold_shutdown_during_a_warm_one_stops_the_worker_and_puts_its_runs_back(
    client: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    """SIGQUIT while a warm shutdown waits for a run of 60 s: the warm one's wait for the
    runs in flight had no end but theirs, so the worker stopped only when the run ended
    (up to its time limit), its message put back on its queue meanwhile."""
    name = "loop-warm-cold"
    broker = redis.Redis.from_url(settings.celery_broker_url)
    worker = start_worker(settings, CAPABILITY, name, log_dir, concurrency=2, pool="threads")
    try:
        ids = [submit(client, CAPABILITY, {"sleep_s": 60})]
        all_running(client, ids)
        assert worker.process is not None
        worker.process.send_signal(signal.SIGTERM)
        eventually(
            lambda: "warm shutdown: waiting for 1 runs in flight" in worker.output(),
            "the warm shutdown to wait for the run",
            10,
        )
        worker.process.send_signal(signal.SIGQUIT)
        # Then it stops of itself, long before the run would have ended
        assert worker.process.wait(timeout=30) != -signal.SIGKILL
        waiting = [json.loads(m) for key in queue_keys(broker) for m in broker.lrange(key, 0, -1)]
        back = [m for m in waiting if m["headers"].get("redelivered")]
        assert [task_of(m) for m in back] == ids
        tags = [m["properties"]["delivery_tag"] for m in back]
        assert not any(broker.hexists("unacked", tag) for tag in tags)
    finally:
        worker.stop(signal.SIGKILL)
        for task_id in ids:  # not run by the next test's worker
            client.post(f"/tasks/{task_id}/cancel")
        for key in queue_keys(broker):
            broker.delete(key)
        broker.close()


def all_running(client: httpx.Client, ids: list[str]) -> None:
    eventually(
        lambda: [client.get(f"/tasks/{t}").json()["status"] for t in ids],
        "all running",
        60,
        0.1,
        until=lambda found: set(found) == {"running"},
    )


def queue_keys(broker: redis.Redis) -> list[bytes]:
    """The lists of the capability's queues (its own, its card's, an instance's)."""
    found = broker.scan_iter(match=f"{CAPABILITY}*")
    return [k for k in found if broker.type(k) == b"list"]


def task_of(message: dict[str, Any]) -> str:
    return str(json.loads(base64.b64decode(message["body"]))[0][0])
