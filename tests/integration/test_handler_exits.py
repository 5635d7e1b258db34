"""A handler that raises what is not an ``Exception``: ``SystemExit`` (a library's
``sys.exit()``, argparse's ``error``), a ``CancelledError`` nobody asked for, a library's own
``BaseException``. Each fails its own task, as any failure of the agent's does, and the worker
goes on.

Before: a sync handler's exit left its message held for good, so a ``-c 2`` worker took
nothing more after two; an async handler's exit stopped the event loop, and every task on
it stayed ``running``; a handler's own ``CancelledError`` was told as the caller's cancel.
Any other ``BaseException`` still held a threads worker's slot for good (sync or async), and
on prefork ended its task ``worker_lost``, run again when its agent is idempotent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.settings import Settings
from tests.integration.stack import CeleryProcess, start_worker, wait_for_task

FINAL = {"succeeded", "failed", "cancelled", "expired"}


@pytest.fixture(scope="module")
def exits_worker(settings: Settings, log_dir: Path) -> Iterator[CeleryProcess]:
    """Two slots on the threads pool: two held messages would stop it."""
    process = start_worker(
        settings, "test.exit,test.exit-async", "exits", log_dir, concurrency=2, pool="threads"
    )
    yield process
    process.stop()


def submit(client: httpx.Client, capability: str, payload: dict[str, Any]) -> str:
    response = client.post("/tasks", json={"capability": capability, "payload": payload})
    assert response.status_code == 202, response.text
    task_id: str = response.json()["task_id"]
    return task_id


def finished(client: httpx.Client, task_id: str) -> dict[str, Any]:
    return wait_for_task(client, task_id, FINAL, timeout_s=60)


def test_a_sync_handlers_sys_exit_fails_its_task_and_frees_its_slot(
    client: httpx.Client, exits_worker: CeleryProcess
) -> None:
    # Given three handlers that call sys.exit(2) on a worker of two slots
    exited = [submit(client, "test.exit", {"exit": True}) for _ in range(3)]
    # When they have run
    tasks = [finished(client, task_id) for task_id in exited]
    # Then each failed as the agent's failure, not as a lost worker, and was not retried
    for task in tasks:
        assert task["status"] == "failed", task
        assert task["error"]["code"] == "agent_error", task
        assert "SystemExit(2)" in task["error"]["message"], task
        assert task["attempts"] == 1, task
    # and the worker still takes work in both its slots
    after = [submit(client, "test.exit", {"sleep_s": 0.2}) for _ in range(4)]
    assert [finished(client, task_id)["status"] for task_id in after] == ["succeeded"] * 4
    assert exits_worker.process is not None and exits_worker.process.poll() is None


def test_an_async_handlers_sys_exit_fails_its_task_and_the_loop_runs_on(
    client: httpx.Client, exits_worker: CeleryProcess
) -> None:
    # Given a coroutine running for two seconds on the worker's event loop
    running = submit(client, "test.exit-async", {"sleep_s": 2})
    wait_for_task(client, running, {"running"}, timeout_s=30)
    # When another task's handler calls sys.exit(2) on the same loop
    exited = finished(client, submit(client, "test.exit-async", {"exit": True}))
    # Then that task failed as the agent's failure
    assert exited["status"] == "failed", exited
    assert exited["error"]["code"] == "agent_error", exited
    assert "SystemExit(2)" in exited["error"]["message"], exited
    # and the loop ran on: the first task finished, and a new one runs
    assert finished(client, running)["status"] == "succeeded"
    assert finished(client, submit(client, "test.exit-async", {}))["status"] == "succeeded"


def test_a_cancelled_error_the_handler_raises_itself_is_its_failure_not_a_cancel(
    client: httpx.Client, exits_worker: CeleryProcess
) -> None:
    # Given a handler that awaits a sub-task of its own, which it cancels: nobody cancels
    # the task
    task = finished(client, submit(client, "test.exit-async", {"cancel_itself": True}))
    # Then the task failed as the agent's failure, not as cancelled by the caller
    assert task["status"] == "failed", task
    assert task["error"]["code"] == "agent_error", task
    assert "CancelledError" in task["error"]["message"], task


@pytest.mark.parametrize(
    ("capability", "raised", "named"),
    [
        ("test.exit", "cancelled", "CancelledError"),
        ("test.exit", "base", "LibraryAbort"),
        ("test.exit-async", "base", "LibraryAbort"),
    ],
)
def test_any_other_base_exception_fails_its_task_and_frees_its_slot(
    client: httpx.Client, exits_worker: CeleryProcess, capability: str, raised: str, named: str
) -> None:
    # Given three handlers that raise it on a worker of two slots
    tasks = [finished(client, submit(client, capability, {"raise": raised})) for _ in range(3)]
    # Then each failed as the agent's failure, once
    for task in tasks:
        assert (task["status"], task["error"]["code"], task["attempts"]) == (
            "failed",
            "agent_error",
            1,
        ), task
        assert named in task["error"]["message"], task
    # and the worker still takes work in both its slots
    after = [submit(client, capability, {"sleep_s": 0.2}) for _ in range(4)]
    assert [finished(client, task_id)["status"] for task_id in after] == ["succeeded"] * 4


def test_a_base_exception_or_an_exit_on_prefork_fails_its_task_once(
    client: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    """Not ``worker_lost`` (a child that died), run again as such: its agent is idempotent.
    A pool child ignores SIGINT and a SIGTERM ends it, so an exit raised in its handler is
    the handler's own: ``sys.exit()`` and ``KeyboardInterrupt`` there ended the child."""
    process = start_worker(settings, "test.exit-prefork", "exits-prefork", log_dir, concurrency=1)
    try:
        tasks = {
            named: finished(client, submit(client, "test.exit-prefork", payload))
            for named, payload in [
                ("LibraryAbort", {"raise": "base"}),
                ("SystemExit(2)", {"exit": True}),
                ("KeyboardInterrupt()", {"raise": "interrupt"}),
                ("<unprintable Unprintable>", {"raise": "unprintable"}),
            ]
        }
    finally:
        process.stop()
    for named, task in tasks.items():
        assert (task["status"], task["error"]["code"], task["attempts"]) == (
            "failed",
            "agent_error",
            1,
        ), task
        assert named in task["error"]["message"], task


@pytest.mark.parametrize("capability", ["test.exit", "test.exit-async"])
def test_an_exception_whose_str_raises_fails_its_task_named_by_its_class(
    client: httpx.Client, exits_worker: CeleryProcess, capability: str
) -> None:
    """Its failure raised in the runner before: the run ended without a final write, and the
    orphan check ended the task ``worker_lost`` (run again, had its agent been idempotent)."""
    task = finished(client, submit(client, capability, {"raise": "unprintable"}))
    assert (task["status"], task["error"]["code"], task["attempts"]) == (
        "failed",
        "agent_error",
        1,
    ), task
    assert task["error"]["message"] == "Unprintable: <unprintable Unprintable>", task
