"""Async handlers on a real worker (``-P threads -c 500``): many coroutines in flight on one
event loop per process, cut off at their time and cancelled by the caller without signals,
each keeping its own context; and sync handlers beside them, whose late results expire."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from celery import Celery
from sqlalchemy import Engine, create_engine, text

from broker.settings import Settings
from broker.tasks import events
from broker.tasks.dispatch import Dispatcher, redis_lists, send_run
from tests.agents import GATE_KEY
from tests.eventually import eventually
from tests.integration.stack import (
    CeleryProcess,
    ServedApp,
    start_worker,
    submit_many,
    wait_for_task,
)
from tests.integration.test_replies import read_stream
from workers import faults
from workers.runner import PROGRESS_BURST, PROGRESS_PER_S

ASYNC_QUEUES = ",".join(
    [
        *["test.async", "test.async-fuse", "test.async-stream", "test.async-callable"],
        *["test.async-wrapped", "test.sync-slow", "test.sync-fuse", "test.sync-stream"],
    ]
)
FINAL = {"succeeded", "failed", "cancelled", "expired"}


@pytest.fixture(scope="module")
def async_worker(
    settings: Settings, log_dir: Path, system_workers: list[CeleryProcess]
) -> Iterator[CeleryProcess]:
    """One worker process, the threads pool, 500 at once: as the README starts one."""
    process = start_worker(
        settings, ASYNC_QUEUES, "async", log_dir, concurrency=500, pool="threads"
    )
    yield process
    process.stop()


def submit(
    client: httpx.Client, capability: str, payload: dict[str, object], **more: object
) -> str:
    response = client.post("/tasks", json={"capability": capability, "payload": payload, **more})
    assert response.status_code == 202, response.text
    task_id: str = response.json()["task_id"]
    return task_id


def test_500_async_tasks_are_in_flight_at_once_in_one_process(
    api: ServedApp,
    make_key,
    async_worker: CeleryProcess,
    redis_url: str,  # type: ignore[no-untyped-def]
) -> None:
    # Two tenants: one tenant's runs hold at most 450 of the 500 slots (REACH_MAX_SLOTS_SHARE)
    (_, token), (_, other) = make_key(), make_key()
    barrier = secrets.token_hex(4)
    envelope = {
        "capability": "test.async",
        "payload": {"barrier": barrier, "n": 500, "wait_s": 120},
    }
    ids: list[tuple[str, str]] = []
    for key, n in ((token, 450), (other, 50)):
        responses = asyncio.run(submit_many(api, key, [envelope] * n))
        assert {r.status_code for r in responses} == {202}
        ids += [(key, r.json()["task_id"]) for r in responses]
    done = []
    for key, task_id in ids:
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}) as http:
            done.append(wait_for_task(http, task_id, FINAL, timeout_s=180))
    # Each returned only once all 500 had arrived at the barrier: they were in flight together.
    assert {d["status"] for d in done} == {"succeeded"}
    results = [d["result"] for d in done]
    assert {r["peers"] for r in results} == {500}  # type: ignore[index]
    assert len({r["pid"] for r in results}) == 1  # type: ignore[index]
    # And no thread each: the pool hands an async handler's task to the event loop.
    assert max(r["threads"] for r in results) < 50  # type: ignore[index]


def test_an_async_handler_past_its_timeout_is_cancelled_and_expires(
    client: httpx.Client, async_worker: CeleryProcess, redis_url: str
) -> None:
    mark = f"reach:test:mark:{uuid.uuid4()}"
    task_id = submit(client, "test.async-fuse", {"mark": mark})
    done = wait_for_task(client, task_id, FINAL)
    assert done["status"] == "expired"
    assert done["error"]["code"] == "timeout"  # type: ignore[index]
    marks = redis.Redis.from_url(redis_url)
    eventually(lambda: marks.get(mark), "the coroutine saw CancelledError")
    assert marks.get(mark) == b"cancelled"


def test_an_async_handler_past_the_tasks_deadline_is_cancelled_and_expires(
    client: httpx.Client, async_worker: CeleryProcess, redis_url: str
) -> None:
    mark = f"reach:test:mark:{uuid.uuid4()}"
    task_id = submit(client, "test.async", {"sleep_s": 30, "mark": mark}, deadline_ms=1500)
    done = wait_for_task(client, task_id, FINAL)
    assert done["status"] == "expired"
    assert done["error"]["code"] == "timeout"  # type: ignore[index]
    eventually(lambda: redis.Redis.from_url(redis_url).get(mark), "the coroutine cancelled")


def test_the_callers_cancel_reaches_the_running_coroutine(
    client: httpx.Client, async_worker: CeleryProcess, redis_url: str
) -> None:
    mark = f"reach:test:mark:{uuid.uuid4()}"
    task_id = submit(client, "test.async", {"sleep_s": 60, "mark": mark})
    wait_for_task(client, task_id, {"running"})
    cancelled = client.post(f"/tasks/{task_id}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    marks = redis.Redis.from_url(redis_url)
    eventually(lambda: marks.get(mark), "the coroutine saw CancelledError", timeout_s=10)
    assert marks.get(mark) == b"cancelled"
    assert client.get(f"/tasks/{task_id}").json()["status"] == "cancelled"


def test_an_async_generator_streams_its_items_in_order(
    client: httpx.Client, async_worker: CeleryProcess
) -> None:
    task_id = submit(client, "test.async-stream", {"n": 5})
    events = read_stream(client, "GET", f"/tasks/{task_id}/events")
    outputs = [e["data"]["data"] for e in events if e.get("event") == "output"]  # type: ignore[index]
    assert [o["i"] for o in outputs] == [0, 1, 2, 3, 4]
    # The running event goes out while the coroutine starts; its first output, yielded at
    # once, still comes after it.
    statuses = [e["data"]["data"]["status"] for e in events if e.get("event") == "status"]  # type: ignore[index]
    kinds = [e.get("event") for e in events]
    assert statuses == ["queued", "running"]
    assert kinds == ["status", "status", *["output"] * 5, "succeeded"]
    done = client.get(f"/tasks/{task_id}").json()
    assert done["status"] == "succeeded"
    assert [o["i"] for o in done["result"]["outputs"]] == [0, 1, 2, 3, 4]


def test_an_async_generator_item_larger_than_the_log_fails_events_too_large(
    client: httpx.Client, async_worker: CeleryProcess
) -> None:
    """An item of 5 MiB against the default 4 MiB a log holds, appended from the event loop:
    refused, and the task fails with its own code."""
    task_id = submit(client, "test.async-stream", {"n": 2, "size": 5 * 1024 * 1024})
    events = read_stream(client, "GET", f"/tasks/{task_id}/events")
    kinds = [e.get("event") for e in events]
    assert kinds == ["status", "status", "failed"]
    done = client.get(f"/tasks/{task_id}").json()
    assert done["status"] == "failed"
    assert done["error"]["code"] == "events_too_large"


def test_an_item_too_large_emitted_the_sync_way_before_the_running_event_fails_its_task(
    client: httpx.Client, async_worker: CeleryProcess
) -> None:
    """Held until the running event is out, then refused: the task failed with its own code.
    It ended ``worker_lost`` before, the refusal raised again where the run awaits its
    running event before its finish, and the run was left for the orphan check."""
    task_id = submit(client, "test.async-stream", {"n": 1, "early_size": 5 * 1024 * 1024})
    done = wait_for_task(client, task_id, FINAL)
    assert (done["status"], done["error"]["code"], done["attempts"]) == (  # type: ignore[index]
        "failed",
        "events_too_large",
        1,
    ), done


def test_an_object_whose_call_is_an_async_def_runs_on_the_loop(
    client: httpx.Client, async_worker: CeleryProcess
) -> None:
    """It was taken for a sync handler, and its coroutine, returned unawaited, failed the
    task ``result_invalid``."""
    done = wait_for_task(client, submit(client, "test.async-callable", {"text": "hi"}), FINAL)
    assert (done["status"], done["result"]) == ("succeeded", {"replied": "hi"}), done


def test_a_sync_handler_that_returns_a_coroutine_fails_saying_what_to_register(
    client: httpx.Client, async_worker: CeleryProcess
) -> None:
    done = wait_for_task(client, submit(client, "test.async-wrapped", {"text": "hi"}), FINAL)
    assert (done["status"], done["error"]["code"]) == ("failed", "agent_error"), done  # type: ignore[index]
    assert "register the async def itself" in done["error"]["message"], done  # type: ignore[index]


def test_a_sync_generator_on_the_threads_pool_is_closed_at_its_deadline(
    client: httpx.Client, async_worker: CeleryProcess, redis_url: str
) -> None:
    """Nothing interrupts a sync handler on the threads pool, but a generator hands the runner
    each chunk: past its deadline it is closed there, not left to stream for its minute."""
    mark = f"reach:test:mark:{uuid.uuid4()}"
    task_id = submit(client, "test.sync-stream", {"mark": mark}, deadline_ms=1500)
    done = wait_for_task(client, task_id, FINAL, timeout_s=90)
    assert (done["status"], done["error"]["code"]) == ("expired", "timeout"), done  # type: ignore[index]
    marks = redis.Redis.from_url(redis_url)
    yielded = eventually(lambda: marks.get(mark), "the generator closed", timeout_s=90)
    assert int(yielded) < 600


def test_the_callers_cancel_closes_a_sync_generator_at_its_next_item(
    client: httpx.Client, async_worker: CeleryProcess, redis_url: str
) -> None:
    mark = f"reach:test:mark:{uuid.uuid4()}"
    task_id = submit(client, "test.sync-stream", {"mark": mark})
    wait_for_task(client, task_id, {"running"})
    cancelled = client.post(f"/tasks/{task_id}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    marks = redis.Redis.from_url(redis_url)
    yielded = eventually(lambda: marks.get(mark), "the generator closed", timeout_s=90)
    assert int(yielded) < 600
    assert client.get(f"/tasks/{task_id}").json()["status"] == "cancelled"


@pytest.mark.timeout(600)
def test_1000_interleaved_async_tasks_each_keep_their_own_context(
    api: ServedApp,
    make_key,
    async_worker: CeleryProcess,
    log_dir: Path,  # type: ignore[no-untyped-def]
) -> None:
    """The seeds' bug 5.2: a trace id that leaks from one request to the next across an
    await. Every event and every log line of every task must carry that task's own ids."""
    _, token = make_key()
    envelopes = [
        {"capability": "test.async-stream", "payload": {"n": 4, "jitter_s": 0.05}}
        for _ in range(1000)
    ]
    responses = asyncio.run(submit_many(api, token, envelopes))
    assert {r.status_code for r in responses} == {202}
    accepted = {r.json()["task_id"]: r.json()["trace_id"] for r in responses}
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}) as http:
        done = {t: wait_for_task(http, t, FINAL, timeout_s=300) for t in accepted}
    assert {d["status"] for d in done.values()} == {"succeeded"}
    for task_id, task in done.items():
        bound = {o["bound_trace_id"] for o in task["result"]["outputs"]}  # type: ignore[index]
        assert bound == {accepted[task_id]}, task_id
    steps = [
        line
        for line in map(json.loads, _json_lines(async_worker.log_path))
        if line.get("event") == "step" and line.get("task_id") in accepted
    ]
    assert len(steps) == 4 * len(accepted)
    mixed = [s for s in steps if s["own_task"] != s["task_id"]]
    assert mixed == []
    assert all(s["trace_id"] == accepted[s["task_id"]] for s in steps)


