"""Every operation is written once, as a plan: a generator that yields the HTTP requests and
the pauses it needs and returns its result. ``Reach`` runs plans with blocking I/O,
``AsyncReach`` with ``await``; neither knows what an operation does, and no operation knows
which of them runs it.

A driver sends each yielded ``Request`` and sends the ``Response`` back in, or throws the
``APIConnectionError`` it met; it sleeps for each ``Sleep``.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from reach_client.errors import APIConnectionError, APIStatusError, APITimeoutError, from_problem
from reach_client.limits import TOO_LARGE
from reach_client.retries import RetryPolicy, is_retried, may_retry, parse_retry_after

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


def send(request: Request, policy: RetryPolicy) -> Plan[Response]:
    """The request, tried again as ``policy`` allows; a 2xx or 3xx answer, else the typed
    error of the last answer. A retry sends the very same request: the same idempotency key."""
    retry = 0
    retriable = may_retry(request.method, request.idempotency_key is not None)
    while True:
        try:
            answer = yield from call(request)
        except APIConnectionError as exc:
            timed_out = isinstance(exc, APITimeoutError)
            if (
                not retriable
                or exc.code == TOO_LARGE
                or retry >= policy.max_retries
                or (timed_out and not request.retry_timeouts)
            ):
                raise
            retry += 1
            yield from pause(policy.backoff_s(retry))
            continue
        if answer.status < 400:
            return answer
        error = problem_of(answer)
        if retriable and is_retried(answer.status, error.code) and retry < policy.max_retries:
            delay = policy.delay_s(retry + 1, answer.headers.get("retry-after"))
            if delay is not None:
                retry += 1
                yield from pause(delay)
                continue
        raise error


def problem_of(answer: Response) -> APIStatusError:
    try:
        body = answer.json()
    except ValueError:
        body = None
    seconds = parse_retry_after(answer.headers.get("retry-after"))
    return from_problem(
        answer.status, body, trace_id=answer.headers.get("x-trace-id"), retry_after_s=seconds
    )


def path(*segments: str) -> str:
    """``/a/b`` with each caller-given segment escaped, so an id never changes the route."""
    return "/" + "/".join(quote(s, safe="") for s in segments)


def query(**params: str | int | None) -> dict[str, str | int]:
    return {k: v for k, v in params.items() if v is not None}
