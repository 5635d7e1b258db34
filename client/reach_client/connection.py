"""The boundary with httpx, shared by both clients: the settings of a client, how a plan's
``Request`` becomes an httpx request, and httpx's exceptions translated to ours in one place."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from reach_client.config import resolve
from reach_client.errors import APIConnectionError, APITimeoutError
from reach_client.limits import MAX_ANSWER_BYTES
from reach_client.plans import Request, Response
from reach_client.retries import RetryPolicy
from reach_client.version import VERSION

DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)


@dataclass(frozen=True)
class Settings:
    base_url: str
    api_key: str = field(repr=False)
    timeout: httpx.Timeout
    policy: RetryPolicy
    max_answer_bytes: int = MAX_ANSWER_BYTES

    @classmethod
    def of(
        cls,
        base_url: str | None,
        api_key: str | None,
        profile: str | None,
        timeout: float | httpx.Timeout | None,
        max_retries: int,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        stream_reconnect_s: float = RetryPolicy.stream_reconnect_s,
    ) -> Settings:
        found = resolve(base_url, api_key, profile)
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        elif not isinstance(timeout, httpx.Timeout):
            timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        if max_answer_bytes < 1:
            raise ValueError("max_answer_bytes must be at least 1")
        if not stream_reconnect_s >= 0:  # NaN too: a stream would never give up
            raise ValueError("stream_reconnect_s must be a number of seconds, at least 0")
        policy = RetryPolicy(max_retries=max_retries, stream_reconnect_s=stream_reconnect_s)
        return cls(found.base_url, found.api_key, timeout, policy, max_answer_bytes)

    def headers(self) -> dict[str, str]:
        return {
            "Authorization": f"Bearer {self.api_key}",
            "User-Agent": f"agent-reach-client/{VERSION}",
            "Accept": "application/json",
        }


def build(settings: Settings, request: Request) -> dict[str, Any]:
    """Keyword arguments of ``httpx.Client.build_request`` for ``request``."""
    headers = {**settings.headers(), **request.headers}
    content = request.content()
    if content is not None:
        headers.setdefault("Content-Type", "application/json")
    return {
        "method": request.method,
        "url": settings.base_url + request.path,
        "params": dict(request.params),
        "headers": headers,
        "content": content,
        "timeout": timeout_of(settings.timeout, request),
    }


def timeout_of(base: httpx.Timeout, request: Request) -> httpx.Timeout:
    """The client's timeouts as ``request`` changes them: its own read and write timeout, a
    floor under the read timeout (a stream that only pings), and a cap on every one (the
    time left of a caller's wait)."""
    read, write = base.read, base.write
    if request.timeout_s is not None:
        read = write = request.timeout_s
    if request.read_at_least_s is not None and read is not None:
        read = max(read, request.read_at_least_s)
    most = request.within_s
    return httpx.Timeout(
        connect=_at_most(base.connect, most),
        read=_at_most(read, most),
        write=_at_most(write, most),
        pool=_at_most(base.pool, most),
    )


def _at_most(seconds: float | None, most: float | None) -> float | None:
    """A timeout (None: none) cut to ``most`` (None: no cut)."""
    if most is None:
        return seconds
    return most if seconds is None else min(seconds, most)


def response_of(answer: httpx.Response, content: bytes) -> Response:
    return Response(answer.status_code, answer.headers, content)


@contextmanager
def translated() -> Iterator[None]:
    """httpx's transport errors as ``APITimeoutError`` / ``APIConnectionError``; ``sent``
    False for those that end before a connection carried the request."""
    try:
        yield
    except httpx.PoolTimeout as exc:
        raise APITimeoutError(
            "no free connection in the client's pool in time: every one of its"
            " max_connections is held (streams and waits hold theirs to their end)",
            sent=False,
        ) from exc
    except httpx.TimeoutException as exc:
        sent = not isinstance(exc, httpx.ConnectTimeout)
        raise APITimeoutError(f"no answer in time: {type(exc).__name__} {exc}", sent=sent) from exc
    except httpx.TransportError as exc:
        sent = not isinstance(exc, httpx.ConnectError)
        raise APIConnectionError(f"{type(exc).__name__}: {exc}", sent=sent) from exc