def test_a_sync_handler_on_the_threads_pool_that_returns_past_the_deadline_expires(
    client: httpx.Client, async_worker: CeleryProcess
) -> None:
    """The threads pool cannot interrupt a sync handler: its late result is not taken."""
    task_id = submit(client, "test.sync-slow", {"sleep_s": 3}, deadline_ms=1000)
    done = wait_for_task(client, task_id, FINAL)
    assert done["status"] == "expired"
    assert done["error"]["code"] == "timeout"  # type: ignore[index]
    assert done["result"] is None


def test_a_failure_that_comes_past_the_deadline_expires_as_a_late_result_does(
    client: httpx.Client, async_worker: CeleryProcess
) -> None:
    late = submit(client, "test.sync-slow", {"sleep_s": 2, "fail": "gave_up"}, deadline_ms=1000)
    done = wait_for_task(client, late, FINAL)
    assert done["status"] == "expired"
    assert done["error"]["code"] == "timeout"  # type: ignore[index]
    assert "gave_up" in done["error"]["message"]  # type: ignore[index]
    # the same failure within the deadline is the agent's own
    early = submit(client, "test.sync-slow", {"sleep_s": 0.1, "fail": "gave_up"}, deadline_ms=9000)
    assert wait_for_task(client, early, FINAL)["error"]["code"] == "gave_up"  # type: ignore[index]


