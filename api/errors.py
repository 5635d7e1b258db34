"""RFC 9457 problem+json for every error, with a stable ``code`` and the ``trace_id``.

The HTTP status of each code is this one table; codes not listed fall back to their class.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from broker import errors, outages

log = logging.getLogger("reach.api")
# What a bug answers on the JSON-RPC facades (A2A, MCP), naming nothing of it.
BUG_MESSAGE = "internal error: the server failed to answer this request"

STATUS_BY_CODE: dict[str, int] = {
    "invalid_json": 400,
    "json_too_deep": 400,
    "too_many_values": 400,
    "invalid_http": 400,
    "number_out_of_range": 400,
    "invalid_string": 400,
    "invalid_cursor": 400,
    "invalid_last_event_id": 400,
    "body_incomplete": 400,
    "unauthenticated": 401,
    "admin_required": 403,
    "capability_not_allowed": 403,
    "tenant_admin_required": 403,
    "task_not_found": 404,
    "agent_not_found": 404,
    "instance_not_found": 404,
    "webhook_not_found": 404,
    "session_not_found": 404,
    "delivery_not_found": 404,
    "version_not_found": 404,
    "channel_not_found": 404,
    "capability_not_found": 404,
    "route_not_found": 404,
    "method_not_allowed": 405,
    "version_revoked": 410,
    "conflict_retry": 409,
    "task_final": 409,
    "webhook_disabled": 409,
    "delivery_not_redeliverable": 409,
    "delivery_expired": 409,
    "session_limit_reached": 409,
    "body_timeout": 408,
    "rate_limited": 429,
    "too_many_streams": 429,
    "too_many_queued": 429,
    "quota_exceeded": 429,
    "session_turns_exceeded": 429,
    "revision_conflict": 412,
    "precondition_required": 428,
    "body_too_large": 413,
    "session_too_large": 413,
    "payload_too_large": 413,
    "metadata_too_large": 413,
    "unsupported_media_type": 415,
    "envelope_invalid": 422,
    "payload_invalid": 422,
    "idempotency_key_reused": 422,
    "url_not_allowed": 422,
    "webhook_invalid": 422,
    "session_invalid": 422,
    "target_invalid": 422,
    "channel_invalid": 422,
    "webhook_limit_reached": 422,
    "callback_secret_missing": 422,
    "invalid_parameter": 422,
    "invalid_data": 422,
    "registration_invalid": 422,
    "endpoint_not_allowed": 422,
    "internal_error": 500,
    "queue_unavailable": 503,
    "no_agent_available": 503,
    "overloaded": 503,
    "service_unavailable": 503,
}

STATUS_BY_CLASS: list[tuple[type[errors.ReachError], int]] = [
    (errors.BodyTooLarge, 413),
    (errors.InvalidEnvelope, 422),
    (errors.BadRequest, 400),
    (errors.Unauthenticated, 401),
    (errors.Forbidden, 403),
    (errors.NotFound, 404),
    (errors.Gone, 410),
    (errors.Conflict, 409),
    (errors.Unavailable, 503),
]

PROBLEM_JSON = "application/problem+json"


def status_for(exc: errors.ReachError) -> int:
    if isinstance(exc, errors.InvalidEnvelope):
        # An envelope that names what is not there cannot be processed: 422, where the
        # resource's own route says 404 with the same code (session_not_found).
        return 422
    if exc.code in STATUS_BY_CODE:
        return STATUS_BY_CODE[exc.code]
    return next((s for cls, s in STATUS_BY_CLASS if isinstance(exc, cls)), 500)


def problem(
    request: Request,
    status: int,
    code: str,
    detail: str,
    *,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    body = {
        "type": f"urn:reach:problem:{code}",
        "title": HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        "code": code,
        "trace_id": getattr(request.state, "trace_id", None),
        "instance": request.url.path,
        **extra,
    }
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_JSON)


async def _reach_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, errors.ReachError)
    return problem_response(request, exc)


def problem_response(request: Request, exc: errors.ReachError) -> JSONResponse:
    """The problem+json answer to a refusal, with the headers its status calls for."""
    status = status_for(exc)
    details = dict(exc.details)
    headers = {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if status in (429, 503):
        # Whole seconds, as RFC 9110 has it: a wait under a second reads as 1.
        headers["Retry-After"] = str(max(1, math.ceil(details.pop("retry_after_s", 1))))
    return problem(request, status, exc.code, exc.message, headers=headers, **details)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    code = {404: "route_not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = allowed_methods(request)
    return problem(request, exc.status_code, code, str(exc.detail), headers=headers)


METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")


def allowed_methods(request: Request) -> str:
    """Every method of the path, not only those of the route that answered: a path served by
    two routes (``GET /tasks`` and ``POST /tasks``) allows both. Asked of the routes
    themselves (a router included in the app matches for its own routes)."""
    routes = request.app.router.routes
    allowed = [
        method
        for method in METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes
        )
    ]
    return ", ".join(allowed)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [
        {"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"]} for e in exc.errors()
    ]
    return problem(
        request, 422, "invalid_parameter", "request parameters are invalid", errors=problems
    )


async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
    log.warning("503 on %s: %s: %s", request.url.path, type(exc).__name__, exc)
    return problem(
        request,
        503,
        "service_unavailable",
        "a backing service cannot be reached",
        headers={"Retry-After": "1"},
    )


async def _data_error(request: Request, exc: Exception) -> JSONResponse:
    return problem(request, 422, "invalid_data", "the database refused a value in the request")


async def internal(request: Request, exc: Exception) -> JSONResponse:
    """500 ``internal_error``, logged with its traceback; the body names no detail of it."""
    log.error("500 on %s", request.url.path, exc_info=exc)
    return problem(request, 500, "internal_error", "an unexpected error; see the server log")


def install(app: FastAPI) -> None:
    app.add_exception_handler(errors.ReachError, _reach_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    for cls in outages.UNAVAILABLE_ERRORS:
        app.add_exception_handler(cls, _unavailable)
    for refused in outages.REFUSED_VALUE_ERRORS:
        app.add_exception_handler(refused, _data_error)
    # Answered by ``TraceMiddleware`` first; here, for what escapes the middleware itself.
    app.add_exception_handler(Exception, internal)
