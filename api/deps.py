"""Per-request plumbing: the trace id, the caller's key, and the body read within its limit."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker import logs, metrics, otel, queries
from broker.errors import BadRequest, BodyTooLarge, Unauthenticated
from broker.keys import Principal, secret_matches, split_token
from broker.tracing import trace_id_from


class TraceMiddleware:
    """Gives every request a trace id (``request.state.trace_id``, and every log line of the
    request) and every response ``X-Trace-Id``; counts requests and their latency by route.
    Pure ASGI, so streaming responses pass through untouched."""

    def __init__(self, app: ASGIApp, otel: bool = False) -> None:
        self.app = app
        self.otel = otel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        trace_id = trace_id_from(headers.get("traceparent"), headers.get("x-trace-id"))
        if self.otel and not (headers.get("traceparent") or headers.get("x-trace-id")):
            trace_id = otel.current_trace_id() or trace_id  # the instrumentation's trace
        scope.setdefault("state", {})["trace_id"] = trace_id
        logs.bind(trace_id=trace_id)
        started = time.perf_counter()

        async def send_with_trace(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Trace-Id"] = trace_id
                route = getattr(scope.get("route"), "path", "unmatched")
                method = scope["method"]
                metrics.http_requests.labels(method, route, str(message["status"])).inc()
                metrics.http_duration.labels(method, route).observe(time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, send_with_trace)


class TraceparentFromTraceId:  # used with OpenTelemetry only
    """Gives a request that carries only ``X-Trace-Id`` the matching ``traceparent``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = {k.lower() for k, _ in scope["headers"]}
            if b"traceparent" not in names and b"x-trace-id" in names:
                given = dict(scope["headers"])[b"x-trace-id"].decode("latin-1")
                trace_id = trace_id_from(None, given)
                header = f"00-{trace_id}-{secrets.token_hex(8)}-01".encode()
                scope = {**scope, "headers": [*scope["headers"], (b"traceparent", header)]}
        await self.app(scope, receive, send)


class WaitingLimit:
    """At most ``limit`` requests waiting for their answer; one more gets 503 ``overloaded`` at
    once, before it touches Postgres, instead of queueing for a connection until it times out.
    A stream counts only until its response starts. Health and metrics are never refused."""

    EXEMPT = ("/healthz", "/readyz", "/metrics")

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.waiting = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.EXEMPT:
            await self.app(scope, receive, send)
            return
        if self.waiting >= self.limit:
            metrics.rejections.labels("overloaded").inc()
            await _refuse(scope, send)
            return
        self.waiting += 1
        answered = False

        async def send_counted(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.start" and not answered:
                answered = True
                self.waiting -= 1
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if not answered:
                self.waiting -= 1


async def _refuse(scope: Scope, send: Send) -> None:
    trace_id = scope.get("state", {}).get("trace_id")
    body = json.dumps(
        {
            "type": "urn:reach:problem:overloaded",
            "title": "Service Unavailable",
            "status": 503,
            "detail": "too many requests in progress; retry shortly",
            "code": "overloaded",
            "trace_id": trace_id,
            "instance": scope["path"],
        }
    ).encode()
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"retry-after", b"1"),
        (b"content-length", str(len(body)).encode()),
    ]
    if trace_id:
        headers.append((b"x-trace-id", trace_id.encode()))
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass
class KeyCache:
    """Keys found in Postgres, kept for ``ttl_s`` so a busy caller costs no query per request.
    Revocation therefore takes effect within ``ttl_s``."""

    ttl_s: float
    _entries: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)

    async def get(self, engine: AsyncEngine, key_id: str) -> dict[str, Any] | None:
        now = time.monotonic()
        hit = self._entries.get(key_id)
        if hit is not None and hit[0] > now:
            return hit[1]
        row = await queries.get_key(engine, key_id)
        if row is not None and self.ttl_s > 0:
            if len(self._entries) > 10_000:  # bound memory against many distinct keys
                self._entries.clear()
            self._entries[key_id] = (now + self.ttl_s, row)
        return row


async def authenticate(request: Request) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("an API key is required: Authorization: Bearer <key>")
    parts = split_token(token.strip())
    if parts is None:
        raise Unauthenticated("the API key is not valid")
    key_id, secret = parts
    state = request.app.state
    row = await state.key_cache.get(state.engine, key_id)
    if row is None or not secret_matches(secret, row["secret_hash"]):
        raise Unauthenticated("the API key is not valid")
    return Principal(
        key_id=key_id,
        tenant=row["tenant"],
        capabilities=tuple(row["capabilities"]),
        is_admin=row["is_admin"],
    )


async def read_json_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it passes ``limit`` (before it is all in memory)."""
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
    if not (content_type == "application/json" or content_type.endswith("+json")):
        raise BadRequest("send the envelope as application/json", code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the body is larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(f"the body is larger than {limit} bytes")
    return bytes(body)
