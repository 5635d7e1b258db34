"""Submitting, reading, waiting for, cancelling and listing tasks."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any, TypedDict, Unpack

from reach_client.deadlines import Clock, Deadline, DeadlinePassed
from reach_client.errors import APIStatusError, APITimeoutError, WaitTimeoutError
from reach_client.models import Page, Task
from reach_client.plans import IDEMPOTENCY_KEY, Plan, Request, path, pause, query, read, send
from reach_client.retries import GATEWAY_STATUSES, RetryPolicy

# Polling past the server's wait: soon at first, then every 2 s at most.
POLL_FIRST_S = 0.2
POLL_FACTOR = 1.5
POLL_MAX_S = 2.0
# What a sync submit leaves of the caller's wait for learning its task when the server is
# still waiting for it (the same submit in async mode): at most 1 s, or half the wait.
TASK_LOOKUP_RESERVE_S = 1.0
# A stream's read timeout, whatever the client's: the server pings every 15 s of silence
# (REACH_SSE_PING_S), so a quiet stream is alive for 60 s without a byte.
STREAM_READ_TIMEOUT_S = 60.0


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


def submission_key(fields: EnvelopeFields) -> str:
    """The idempotency key of a submit: the caller's, or one made for this call."""
    return fields.get("idempotency_key") or str(uuid.uuid4())


@contextlib.contextmanager
def keyed(key: str) -> Iterator[None]:
    """Whatever leaves a submit carries the ``key`` it was sent with, as ``idempotency_key``
    (and in a note): an error, or the caller's own cancellation (``CancelledError``, which
    ``asyncio.timeout`` raises its ``TimeoutError`` from), a ``KeyboardInterrupt``. Such a
    submit may have made its task; a caller that let the client make the key had no way to
    submit again without making a second."""
    try:
        yield
    except BaseException as exc:
        if getattr(exc, "idempotency_key", None) is None:
            with contextlib.suppress(AttributeError):
                setattr(exc, "idempotency_key", key)  # noqa: B010  # any exception's
            exc.add_note(f"reach: the submit was sent with idempotency key {key}")
        raise


def _submission(body: Mapping[str, Any], key: str, **options: Any) -> Request:
    # The key travels as the header only: one key per call, the same on every retry.
    return Request("POST", "/tasks", body=dict(body), headers={IDEMPOTENCY_KEY: key}, **options)


def submit(policy: RetryPolicy, body: Mapping[str, Any], key: str) -> Plan[Task]:
    answer = yield from send(_submission(body, key), policy)
    return read(answer, Task.from_json)


def run(
    policy: RetryPolicy,
    body: Mapping[str, Any],
    key: str,
    timeout_s: float | None,
    clock: Clock = time.monotonic,
) -> Plan[Task]:
    """Submit in sync mode (the server waits for the task), then poll past the server's wait
    until the task is final. ``WaitTimeoutError`` when ``timeout_s`` runs out first: every
    request and pause ends by then."""
    deadline = Deadline.after(timeout_s, clock)
    sync = _submission({**body, "reply_mode": "sync"}, key, retry_timeouts=False)
    if deadline is not None:
        left = deadline.left_s()
        sync = replace(sync, timeout_s=left - min(TASK_LOOKUP_RESERVE_S, left / 2))
    try:
        try:
            answer = yield from send(sync, policy, deadline)
        except (APITimeoutError, APIStatusError) as exc:
            if not _gave_up_waiting(exc):
                raise
            # The same key names the task at once.
            asked = _submission({**body, "reply_mode": "async"}, key)
            answer = yield from send(asked, policy, deadline)
    except DeadlinePassed:
        raise WaitTimeoutError(None, idempotency_key=key) from None
    task = read(answer, Task.from_json)
    if task.final:
        return task
    return (yield from _poll(policy, task, deadline))


def _gave_up_waiting(error: APITimeoutError | APIStatusError) -> bool:
    """Whether a sync submit ended because we, or a gateway in front of the API (502, 504),
    would not wait as long as the server does: the task may be running all the same."""
    return isinstance(error, APITimeoutError) or error.status in GATEWAY_STATUSES


def wait(
    policy: RetryPolicy, task_id: str, timeout_s: float | None, clock: Clock = time.monotonic
) -> Plan[Task]:
    """Poll ``GET /tasks/{id}`` until the task is final, or ``WaitTimeoutError`` once
    ``timeout_s`` has passed: every request and pause ends by then."""
    deadline = Deadline.after(timeout_s, clock)
    try:
        task = yield from get(policy, task_id, deadline)
    except DeadlinePassed:
        raise WaitTimeoutError(None, task_id=task_id) from None
    if task.final:
        return task
    return (yield from _poll(policy, task, deadline))


def _poll(policy: RetryPolicy, task: Task, deadline: Deadline | None) -> Plan[Task]:
    """``task`` polled until final; ``WaitTimeoutError`` with it as last seen once the
    deadline passes."""
    delay = POLL_FIRST_S
    while True:
        yield from pause(delay if deadline is None else deadline.cut(delay))
        delay = min(delay * POLL_FACTOR, POLL_MAX_S)
        try:
            task = yield from get(policy, task.task_id, deadline)
        except DeadlinePassed:
            raise WaitTimeoutError(task) from None
        if task.final:
            return task


def get(policy: RetryPolicy, task_id: str, deadline: Deadline | None = None) -> Plan[Task]:
    answer = yield from send(Request("GET", path("tasks", task_id)), policy, deadline)
    return read(answer, Task.from_json)


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
    return Request(
        "GET",
        path("tasks", task_id, "events"),
        headers=headers,
        read_at_least_s=STREAM_READ_TIMEOUT_S,
    )