@pytest.mark.parametrize("retry", [False, True])
def test_a_failure_that_comes_past_the_cards_timeout_expires_and_is_not_tried_again(
    client: httpx.Client, async_worker: CeleryProcess, redis_url: str, retry: bool
) -> None:
    """Only a failure past the task's deadline was its time's: one past the card's
    ``timeout_s`` was the agent's error, and a retryable one ran the task again."""
    task_id = submit(client, "test.sync-fuse", {"sleep_s": 1, "retry": retry})
    done = wait_for_task(client, task_id, FINAL)
    assert done["status"] == "expired"
    assert done["error"]["code"] == "timeout"  # type: ignore[index]
    assert runs(redis_url, task_id) == 1


def test_an_async_handler_reporting_progress_the_sync_way_before_its_running_event_finishes(
    client: httpx.Client, async_worker: CeleryProcess
) -> None:
    """On the loop that sends the ``running`` event, a sync ``ctx.progress`` waited for it to
    be sent: the loop, and with it every task of the process, stopped for good."""
    task_id = submit(client, "test.async", {"sync_progress": True})
    events = read_stream(client, "GET", f"/tasks/{task_id}/events")
    kinds = [e["event"] for e in events]
    assert kinds == ["status", "status", "progress", "succeeded"]
    assert [e["data"]["data"]["status"] for e in events[:2]] == ["queued", "running"]  # type: ignore[index]
    assert client.get(f"/tasks/{task_id}").json()["progress"]["message"].startswith("started")


