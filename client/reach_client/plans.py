"""Every operation is written once, as a plan: a generator that yields the HTTP requests and
the pauses it needs and returns its result. ``Reach`` runs plans with blocking I/O,
``AsyncReach`` with ``await``; neither knows what an operation does, and no operation knows
which of them runs it.

A driver sends each yielded ``Request`` and sends the ``Response`` back in (``advance``), or
throws the ``APIConnectionError`` it met; it sleeps for each ``Sleep``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from reach_client.deadlines import Deadline, DeadlinePassed
from reach_client.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    InvalidRequestError,
    RedirectError,
    UnexpectedAnswerError,
    error_class,
    from_problem,
)
from reach_client.limits import TOO_LARGE
from reach_client.retries import (
    GATEWAY_STATUSES,
    NOT_APPLIED_STATUSES,
    RetryPolicy,
    is_retried,
    may_retry,
    parse_retry_after,
)

T = TypeVar("T")
IDEMPOTENCY_KEY = "Idempotency-Key"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    params: Mapping[str, str | int] = field(default_factory=dict)
    body: Any = None  # JSON; None: no body
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float | None = None  # this request's read timeout, else the client's
    read_at_least_s: float | None = None  # a floor under the read timeout
    within_s: float | None = None  # no phase waits longer: the time left of a caller's wait
    # False: a timeout, or a gateway's 502 or 504 (one that gave up waiting), goes to the
    # plan at once: it knows a better next request than the same one again.
    retry_timeouts: bool = True

    @property
    def idempotency_key(self) -> str | None:
        return self.headers.get(IDEMPOTENCY_KEY)

    def content(self) -> bytes | None:
        return None if self.body is None else json.dumps(self.body).encode()


@dataclass(frozen=True)
class Response:
    status: int
    headers: httpx.Headers
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content) if self.content else None


@dataclass(frozen=True)
class Sleep:
    seconds: float


Step = Request | Sleep
Plan = Generator[Step, object, T]


def call(request: Request) -> Plan[Response]:
    """One attempt: the answer, whatever its status."""
    answer = yield request
    assert isinstance(answer, Response), answer
    return answer


def pause(seconds: float) -> Plan[None]:
    if seconds > 0:
        yield Sleep(seconds)


def send(request: Request, policy: RetryPolicy, deadline: Deadline | None = None) -> Plan[Response]:
    """The request, tried again as ``policy`` allows (``reach_client.retries``); a 2xx
    answer, else the typed error of the last answer (a 3xx, never followed, is a
    ``RedirectError``). A retry sends the very same request: the same idempotency key.
    Within ``deadline`` each try and each pause ends by it, and ``DeadlinePassed`` is raised
    once it has passed."""
    retry = 0
    replayable = may_retry(request.method, request.idempotency_key is not None)
    went_out = False  # some try reached the server: the request may have been applied
    while True:
        try:
            answer = yield from call(request if deadline is None else deadline.bound(request))
        except APIConnectionError as exc:
            went_out = exc.sent = went_out or exc.sent  # not the last try's alone
            timed_out = isinstance(exc, APITimeoutError)
            if timed_out and deadline is not None and deadline.passed:
                raise DeadlinePassed from exc
            if (timed_out and not request.retry_timeouts) or not _retry_after_lost(
                exc, replayable, retry, policy
            ):
                raise
            retry += 1
            yield from pause(_cut(policy.backoff_s(retry), deadline))
            continue
        if answer.status < 300:
            return answer
        if answer.status < 400:
            raise failure_of(answer)
        error = problem_of(answer)
        if answer.status in GATEWAY_STATUSES and not request.retry_timeouts:
            raise error
        if (
            (replayable or answer.status in NOT_APPLIED_STATUSES)
            and is_retried(answer.status, error.code)
            and retry < policy.max_retries
        ):
            delay = policy.delay_s(retry + 1, answer.headers.get("retry-after"))
            if delay is not None:
                retry += 1
                yield from pause(_cut(delay, deadline))
                continue
        raise error


def _retry_after_lost(
    error: APIConnectionError, replayable: bool, retry: int, policy: RetryPolicy
) -> bool:
    """Whether a request that got no answer is sent again: only one that never went out
    unless it is safe to repeat, and never one whose answer was too large."""
    return (replayable or not error.sent) and error.code != TOO_LARGE and retry < policy.max_retries


def _cut(seconds: float, deadline: Deadline | None) -> float:
    return seconds if deadline is None else deadline.cut(seconds)


# What reading an answer that is not JSON, or not the shape the API gives, raises.
UNREADABLE = (ValueError, LookupError, TypeError, AttributeError)


def advance(plan: Plan[T], answer: Response) -> Step:
    """The plan's next step once ``answer`` is sent in. What the plan raises reading it (a
    body that is not JSON, or not the shape the API gives) is ``UnexpectedAnswerError``."""
    try:
        return plan.send(answer)
    except UNREADABLE as exc:
        raise _unreadable(exc, answer) from exc


def read(answer: Response, parse: Callable[[Any], T]) -> T:
    """``parse`` of the answer's JSON, or ``UnexpectedAnswerError``, as ``advance`` has it,
    but raised in the plan, which may add to it (a submit's idempotency key)."""
    try:
        return parse(answer.json())
    except UNREADABLE as exc:
        raise _unreadable(exc, answer) from exc


def _unreadable(exc: Exception, answer: Response) -> UnexpectedAnswerError:
    return UnexpectedAnswerError(
        f"an answer the client cannot read: {type(exc).__name__}: {exc}", status=answer.status
    )


def failure_of(answer: Response) -> RedirectError | APIStatusError:
    """Why an answer that is no 2xx is no success: a redirect (never followed), or its
    problem."""
    if 300 <= answer.status < 400:
        return RedirectError(answer.status, answer.headers.get("location"))
    return problem_of(answer)


EXCERPT_CHARS = 200  # of an answer that is not the API's, in its error's detail


def problem_of(answer: Response) -> APIStatusError:
    try:
        body = answer.json()
    except ValueError:
        body = None
    seconds = parse_retry_after(answer.headers.get("retry-after"))
    trace_id = answer.headers.get("x-trace-id")
    if isinstance(body, Mapping) and isinstance(body.get("code"), str):
        return from_problem(answer.status, body, trace_id=trace_id, retry_after_s=seconds)
    # Not a problem of the API's: a proxy's or a load balancer's page, or a wrong URL. Its
    # status still says what to do (a 502 or 503 is tried again), but a 404 here is no task
    # or session gone: the URL names no API.
    kind = answer.headers.get("content-type") or "no content type"
    text = " ".join(answer.content[: EXCERPT_CHARS * 4].decode("utf-8", "replace").split())
    said = f": {text[:EXCERPT_CHARS]}" if text else ""
    detail = f"HTTP {answer.status} with no problem of the API's ({kind}){said}"
    code = f"http_{answer.status}"
    kind_of = InvalidRequestError if answer.status == 404 else error_class(answer.status, code)
    error = kind_of(detail, code=code, status=answer.status, trace_id=trace_id, problem={})
    error.retry_after_s = seconds
    return error


def path(*segments: str) -> str:
    """``/a/b`` with each caller-given segment escaped, so an id never changes the route; an
    empty one is a ``ValueError`` (``/tasks/`` is another route: the list's, redirected)."""
    if not all(segments):
        raise ValueError("an id in a request's path is empty")
    return "/" + "/".join(quote(s, safe="") for s in segments)


def query(**params: str | int | None) -> dict[str, str | int]:
    return {k: v for k, v in params.items() if v is not None}
