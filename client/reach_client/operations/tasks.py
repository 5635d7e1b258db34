"""Submitting, reading, waiting for, cancelling and listing tasks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypedDict, Unpack

from reach_client.errors import APITimeoutError, WaitTimeoutError
from reach_client.models import Page, Task
from reach_client.plans import IDEMPOTENCY_KEY, Plan, Request, path, pause, query, send
from reach_client.retries import RetryPolicy

# Polling past the server's wait: soon at first, then every 2 s at most.
POLL_FIRST_S = 0.2
POLL_FACTOR = 1.5
POLL_MAX_S = 2.0
Clock = Callable[[], float]


class EnvelopeFields(TypedDict, total=False):
    """The envelope's optional fields (the API's README says what each does)."""

    deadline_ms: int
    idempotency_key: str
    session_id: str
    callback: Mapping[str, Any]
    priority: int
    max_attempts: int
    source: str
    metadata: Mapping[str, Any]
    queue_if_unavailable: bool
    result_ttl_s: int
    target: str
    hint: str


def submission(
    policy: RetryPolicy,
    capability: str,
    payload: Mapping[str, Any],
    *,
    wait: bool = False,
    timeout_s: float | None = None,
    **fields: Unpack[EnvelopeFields],
) -> Plan[Task]:
    """Submit the envelope, and with ``wait`` wait for the task to be final. The idempotency
    key is the caller's, or one made for this call: every retry of it carries the same."""
    given = {k: v for k, v in fields.items() if v is not None}
    key = str(given.pop("idempotency_key", None) or uuid.uuid4())
    body = {"capability": capability, "payload": dict(payload), **given}
    if wait:
        return run(policy, body, key, timeout_s)
    return submit(policy, body, key)


def _submission(body: Mapping[str, Any], key: str, **options: Any) -> Request:
    # The key travels as the header only: one key per call, the same on every retry.
    return Request("POST", "/tasks", body=dict(body), headers={IDEMPOTENCY_KEY: key}, **options)


def submit(policy: RetryPolicy, body: Mapping[str, Any], key: str) -> Plan[Task]:
    answer = yield from send(_submission(body, key), policy)
    return Task.from_json(answer.json())


def run(
    policy: RetryPolicy,
    body: Mapping[str, Any],
    key: str,
    timeout_s: float | None,
    clock: Clock = time.monotonic,
) -> Plan[Task]:
    """Submit in sync mode (the server waits for the task), then poll past the server's wait
    until the task is final. ``WaitTimeoutError`` when ``timeout_s`` runs out first."""
    started = clock()
    sync = _submission({**body, "reply_mode": "sync"}, key, timeout_s=timeout_s)
    try:
        answer = yield from send(replace(sync, retry_timeouts=False), policy)
    except APITimeoutError:
        # We would not wait as long as the server does: the same key names the task at once.
        answer = yield from send(replace(sync, body={**body, "reply_mode": "async"}), policy)
    task = Task.from_json(answer.json())
    if task.final:
        return task
    remaining = None if timeout_s is None else max(0.0, timeout_s - (clock() - started))
    return (yield from wait(policy, task.task_id, remaining, clock))


def wait(
    policy: RetryPolicy, task_id: str, timeout_s: float | None, clock: Clock = time.monotonic
) -> Plan[Task]:
    """Poll ``GET /tasks/{id}`` until the task is final, or ``WaitTimeoutError``."""
    deadline = None if timeout_s is None else clock() + timeout_s
    delay = POLL_FIRST_S
    while True:
        task = yield from get(policy, task_id)
        if task.final:
            return task
        left = None if deadline is None else deadline - clock()
        if left is not None and left <= 0:
            raise WaitTimeoutError(task)
        yield from pause(delay if left is None else min(delay, left))
        delay = min(delay * POLL_FACTOR, POLL_MAX_S)


def get(policy: RetryPolicy, task_id: str) -> Plan[Task]:
    answer = yield from send(Request("GET", path("tasks", task_id)), policy)
    return Task.from_json(answer.json())


def cancel(policy: RetryPolicy, task_id: str) -> Plan[Task]:
    """Cancel a queued or running task; ``ConflictError`` (``task_final``) when it ended."""
    answer = yield from send(Request("POST", path("tasks", task_id, "cancel")), policy)
    return Task.from_json(answer.json())


def page(
    policy: RetryPolicy,
    *,
    capability: str | None = None,
    status: str | None = None,
    session_id: str | None = None,
    limit: int | None = None,
    cursor: str | None = None,
) -> Plan[Page[Task]]:
    params = query(
        capability=capability, status=status, session_id=session_id, limit=limit, cursor=cursor
    )
    answer = yield from send(Request("GET", "/tasks", params=params), policy)
    doc = answer.json()
    return Page([Task.from_json(t) for t in doc["tasks"]], doc.get("next_cursor"))


def events_request(task_id: str, last_event_id: int | None) -> Request:
    headers = {"Accept": "text/event-stream"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    return Request("GET", path("tasks", task_id, "events"), headers=headers)
