"""The API's ASGI middleware: a trace id on every request, and the cap on requests waiting for
an answer (in all and per tenant)."""

from __future__ import annotations

import json
import time

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import errors
from api.callers import TenantOfKey
from broker.errors import Unavailable
from broker.observability import logs, metrics, otel
from broker.observability.tracing import trace_id_from, traceparent, traceparent_trace_id

# The methods a request's counts are labelled with; any other (WebDAV's, or any token under
# h11) counts as OTHER: each label value is a series kept for the process's life.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class TraceMiddleware:
    """Gives every request a trace id (``request.state.trace_id``, and every log line of the
    request) and every response ``X-Trace-Id`` (and ``nosniff``, and a policy that lets a
    response other than a page do nothing); counts requests and their latency by route; answers
    a request that raised with a 500 problem. Pure ASGI, so streaming responses pass through
    untouched."""

    def __init__(self, app: ASGIApp, otel: bool = False) -> None:
        self.app = app
        self.otel = otel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        trace_id = trace_id_from(*_trace_headers(scope))
        if self.otel:
            # The instrumentation's trace: it continued a valid traceparent (the shim below
            # gave one for a valid X-Trace-Id), else began one; either way the spans' trace.
            trace_id = otel.current_trace_id() or trace_id
        scope.setdefault("state", {})["trace_id"] = trace_id
        logs.bind(trace_id=trace_id)
        started = time.perf_counter()
        responded = False

        async def send_with_trace(message: Message) -> None:
            nonlocal responded
            if message["type"] == "http.response.start":
                responded = True
                headers = MutableHeaders(scope=message)
                headers["X-Trace-Id"] = trace_id
                _harden(headers)
                route = getattr(scope.get("route"), "path", "unmatched")
                method = scope["method"] if scope["method"] in METHODS else "OTHER"
                status = str(message["status"])
                metrics.labelled(metrics.http_requests, method, route, status).inc()
                elapsed = time.perf_counter() - started
                metrics.labelled(metrics.http_duration, method, route).observe(elapsed)
            await send(message)

        try:
            await self.app(scope, receive, send_with_trace)
        except Exception as exc:
            # Answered here, not by Starlette's outermost middleware: the 500 then carries
            # the trace id and the headers, and is counted, as every other response is. It
            # is logged with its traceback there and not raised again: raised past a
            # response already sent, the server closes the connection, and a client's next
            # request on it (a keep-alive pool's) failed. A response that broke off midway
            # is raised, so that its connection is closed.
            if responded:
                raise
            response = await errors.internal(Request(scope), exc)
            await response(scope, receive, send_with_trace)


# What a browser may do with a response that is not a page: nothing. Pages (the console, the
# API's docs) bring their own policy; one without (the docs, whose scripts come from a CDN)
# may at least not be framed by another site.
DATA_CSP = "default-src 'none'; frame-ancestors 'none'"
PAGE_CSP = "frame-ancestors 'none'"


def _harden(headers: MutableHeaders) -> None:
    """No response is read as another type than it says (a JSON body that a tenant's payload
    shaped, rendered as a page), none but a page may run anything, and none is framed."""
    headers.setdefault("X-Content-Type-Options", "nosniff")
    if not headers.get("content-type", "").startswith("text/html"):
        headers.setdefault("Content-Security-Policy", DATA_CSP)
    else:
        headers.setdefault("Content-Security-Policy", PAGE_CSP)


class TraceparentFromTraceId:  # used with OpenTelemetry only
    """Gives a request that carries only ``X-Trace-Id`` the matching ``traceparent``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            sent, given = _trace_headers(scope)
            if given is not None and traceparent_trace_id(sent) is None:
                # No valid traceparent (none, junk, or several): the X-Trace-Id's, in its place
                trace_id = trace_id_from(None, given)
                kept = [(k, v) for k, v in scope["headers"] if k.lower() != b"traceparent"]
                header = traceparent(trace_id).encode()
                scope = {**scope, "headers": [*kept, (b"traceparent", header)]}
        await self.app(scope, receive, send)


def _trace_headers(scope: Scope) -> tuple[str | None, str | None]:
    """The request's ``traceparent`` and ``X-Trace-Id``, None when absent. Several
    ``traceparent`` headers are none valid (W3C): their last one was taken, OpenTelemetry
    took the first."""
    parents: list[str] = []
    given: str | None = None
    for key, value in scope["headers"]:
        name = key.lower()
        if name == b"traceparent":
            parents.append(value.decode("latin-1"))
        elif name == b"x-trace-id":
            given = value.decode("latin-1")
    return (parents[0] if len(parents) == 1 else None), given


# Where a request's ``Place`` is in its scope's state (``request.state.waiting_place``).
PLACE = "waiting_place"
REFUSAL = "too many requests in progress; retry shortly"


class WaitingLimit:
    """At most ``limit`` requests waiting for their answer, and at most ``per_tenant`` of them
    from one tenant; one more gets 503 ``overloaded`` at once, before it touches Postgres,
    instead of queueing for a connection until it times out. One tenant's slow bodies or long
    sync waits therefore fill only its own share. A stream counts only until its response
    starts. Health and metrics are never refused.

    The tenant is known before authentication from the key id in ``Authorization`` (``tenants``
    maps the ids of keys already verified); a key not yet verified counts under its own id, a
    request without a key under one shared name, and both are answered as soon as
    authentication fails. Once it succeeds, the request counts under its tenant
    (``Place.move_to``): keys this process had not seen yet hold no share of their own."""

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
        if self.waiting >= self.limit or self.full(tenant):
            metrics.rejections.labels("overloaded").inc()
            await _refuse(scope, send)
            return
        place = Place(self, tenant)
        scope.setdefault("state", {})[PLACE] = place

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                place.leave()
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            place.leave()

    def full(self, tenant: str) -> bool:
        return self.by_tenant.get(tenant, 0) >= self.per_tenant

    def count(self, name: str, change: int) -> None:
        left = self.by_tenant.get(name, 0) + change
        if left:
            self.by_tenant[name] = left
        else:
            del self.by_tenant[name]  # bounded by the requests in flight, not by names


class Place:
    """One request's place among those ``WaitingLimit`` counts: under ``name`` from its start
    until ``leave`` (its response starts, or it ends without one). Every change happens
    without an await between check and count, so no other request sees a count half made."""

    def __init__(self, limit: WaitingLimit, name: str) -> None:
        self._limit = limit
        self.name: str | None = name
        limit.waiting += 1
        limit.count(name, 1)

    def move_to(self, tenant: str) -> None:
        """Counts the request under ``tenant``, whose key was just verified: until then a key
        this process had not seen counted under its own id, a share of its own. Raises
        ``Unavailable`` (503 ``overloaded``) when the tenant already holds its share; the
        request then stays where it was until its refusal is sent."""
        if self.name is None or self.name == tenant:
            return  # answered already (a stream that started), or counted there from the start
        if self._limit.full(tenant):
            metrics.rejections.labels("overloaded").inc()
            raise Unavailable(REFUSAL, code="overloaded", retry_after_s=1)
        self._limit.count(tenant, 1)
        self._limit.count(self.name, -1)
        self.name = tenant

    def leave(self) -> None:
        if self.name is None:
            return
        self._limit.waiting -= 1
        self._limit.count(self.name, -1)
        self.name = None


async def _refuse(scope: Scope, send: Send) -> None:
    trace_id = scope.get("state", {}).get("trace_id")
    body = json.dumps(
        {
            "type": "urn:reach:problem:overloaded",
            "title": "Service Unavailable",
            "status": 503,
            "detail": REFUSAL,
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