def test_sync_and_async_handlers_run_side_by_side_in_one_worker(
    client: httpx.Client, async_worker: CeleryProcess
) -> None:
    sync_id = submit(client, "test.sync-slow", {"sleep_s": 0.2})
    async_id = submit(client, "test.async", {"sleep_s": 0.2})
    assert wait_for_task(client, sync_id, FINAL)["status"] == "succeeded"
    assert wait_for_task(client, async_id, FINAL)["status"] == "succeeded"


def _json_lines(path: Path) -> Iterator[str]:
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            yield line


def test_a_retryable_failure_of_an_async_handler_runs_again(
    client: httpx.Client, async_worker: CeleryProcess
) -> None:
    task_id = submit(client, "test.async", {"fail_times": 2})
    done = wait_for_task(client, task_id, FINAL)
    assert done["status"] == "succeeded"
    assert done["attempts"] == 3


@pytest.mark.parametrize("capability", ["test.async", "test.sync-slow"])
def test_a_run_for_longer_than_two_renewals_is_held_not_taken_for_lost(
    client: httpx.Client, ops: httpx.Client, async_worker: CeleryProcess, capability: str
) -> None:
    """Its message skipped Celery's request (``workers.pool.run_strategy``), so no Celery
    state holds it: the lease keeper must still count it, or its orphan check (a run older
    than two renewals that no pool process holds) would end it ``worker_lost``."""
    task_id = submit(client, capability, {"sleep_s": 4})
    wait_for_task(client, task_id, {"running"})

    def counted() -> bool:
        instances = ops.get(f"/agents/{capability.replace('.', '-')}").json()["instances"]
        return any(i["state"] != "offline" and i["active_tasks"] >= 1 for i in instances)

    eventually(counted, "the worker's lease to count the run")
    done = wait_for_task(client, task_id, FINAL)
    assert (done["status"], done["attempts"]) == ("succeeded", 1), done.get("error")


def test_a_second_message_of_a_running_task_leaves_its_run_held(
    client: httpx.Client, async_worker: CeleryProcess, settings: Settings, tenant: tuple[str, str]
) -> None:
    """Two messages of one task may reach one process (a session's next turn published again
    beside its own message, a sweep's or a rehome's copy, a redelivery). The one that loses
    the claim ends at once; the run of the other must still count as held here, or the orphan
    check (two renewals, 2 s here) takes it for lost and ends it ``worker_lost`` while it runs."""
    task_id = submit(client, "test.async", {"sleep_s": 6})
    running = wait_for_task(client, task_id, {"running"})
    dispatcher = Dispatcher(settings)
    try:
        # When a copy of its message reaches the same worker while it runs
        send_run(
            dispatcher.app,
            uuid.UUID(task_id),
            "test.async",
            trace_id=running["trace_id"],
            tenant=tenant[0],
        )
        with redis.Redis.from_url(settings.redis_url) as store:
            eventually(
                lambda: not any(store.llen(key) for key in redis_lists("test.async")),
                "the worker to take the copy",
            )
    finally:
        dispatcher.close()
    # Then the run goes on to its end, once, and is not taken for lost
    done = wait_for_task(client, task_id, FINAL)
    assert (done["status"], done["attempts"]) == ("succeeded", 1), done.get("error")


