"""The cancel listener of async handlers (``workers.aio.Calls``) against real Redis: a cancel
reaches a coroutine whether it is published before or while the call runs, with no Redis
query per call while the subscription is up, and cancels missed while it was down are found
when it comes back."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from broker.tasks.cancellation import CANCELS_CHANNEL, flag_key
from workers.aio import CallCancelled, Calls


@pytest.fixture
def calls(redis_url: str) -> Iterator[Calls]:
    calls = Calls(redis_url)
    calls._started()
    wait_for(lambda: calls._listening_since is not None, "the listener to subscribe")
    yield calls


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def wait_for(condition: Any, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


async def sleeper() -> str:
    await asyncio.sleep(30)
    return "slept"


def never_asked() -> bool:
    raise AssertionError("the cancel flag was read although the subscription was up")


def run_in_thread(calls: Calls, task_id: uuid.UUID, timeout_s: float) -> tuple[Any, dict[str, Any]]:
    """A call claimed now, run in a thread of its own as a task's would; ``outcome`` gets
    the ``CallCancelled`` it ends with."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            calls.run(
                task_id,
                sleeper(),
                timeout_s=timeout_s,
                claimed_at=time.monotonic(),
                cancelled=never_asked,
            )
        except CallCancelled as exc:
            outcome["raised"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: calls.in_flight == 1, "the call to start")
    return thread, outcome


def test_a_cancel_heard_before_the_call_starts_cancels_it_without_a_query(
    calls: Calls, client: redis.Redis
) -> None:
    task_id = uuid.uuid4()
    claimed_at = time.monotonic()
    client.publish(CANCELS_CHANNEL, str(task_id))
    wait_for(lambda: task_id in calls._recent, "the cancel to be heard")
    with pytest.raises(CallCancelled):
        calls.run(task_id, sleeper(), timeout_s=5, claimed_at=claimed_at, cancelled=never_asked)
    assert calls.in_flight == 0


def test_a_cancel_published_while_the_call_runs_cancels_it(
    calls: Calls, client: redis.Redis
) -> None:
    task_id = uuid.uuid4()
    thread, outcome = run_in_thread(calls, task_id, timeout_s=20)
    client.publish(CANCELS_CHANNEL, str(task_id))
    thread.join(10)
    assert isinstance(outcome.get("raised"), CallCancelled)


def test_a_call_claimed_before_the_subscription_reads_its_flag(calls: Calls) -> None:
    task_id = uuid.uuid4()
    asked = []

    def flagged() -> bool:
        asked.append(task_id)
        return True

    claimed_before = calls._listening_since - 1  # type: ignore[operator]
    with pytest.raises(CallCancelled):
        calls.run(task_id, sleeper(), timeout_s=5, claimed_at=claimed_before, cancelled=flagged)
    assert asked == [task_id]


def test_a_new_subscription_finds_the_cancels_it_could_not_hear(
    calls: Calls, client: redis.Redis
) -> None:
    """The listener's connection is killed; a cancel published meanwhile is lost, but its
    flag is set (as the API sets it), and the next subscription reads the flags of the calls
    in flight."""
    task_id = uuid.uuid4()
    thread, outcome = run_in_thread(calls, task_id, timeout_s=30)
    first = calls._listening_since
    client.set(flag_key(task_id), "1", ex=60)
    try:
        name = f"reach-cancels-{calls._pid}"
        ids = [c["id"] for c in client.client_list() if c.get("name") == name]
        assert ids, "the listener's connection carries its name"
        for connection_id in ids:
            client.client_kill_filter(_id=connection_id)
        thread.join(15)
        assert isinstance(outcome.get("raised"), CallCancelled)
        assert calls._listening_since is not None and calls._listening_since > first  # type: ignore[operator]
    finally:
        client.delete(flag_key(task_id))
