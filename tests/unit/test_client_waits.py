"""``timeout=`` bounds the whole wait of ``tasks.wait`` and ``run``: every request and every
pause within it ends by the deadline, and then ``WaitTimeoutError`` says so, whatever the
client's own timeout, its retries or a ``Retry-After`` ask for. A sync submit that a gateway
gave up on (502, 504) is asked again in async mode, as one the client gave up on is. Both
clients, against a real loopback server (``client_loopback``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from reach_client import AsyncReach, Reach, WaitTimeoutError

from tests.integration.receiver import Reply
from tests.unit.client_loopback import Loopback, problem_reply, task_reply

# The client's own timeout and retries, far past the caller's wait: the wait must not use them.
CLIENT_TIMEOUT_S = 8.0
WAIT_S = 1.0
# The server's Retry-After: a client that slept it out, or waited on its own timeout, took at
# least this long; one that kept the caller's deadline ended some seconds before it.
RETRY_AFTER_S = 6


def call(kind: str, url: str, action: Callable[[Any], Any]) -> Any:
    """``action(client)`` on a blocking or an asyncio client of ``url``; its result."""
    if kind == "sync":
        with Reach(url, "rk_test", timeout=CLIENT_TIMEOUT_S) as reach:
            return action(reach)

    async def in_async() -> Any:
        async with AsyncReach(url, "rk_test", timeout=CLIENT_TIMEOUT_S) as reach:
            return await action(reach)

    return asyncio.run(in_async())


def timed_wait(kind: str, api: Loopback, action: Callable[[Any], Any]) -> tuple[Any, float]:
    """The ``WaitTimeoutError`` that ``action`` raised, and how long it took."""
    started = time.monotonic()
    with pytest.raises(WaitTimeoutError) as caught:
        call(kind, api.base_url, action)
    return caught.value, time.monotonic() - started


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_poll_the_server_holds_ends_at_the_deadline_with_the_task_as_last_seen(
    kind: str,
) -> None:
    # Given a task seen running, whose next poll the server never answers
    def script(n: int) -> Reply:
        return task_reply("running") if n == 1 else api.hold()

    with Loopback(script) as api:
        # When the caller waits for it one second
        error, took = timed_wait(kind, api, lambda r: r.tasks.wait("t1", timeout=WAIT_S))

    # I expect the wait to end then, not after the client's timeout and retries
    assert took < RETRY_AFTER_S, took
    assert error.task is not None and (error.task.task_id, error.task.status) == ("t1", "running")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_retry_after_past_the_deadline_is_not_slept_out(kind: str) -> None:
    # Given a run whose task is queued, and a poll refused with Retry-After: 6 (which the
    # client honours: it is below its 60 s)
    def script(n: int) -> Reply:
        if n == 1:
            return task_reply("queued", 202)
        return problem_reply(503, "overloaded", **{"Retry-After": str(RETRY_AFTER_S)})

    with Loopback(script) as api:
        error, took = timed_wait(kind, api, lambda r: r.run("echo", {}, timeout=WAIT_S))

    assert took < RETRY_AFTER_S, took
    assert error.task is not None and error.task.status == "queued"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_run_no_answer_named_in_time_gives_the_key_that_finds_its_task(kind: str) -> None:
    # Given a server that answers nothing in time, its submits included
    with Loopback(lambda n: api.hold()) as api:
        error, took = timed_wait(
            kind, api, lambda r: r.run("echo", {}, timeout=WAIT_S, idempotency_key="k-7")
        )

    assert took < RETRY_AFTER_S, took
    assert error.task is None and error.idempotency_key == "k-7"
    # The sync submit left time to ask for the task in async mode, with the same key
    bodies = [json.loads(r.body) for r in api.requests]
    assert [b["reply_mode"] for b in bodies] == ["sync", "async"]
    assert {r.headers["idempotency-key"] for r in api.requests} == {"k-7"}


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("gateway", [502, 504])
def test_a_gateway_that_gave_up_on_a_sync_submit_is_answered_by_polling(
    kind: str, gateway: int
) -> None:
    # Given a proxy that gives up on the sync submit (the server still waits for the task)
    def script(n: int) -> Reply:
        if n == 1:
            return Reply(gateway, {"Content-Type": "text/html"}, b"<html>gateway</html>")
        if n == 2:
            return task_reply("running", 202)
        return task_reply("succeeded", result={"ok": True})

    with Loopback(script) as api:
        # When the caller runs a task
        task = call(kind, api.base_url, lambda r: r.run("echo", {}, timeout=30))

    # I expect the same submit asked once again, in async mode, with its key; then polling
    assert (task.status, task.result) == ("succeeded", {"ok": True})
    assert api.methods == ["POST", "POST", "GET"]
    sync, again = (json.loads(r.body) for r in api.requests[:2])
    assert (sync["reply_mode"], again["reply_mode"]) == ("sync", "async")
    keys = [r.headers["idempotency-key"] for r in api.requests[:2]]
    assert keys[0] == keys[1]