def test_with_task_events_on_runs_take_celerys_way_and_show_in_inspect_active(
    client: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    """Without Celery's request a run is invisible to ``celery inspect active``; Flower turns
    task events on (``enable_events``), and from then on runs take Celery's way, where its
    requests make the events and show in ``inspect active``."""
    queue = "test.async-watched"  # this worker's alone: the session's async worker is elsewhere
    worker = start_worker(settings, queue, "events", log_dir, concurrency=10, pool="threads")
    name = f"events@{socket.gethostname()}"
    control = Celery("test-events", broker=settings.celery_broker_url, set_as_current=False)

    def active_ids() -> set[str]:
        answers = control.control.inspect(destination=[name], timeout=5).active() or {}
        return {request["id"] for request in answers.get(name, [])}

    try:
        quiet = submit(client, queue, {"sleep_s": 3})
        wait_for_task(client, quiet, {"running"})
        assert quiet not in active_ids()
        assert control.control.enable_events(destination=[name], reply=True, timeout=5)
        watched = submit(client, queue, {"sleep_s": 3})
        wait_for_task(client, watched, {"running"})
        assert watched in active_ids()
        done = [wait_for_task(client, t, FINAL) for t in (quiet, watched)]
        assert {(d["status"], d["attempts"]) for d in done} == {("succeeded", 1)}
    finally:
        control.close()
        worker.stop()


def test_with_task_events_on_a_worker_takes_no_more_messages_than_its_concurrency(
    client: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    """Runs that take Celery's way were handed to its consumer past its prefetch limit: with
    Flower running, a threads worker of ``-c 1`` took all 40 of one tenant's messages at once
    (an audit, 2026-12-06), so another tenant's task waited behind every one of them and the
    queue's fair share never applied. Now each holds its slot until Celery acks it."""
    queue = "test.async-watched"
    worker = start_worker(settings, queue, "events-bound", log_dir, concurrency=2, pool="threads")
    name = f"events-bound@{socket.gethostname()}"
    control = Celery("test-events", broker=settings.celery_broker_url, set_as_current=False)
    broker = redis.Redis.from_url(settings.celery_broker_url)
    try:
        assert control.control.enable_events(destination=[name], reply=True, timeout=5)
        tasks = [submit(client, queue, {"sleep_s": 4}) for _ in range(6)]

        def running() -> list[str]:
            return [t for t in tasks if client.get(f"/tasks/{t}").json()["status"] == "running"]

        eventually(running, "two runs to start", until=lambda found: len(found) == 2)
        # Two taken, the other four still on the queue for any worker (before: none left)
        assert broker.llen(queue) == 4
        done = [wait_for_task(client, t, FINAL) for t in tasks]
        assert {(d["status"], d["attempts"]) for d in done} == {("succeeded", 1)}
    finally:
        broker.close()
        control.close()
        worker.stop()


def test_with_task_events_on_a_cancel_stops_a_run_of_celerys_way_without_an_error(
    client: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    """A cancel of a task whose card says it may be terminated (every remote agent's) is also
    a revoke with ``terminate``. On a threads worker with task events on (Flower), the run
    had Celery's request, whose terminate asked the pool to kill a thread: the pool raised,
    and the control command logged its traceback for every cancel. The run hears the cancel
    through its flag, as every run on the loop does."""
    queue = "test.async-revocable"
    worker = start_worker(settings, queue, "revocable", log_dir, concurrency=2, pool="threads")
    name = f"revocable@{socket.gethostname()}"
    control = Celery("test-events", broker=settings.celery_broker_url, set_as_current=False)
    try:
        assert control.control.enable_events(destination=[name], reply=True, timeout=5)
        # a run that takes 3 s to stop once it hears the cancel (its flag, on the loop): the
        # revoke, which comes by Celery's broadcast, finds its request still active
        payload = {"gate": uuid.uuid4().hex, "sleep_s": 0, "linger_s": 3}
        task_id = submit(client, queue, payload)
        wait_for_task(client, task_id, {"running"})
        assert client.post(f"/tasks/{task_id}/cancel").json()["status"] == "cancelled"
        eventually(
            lambda: control.control.inspect(destination=[name], timeout=5).active(),
            "the run ended",
            until=lambda answers: answers is not None and answers.get(name) == [],
        )
    finally:
        control.close()
        worker.stop()
    log = worker.output()
    assert f"Terminating {task_id}" in log  # the revoke reached the run's request
    assert "pidbox command error" not in log and "kill_job" not in log
    assert client.get(f"/tasks/{task_id}").json()["status"] == "cancelled"


def test_a_cancels_revoke_of_a_task_a_worker_does_not_run_logs_no_warning_there(
    async_worker: CeleryProcess, settings: Settings
) -> None:
    """A cancel of a cancellable card's running task is a revoke broadcast to every worker.
    Each one that did not run it logged that it could not mark it revoked in the result
    backend, which there is none of (a task's state is in Postgres): a warning on every
    worker for every such cancel."""
    name = f"async@{socket.gethostname()}"
    task_id = str(uuid.uuid4())
    control = Celery("test-revoke", broker=settings.celery_broker_url, set_as_current=False)
    try:
        # the reply comes once the worker has handled it, and so logged what it would
        answers = control.control.revoke(
            task_id, terminate=True, signal="SIGTERM", destination=[name], reply=True, timeout=5
        )
    finally:
        control.close()
    assert answers == [{name: {"ok": "terminate: tasks unknown"}}]
    assert task_id not in async_worker.output()


def test_a_retry_waiting_for_its_back_off_holds_no_slot(
    client: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    """A retry's message waits in Celery's timer until it is due: as Celery raises its
    prefetch limit for such a message, it holds none of the worker's slots meanwhile, and a
    worker of ``-c 1`` runs the next task at once."""
    queue = "test.async-watched"
    worker = start_worker(settings, queue, "back-off", log_dir, concurrency=1, pool="threads")
    try:
        waiting = submit(client, queue, {"retry_after_s": 8})
        eventually(
            lambda: client.get(f"/tasks/{waiting}").json(),
            "the first attempt to ask for its retry",
            until=lambda task: (task["status"], task["attempts"]) == ("queued", 1),
        )
        after = wait_for_task(client, submit(client, queue, {"sleep_s": 0.1}), FINAL)
        assert after["status"] == "succeeded"
        assert client.get(f"/tasks/{waiting}").json()["status"] == "queued"  # still waits
        assert wait_for_task(client, waiting, FINAL)["status"] == "succeeded"
    finally:
        worker.stop()


def test_progress_of_an_async_handler_reaches_the_task_and_its_stream(
    client: httpx.Client, async_worker: CeleryProcess
) -> None:
    task_id = submit(client, "test.async-stream", {"n": 2, "progress": True})
    events = read_stream(client, "GET", f"/tasks/{task_id}/events")
    kinds = [e["event"] for e in events]
    assert kinds[2:-1] == ["output", "progress"] * 2
    assert client.get(f"/tasks/{task_id}").json()["progress"]["percent"] == 100


def test_a_handler_reporting_progress_for_each_of_many_items_makes_a_bounded_number_of_writes(
    client: httpx.Client, async_worker: CeleryProcess
) -> None:
    """Each report is a write to the task's row and an event (and a webhook message where one
    is subscribed): one per item of a tenant's payload made 400 of each. Past the burst the
    reports pass at the task's rate, and the outputs, which are the answer, all arrive."""
    items = 400
    task_id = submit(client, "test.async-stream", {"n": items, "progress": True})
    stream = read_stream(client, "GET", f"/tasks/{task_id}/events")
    task = client.get(f"/tasks/{task_id}").json()
    ran_s = (
        datetime.fromisoformat(task["finished_at"]) - datetime.fromisoformat(task["started_at"])
    ).total_seconds()
    reports = [e for e in stream if e["event"] == "progress"]

    assert task["status"] == "succeeded"
    assert len([e for e in stream if e["event"] == "output"]) == items
    assert PROGRESS_BURST <= len(reports) <= PROGRESS_BURST + PROGRESS_PER_S * ran_s + 1
    assert len(reports) < items, ran_s  # the run took under 35 s: a bound that held back most


# -- crashes and shutdowns: workers of their own, on queues no other test worker consumes --


def statuses_of(http: httpx.Client, ids: list[str]) -> dict[str, dict[str, object]]:
    return {task_id: http.get(f"/tasks/{task_id}").json() for task_id in ids}


def all_final(
    http: httpx.Client, ids: list[str], what: str, timeout_s: float
) -> dict[str, dict[str, object]]:
    return eventually(
        lambda: statuses_of(http, ids),
        what,
        timeout_s,
        until=lambda found: all(t["status"] in FINAL for t in found.values()),
    )


def final_events(redis_url: str, task_id: str) -> int:
    return sum(e.final for e in events.read_log_sync(redis.Redis.from_url(redis_url), task_id))


def runs(redis_url: str, task_id: str) -> int:
    return int(redis.Redis.from_url(redis_url).get(f"reach:test:runs:{task_id}") or 0)


@pytest.mark.timeout(600)
def test_kill_9_with_200_coroutines_in_flight_loses_nothing_and_runs_nothing_twice(
    api: ServedApp,
    make_key,  # type: ignore[no-untyped-def]
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    system_beat: CeleryProcess,
) -> None:
    _, token = make_key()
    queues = "test.async-idem,test.async-once"
    # one tenant's 200 all in flight: every slot its (REACH_MAX_SLOTS_SHARE keeps none back)
    every_slot = {"REACH_MAX_SLOTS_SHARE": "1"}
    doomed = start_worker(settings, queues, "doomed", log_dir, every_slot, 200, "threads")
    heir: CeleryProcess | None = None
    try:
        envelopes = [
            {"capability": capability, "payload": {"sleep_s": 120}}
            for capability in ("test.async-idem", "test.async-once")
            for _ in range(100)
        ]
        responses = asyncio.run(submit_many(api, token, envelopes))
        assert {r.status_code for r in responses} == {202}
        ids = [r.json()["task_id"] for r in responses]
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}) as http:
            eventually(
                lambda: statuses_of(http, ids),
                "all 200 running in the doomed worker",
                120,
                0.5,
                until=lambda found: all(t["status"] == "running" for t in found.values()),
            )
            doomed.kill_hard()
            heir = start_worker(settings, queues, "heir", log_dir, concurrency=50, pool="threads")
            done = all_final(http, ids, "all 200 final after the kill", 240)
    finally:
        doomed.stop()
        if heir is not None:
            heir.stop()
    idempotent, once = ids[:100], ids[100:]
    assert {done[t]["status"] for t in idempotent} == {"succeeded"}
    assert {done[t]["result"]["runs"] for t in idempotent} == {2}  # type: ignore[index]
    assert {done[t]["status"] for t in once} == {"failed"}
    assert {done[t]["error"]["code"] for t in once} == {"worker_lost"}  # type: ignore[index]
    assert {runs(redis_url, t) for t in once} == {1}
    finals = eventually(
        lambda: {t: final_events(redis_url, t) for t in ids},
        "one final event for every task",
        60,
        until=lambda found: all(n >= 1 for n in found.values()),
    )
    assert set(finals.values()) == {1}


def agent_of(task: dict[str, object]) -> dict[str, object]:
    agent = task["agent"]
    assert isinstance(agent, dict)
    return agent


def crashed_after_a_group(
    api: ServedApp, token: str, settings: Settings, log_dir: Path, group: str, sleep_s: float
) -> tuple[list[str], dict[str, dict[str, object]]]:
    """20 idempotent and 20 other tasks sent to a worker (threads, -c 40) that kills itself
    right after its first ``group`` of more than one write; then a worker that does not.
    The ids (idempotent first), and the tasks once all are final."""
    queues = "test.async-idem,test.async-once"
    env = {faults.CRASH_AFTER_GROUP: group}
    doomed = start_worker(settings, queues, f"doomed-{group}", log_dir, env, 40, "threads")
    heir: CeleryProcess | None = None
    try:
        # Queued whatever: on a loaded machine the worker may die before the last submits,
        # its lease gone with it (503 no_agent_available), and they wait for the heir.
        envelopes = [
            {
                "capability": capability,
                "payload": {"sleep_s": sleep_s},
                "queue_if_unavailable": True,
            }
            for capability in ("test.async-idem", "test.async-once")
            for _ in range(20)
        ]
        responses = asyncio.run(submit_many(api, token, envelopes))
        assert {r.status_code for r in responses} == {202}, [r.text for r in responses]
        ids = [r.json()["task_id"] for r in responses]
        assert doomed.process is not None
        eventually(lambda: doomed.process.poll(), f"the worker dead after its {group}", 60)
        assert doomed.process.returncode == -signal.SIGKILL
        heir = start_worker(
            settings, queues, f"heir-{group}", log_dir, concurrency=40, pool="threads"
        )
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}) as http:
            return ids, all_final(http, ids, "all 40 final after the crash", 240)
    finally:
        doomed.stop()
        if heir is not None:
            heir.stop()


