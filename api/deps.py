"""Per-request plumbing: the trace id, the caller's key, and the body read within its limit."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import anyio
from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.datastructures import MutableHeaders
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker import logs, metrics, otel, queries
from broker.backpressure import RateLimited
from broker.errors import BadRequest, BodyTimeout, BodyTooLarge, Unauthenticated
from broker.keys import Principal, secret_matches, split_token
from broker.tracing import trace_id_from, traceparent


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
                header = traceparent(trace_id).encode()
                scope = {**scope, "headers": [*scope["headers"], (b"traceparent", header)]}
        await self.app(scope, receive, send)


class WaitingLimit:
    """At most ``limit`` requests waiting for their answer, and at most ``per_tenant`` of them
    from one tenant; one more gets 503 ``overloaded`` at once, before it touches Postgres,
    instead of queueing for a connection until it times out. One tenant's slow bodies or long
    sync waits therefore fill only its own share. A stream counts only until its response
    starts. Health and metrics are never refused.

    The tenant is known before authentication from the key id in ``Authorization`` (``tenants``
    maps the ids of keys already verified); a key not yet verified counts under its own id, a
    request without a key under one shared name, and both are answered as soon as
    authentication fails."""

    EXEMPT = ("/healthz", "/readyz", "/metrics")

    def __init__(self, app: ASGIApp, limit: int, per_tenant: int, tenants: TenantOfKey) -> None:
        self.app = app
        self.limit = limit
        self.per_tenant = per_tenant
        self.tenants = tenants
        self.waiting = 0
        self.by_tenant: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.EXEMPT:
            await self.app(scope, receive, send)
            return
        tenant = self.tenants.of_request(scope)
        if self.waiting >= self.limit or self.by_tenant.get(tenant, 0) >= self.per_tenant:
            metrics.rejections.labels("overloaded").inc()
            await _refuse(scope, send)
            return
        self.waiting += 1
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
        answered = False

        def release() -> None:
            self.waiting -= 1
            left = self.by_tenant[tenant] - 1
            if left:
                self.by_tenant[tenant] = left
            else:
                del self.by_tenant[tenant]  # bounded by the requests in flight, not by names

        async def send_counted(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.start" and not answered:
                answered = True
                release()
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if not answered:
                release()


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


class TenantOfKey:
    """The tenant of each key id already verified here: fixed for a key's life, so it may be
    kept as long as memory allows (bounded)."""

    MAX = 100_000

    def __init__(self) -> None:
        self._tenants: dict[str, str] = {}

    def remember(self, key_id: str, tenant: str) -> None:
        if len(self._tenants) >= self.MAX:
            self._tenants.clear()
        self._tenants[key_id] = tenant

    def of_request(self, scope: Scope) -> str:
        """The tenant the request's key belongs to when known, else a name for its key."""
        for name, value in scope["headers"]:
            if name == b"authorization":
                _, _, token = value.decode("latin-1").partition(" ")
                parts = split_token(token.strip())
                if parts is None:
                    break
                return self._tenants.get(parts[0]) or f"key:{parts[0]}"
        return "anonymous"


@dataclass
class KeyCache:
    """Keys looked up in Postgres, kept for ``ttl_s`` so a busy caller costs no query per
    request; a key id that is not there is remembered as missing for as long. Revocation
    therefore takes effect within ``ttl_s``.

    Lookups that find no key are bounded per client address (``lookups``): random key ids
    sent in a loop cost at most that many queries a second, then 429 without a query. A valid
    key is refused only while its address is over that budget."""

    ttl_s: float
    lookups: PerClientBudget
    _entries: dict[str, tuple[float, dict[str, Any] | None]] = field(default_factory=dict)

    async def get(self, engine: AsyncEngine, key_id: str, *, client: str) -> dict[str, Any] | None:
        """The key's row (None: no such key or revoked)."""
        now = time.monotonic()
        hit = self._entries.get(key_id)
        if hit is not None and hit[0] > now:
            return hit[1]
        self.lookups.check(client)
        row = await queries.get_key(engine, key_id)
        if row is None:
            self.lookups.spend(client)
        if self.ttl_s > 0:
            if len(self._entries) > 10_000:  # bound memory against many distinct keys
                self._entries.clear()
            self._entries[key_id] = (now + self.ttl_s, row)
        return row


@dataclass
class PerClientBudget:
    """A token bucket per client address, in this process: ``rate_per_s`` with a burst of
    twice that. ``check`` refuses (RateLimited) when the address has none left; ``spend``
    takes one. Bounded memory: the table is cleared when it is full."""

    rate_per_s: float
    MAX_CLIENTS = 10_000
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)

    def check(self, client: str) -> None:
        if self._tokens(client)[0] < 1:
            metrics.rejections.labels("auth_lookups").inc()
            raise RateLimited("too many unknown API keys from this address", retry_after_s=1)

    def spend(self, client: str) -> None:
        tokens, now = self._tokens(client)
        if len(self._buckets) >= self.MAX_CLIENTS and client not in self._buckets:
            self._buckets.clear()
        self._buckets[client] = (tokens - 1, now)

    def _tokens(self, client: str) -> tuple[float, float]:
        burst, now = 2 * self.rate_per_s, time.monotonic()
        tokens, at = self._buckets.get(client, (burst, now))
        return min(burst, tokens + (now - at) * self.rate_per_s), now


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
    client = request.client.host if request.client is not None else "unknown"
    row = await state.key_cache.get(state.engine, key_id, client=client)
    if row is None or not secret_matches(secret, row["secret_hash"]):
        raise Unauthenticated("the API key is not valid")
    state.tenant_of_key.remember(key_id, row["tenant"])
    return Principal(
        key_id=key_id,
        tenant=row["tenant"],
        capabilities=tuple(row["capabilities"]),
        is_admin=row["is_admin"],
        tenant_admin=row["tenant_admin"],
    )


async def metered(
    request: Request, caller: Annotated[Principal, Depends(authenticate)]
) -> Principal:
    """The caller, once it has taken one of its tenant's tokens (429 ``rate_limited`` when
    none is left): for the routes that do real work, before their body is read."""
    await request.app.state.door.take(caller.tenant)
    return caller


async def read_json_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it passes ``limit`` (before it is all in memory) or when
    it has not all arrived within ``body_read_timeout_s`` (408 ``body_timeout``)."""
    timeout_s = request.app.state.settings.body_read_timeout_s
    try:
        with anyio.fail_after(timeout_s):
            return await _read_within(request, limit)
    except TimeoutError:
        raise BodyTimeout(f"the body did not arrive within {timeout_s:g} s") from None


async def _read_within(request: Request, limit: int) -> bytes:
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
    if not (content_type == "application/json" or content_type.endswith("+json")):
        raise BadRequest("send the envelope as application/json", code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the body is larger than {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise BodyTooLarge(f"the body is larger than {limit} bytes")
    except ClientDisconnect:
        raise BadRequest(
            "the connection closed before the body was whole", code="body_incomplete"
        ) from None
    return bytes(body)