@pytest.mark.parametrize("queue", ["test.async-once", "test.sync-idem"])
def test_a_run_that_fails_before_its_claim_takes_celerys_way_and_runs_once(
    client: httpx.Client, settings: Settings, log_dir: Path, redis_url: str, queue: str
) -> None:
    """A run without Celery's request that fails before its claim (Postgres away; injected
    here) goes back to Celery's strategy, then to a pool thread: each task runs once."""
    env = {faults.DIRECT_FAILS: queue}
    name = f"direct-fails-{queue}"
    worker = start_worker(settings, queue, name, log_dir, env, 10, "threads")
    try:
        ids = [submit(client, queue, {"sleep_s": 0.05}) for _ in range(5)]
        done = {t: wait_for_task(client, t, FINAL) for t in ids}
    finally:
        worker.stop()
    assert {(d["status"], d["attempts"]) for d in done.values()} == {("succeeded", 1)}
    assert {runs(redis_url, t) for t in ids} == {1}
    assert (log_dir / f"{name}.log").read_text().count("the direct path failed") >= 5


@pytest.mark.parametrize("queue", ["test.async-once", "test.sync-idem"])
def test_a_final_write_that_finds_postgres_gone_is_written_once_it_is_back(
    client: httpx.Client,
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    engine: Engine,
    queue: str,
) -> None:
    """A handler's outcome exists only in its process. A final write that found Postgres
    gone (a restart, a failover) was lost: the message came again, found the task running,
    and the task ended worker_lost, or ran again if idempotent. Now the write is tried again
    until Postgres answers: the task ends with its one run's result."""
    name = f"finish-retry-{queue}"
    worker = start_worker(settings, queue, name, log_dir, concurrency=10, pool="threads")
    log = log_dir / f"{name}.log"
    try:
        task_id = submit(client, queue, {"sleep_s": 3})
        wait_for_task(client, task_id, {"running"})
        # When Postgres takes no connection (the API keeps the ones it holds) and the
        # worker's are cut, while its task runs
        with connections_refused(engine):
            assert terminate_backends_of(engine, worker.pid) > 0
            eventually(lambda: "its final write failed" in log.read_text(), "a failed final write")
        done = wait_for_task(client, task_id, FINAL)
    finally:
        worker.stop()
    # Then, once it takes them again, the task ends as its one run did
    assert (done["status"], done["attempts"]) == ("succeeded", 1), done
    assert runs(redis_url, task_id) == 1


@contextmanager
def connections_refused(engine: Engine) -> Iterator[None]:
    """While inside, the test's database takes no new connection, from anyone."""
    database = engine.url.database
    admin = create_engine(engine.url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false'))
        try:
            yield
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true'))
    finally:
        admin.dispose()


def terminate_backends_of(engine: Engine, pid: int) -> int:
    """Ends the Postgres sessions of process ``pid`` (by its sockets' ports); how many."""
    ports = [
        c.laddr.port
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == engine.url.port
    ]
    with engine.connect() as conn:
        ended = conn.execute(
            text(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE client_port = ANY(:ports)"
            ),
            {"ports": ports},
        ).scalar_one()
    return int(ended)


@pytest.mark.timeout(400)
def test_a_crash_right_after_a_group_of_claims_loses_none_and_runs_none_twice(
    api: ServedApp,
    make_key,  # type: ignore[no-untyped-def]
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    system_beat: CeleryProcess,
) -> None:
    _, token = make_key()
    ids, done = crashed_after_a_group(api, token, settings, log_dir, "claims", 0.5)
    idempotent, once = ids[:20], ids[20:]
    # the idempotent ones all succeed; the others succeed or, lost with the worker, fail
    assert {done[t]["status"] for t in idempotent} == {"succeeded"}
    lost = [t for t in once if done[t]["status"] == "failed"]
    assert {done[t]["error"]["code"] for t in lost} <= {"worker_lost"}  # type: ignore[index]
    assert {done[t]["status"] for t in once} <= {"succeeded", "failed"}
    # none of the others ran twice; a lost one ran at most in the dead worker
    assert {runs(redis_url, t) for t in once if t not in lost} == {1}
    assert all(runs(redis_url, t) <= 1 for t in lost)
    # the group claimed its tasks and died before any ran: each is lost without a run, or
    # (idempotent) ran once, on its second attempt
    in_group = [t for t in lost if runs(redis_url, t) == 0] + [
        t for t in idempotent if done[t]["attempts"] == 2 and runs(redis_url, t) == 1
    ]
    assert len(in_group) >= 2
    assert {final_events(redis_url, t) for t in ids} == {1}


@pytest.mark.timeout(400)
def test_a_crash_right_after_a_group_of_finishes_loses_none_and_runs_none_again(
    api: ServedApp,
    make_key,  # type: ignore[no-untyped-def]
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    system_beat: CeleryProcess,
) -> None:
    _, token = make_key()
    ids, done = crashed_after_a_group(api, token, settings, log_dir, "finishes", 0.5)
    idempotent, once = ids[:20], ids[20:]
    # the group, final in Postgres when the worker died: its tasks stay as they ended, each
    # run once, and get their final events from the worker that finds them final
    doomed = [t for t in ids if str(agent_of(done[t])["instance"]).startswith("doomed-finishes@")]
    group = [t for t in doomed if done[t]["status"] == "succeeded"]
    assert len(group) >= 2
    assert {runs(redis_url, t) for t in group} == {1}
    # the tasks in flight beside it: run again if idempotent, else lost; none lost silently
    assert {done[t]["status"] for t in idempotent} == {"succeeded"}
    lost = [t for t in once if done[t]["status"] == "failed"]
    assert {done[t]["error"]["code"] for t in lost} <= {"worker_lost"}  # type: ignore[index]
    assert all(runs(redis_url, t) <= 1 for t in once)
    assert {final_events(redis_url, t) for t in ids} == {1}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("capability", ["test.async-idem", "test.sync-idem"])
def test_sigterm_lets_runs_in_flight_finish_and_leaves_the_rest_queued(
    capability: str,
    api: ServedApp,
    make_key,  # type: ignore[no-untyped-def]
    settings: Settings,
    log_dir: Path,
    redis_url: str,
) -> None:
    _, token = make_key()
    draining = start_worker(
        settings, capability, f"draining-{capability}", log_dir, concurrency=5, pool="threads"
    )
    after: CeleryProcess | None = None
    try:
        # Each run waits at a gate, opened once the worker has begun its warm shutdown: runs
        # of 2 s had ended, on a loaded machine, between the test's look (five running) and
        # its signal, and five more had started (10 succeeded, not 5). Runs that end after
        # the signal start no more (before, the loop consumer took runs for 0.5 s more)
        gate = uuid.uuid4().hex
        payload = {"gate": gate, "sleep_s": 0}
        envelopes = [{"capability": capability, "payload": payload}] * 10
        responses = asyncio.run(submit_many(api, token, envelopes))
        ids = [r.json()["task_id"] for r in responses]
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}) as http:
            eventually(
                lambda: statuses_of(http, ids),
                "five running",
                60,
                0.1,
                until=lambda found: sum(t["status"] == "running" for t in found.values()) == 5,
            )
            assert draining.process is not None
            draining.process.send_signal(signal.SIGTERM)  # Celery's warm shutdown
            eventually(lambda: "Warm shutdown" in draining.output(), "the worker's warm shutdown")
            redis.Redis.from_url(redis_url).set(GATE_KEY.format(gate), 1, ex=300)
            assert draining.process.wait(timeout=60) == 0
            drained = statuses_of(http, ids)
            counts = {s: sum(t["status"] == s for t in drained.values()) for s in FINAL}
            assert counts["succeeded"] == 5
            assert sum(t["status"] == "queued" for t in drained.values()) == 5
            after = start_worker(
                settings, capability, f"after-drain-{capability}", log_dir, pool="threads"
            )
            done = all_final(http, ids, "the queued five run on the next worker", 60)
    finally:
        draining.stop()
        if after is not None:
            after.stop()
    assert {t["status"] for t in done.values()} == {"succeeded"}
    assert {runs(redis_url, t) for t in ids} == {1}
