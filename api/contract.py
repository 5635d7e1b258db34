"""The OpenAPI document at ``/openapi.json``, made exact.

Each route declares the statuses it can answer with ``answers(...)``; this module knows how
each is written (problem+json, the headers its status carries) and finishes the document
FastAPI builds: schemas nested under ``$defs`` become components (a client generator cannot
follow ``#/$defs/...`` inside a path), FastAPI's own 422 (a shape we never send: every
refusal is problem+json) gives way to ours, the bearer key is the security scheme, and every
``{name}`` of a path is a declared path parameter (a2a-sdk's REST routes, plain Starlette
routes, declare none: a client generator skips an operation whose template has no parameter).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.utils import generate_unique_id
from pydantic import BaseModel

from api.schemas import Problem, StreamEvent
from broker.tasks.events import STREAM_EVENT_TYPES

DESCRIPTION = """Every refusal is RFC 9457 problem+json with a stable `code` and the `trace_id`;
every response carries `X-Trace-Id`. A JSON body is UTF-8 JSON with no NUL (`\\u0000`) in any
string or key, finite numbers (integers of at most 4300 digits) and nesting at most 32 deep;
a body that breaks one of these is 400 (`invalid_string`, `number_out_of_range`,
`json_too_deep`). Authenticate with `Authorization: Bearer <API key>`."""
PROBLEM_JSON = "application/problem+json"
PROBLEM_REF = {"$ref": "#/components/schemas/Problem"}
BEARER = "bearer"
PATH_TEMPLATE = re.compile(r"\{([^{}]+)\}")
# Headers a route reads as optional, to answer their absence itself (428 for If-Match).
REQUIRED_HEADERS = frozenset({"if-match"})

_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before trying again",
        "required": True,
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}
_WWW_AUTHENTICATE = {
    "WWW-Authenticate": {
        "description": "The scheme to authenticate with",
        "required": True,
        "schema": {"type": "string", "const": "Bearer"},
    }
}
_DESCRIPTIONS = {
    400: "Malformed request: invalid_json, json_too_deep, number_out_of_range, invalid_string,"
    " body_incomplete, invalid_cursor, invalid_last_event_id, too_many_values (A2A), invalid_http",
    401: "Missing or invalid API key (unauthenticated)",
    403: "Not for this key: a capability outside its patterns (capability_not_allowed),"
    " a tenant-wide setting (tenant_admin_required), an operator action (admin_required)",
    404: "No such resource for this tenant, or none this key's patterns let it see",
    408: "The body did not arrive in time (body_timeout)",
    409: "The resource's state refuses the action",
    410: "The version is revoked (version_revoked)",
    412: "If-Match names a revision that is not the current one (revision_conflict)",
    413: "Body or payload too large",
    415: "The body is not JSON (unsupported_media_type)",
    422: "Envelope, body or parameters invalid",
    428: "The write needs If-Match (precondition_required)",
    429: "Over the tenant's rate (tasks, or requests of any kind) or the address's key"
    " lookups (rate_limited), or the tenant holds its most streams open (too_many_streams)"
    " or its share of a queue (too_many_queued), or its tasks and sessions, or its event"
    " logs, hold its quota of bytes (quota_exceeded), or the task's session holds its most"
    " unfinished turns (session_turns_exceeded); retry after Retry-After",
    503: "Overloaded or a backing service unavailable; retry after Retry-After",
}
_HEADERS = {401: _WWW_AUTHENTICATE, 429: _RETRY_AFTER, 503: _RETRY_AFTER}

# What any route behind a key can answer besides its own refusals: no or a bad key, the
# key-lookup budget of the address, the waiting limit or a backing service down.
AUTHENTICATED = (401, 429, 503)
# What reading a JSON body can answer (``api.deps.read_json_body``, ``broker.jsonbody``).
JSON_BODY = (400, 408, 413, 415)


def answers(*statuses: int, **described: str) -> dict[int | str, dict[str, Any]]:
    """The problem+json responses for ``statuses``; ``described`` (``s409="..."``) says more
    about a status than the shared description does."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in sorted(set(statuses)):
        out[status] = {
            "description": described.get(f"s{status}", _DESCRIPTIONS[status]),
            "content": {PROBLEM_JSON: {"schema": PROBLEM_REF}},
        }
        if status in _HEADERS:
            out[status]["headers"] = _HEADERS[status]
    return out


def header(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"description": description, "required": True, "schema": schema or {"type": "string"}}


def json_body(schema: dict[str, Any], media_type: str = "application/json") -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its JSON body itself."""
    return {"requestBody": {"required": True, "content": {media_type: {"schema": schema}}}}


# The models of the bodies routes read themselves, by name: ``finish`` puts their schemas in
# the components, where a client generator names its classes after them.
_BODIES: dict[str, type[BaseModel]] = {}


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A reference to the model's schema, which ``finish`` adds to the components."""
    _BODIES[model.__name__] = model
    return {"$ref": f"#/components/schemas/{model.__name__}"}


# Each event of a stream, as OpenAPI 3.1 tooling reads a text/event-stream schema (3.2's
# itemSchema): the frame's fields, its data line a StreamEvent as JSON.
EVENT_STREAM = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "description": "One server-sent event. `: ping` comments keep an idle stream open;"
            " the stream ends after the final event (succeeded, failed, cancelled or expired)."
            " Reconnect with Last-Event-ID: <id> to get every event after it, none twice.",
            "required": ["id", "event", "data"],
            "properties": {
                "id": {"type": "string", "pattern": "^[0-9]+$", "description": "The seq"},
                "event": {"type": "string", "enum": list(STREAM_EVENT_TYPES)},
                "data": {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": {"$ref": "#/components/schemas/StreamEvent"},
                },
            },
        }
    }
}


def operation_id(route: APIRoute) -> str:
    """Our operations by their function's name (``submit_task``: a generated client's
    method); the A2A routes keep FastAPI's (their handlers' names repeat)."""
    if route.path_format.startswith(("/a2a/", "/.well-known/")):
        return generate_unique_id(route)
    return route.name


def install(app: FastAPI) -> None:
    """Serve the finished document at ``/openapi.json``. Call it last: it finishes what the
    app's ``openapi`` builds, wrapped as it is by then (the A2A routes add their schemas)."""
    build = app.openapi
    finished: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        if not finished:
            finished.append(finish(build()))
        return finished[0]

    app.openapi = openapi  # type: ignore[method-assign]


def finish(doc: dict[str, Any]) -> dict[str, Any]:
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    models: list[type[BaseModel]] = [Problem, StreamEvent, *_BODIES.values()]
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    _hoist_defs(doc, schemas)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    components["securitySchemes"] = {
        BEARER: {"type": "http", "scheme": "bearer", "description": "An API key"}
    }
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            _describe_a2a(path, operation)
            _finish_operation(operation)
            _declare_path_parameters(path, operation)
    return doc


A2A_SPEC = "https://a2a-protocol.org/latest/specification/"


def _describe_a2a(path: str, operation: dict[str, Any]) -> None:
    """The a2a-sdk's routes as they answer: their bodies are A2A's (the spec has them), the
    REST binding's in ``application/a2a+json``, its streams and JSON-RPC's streamed methods in
    ``text/event-stream``, and every route but the public card wants a key. FastAPI had
    ``application/json`` for them all, with no key and no errors."""
    if not path.startswith(("/a2a/", "/.well-known/")):
        return
    operation["tags"] = ["a2a"]
    operation.setdefault("description", f"A2A 1.0, as its specification has it: {A2A_SPEC}")
    if path.startswith("/.well-known/"):
        return  # the public card: JSON, no key
    any_body = {"schema": {"type": "object"}}
    if path == "/a2a/jsonrpc":
        ok = {"application/json": any_body, "text/event-stream": {"schema": {"type": "string"}}}
    elif path.endswith((":stream", ":subscribe")):
        ok = {"text/event-stream": {"schema": {"type": "string"}}}
    else:
        ok = {"application/a2a+json": any_body}
    responses = operation.setdefault("responses", {})
    responses["200"] = {"description": "The A2A answer", "content": ok}
    responses.update({str(k): v for k, v in answers(401, 413, 415, 429).items()})
    if path != "/a2a/jsonrpc":  # JSON-RPC answers its errors in a 200
        responses["4XX"] = {"description": "An A2A error (the binding's error body)"}
    operation["security"] = [{BEARER: []}]


def _finish_operation(operation: dict[str, Any]) -> None:
    responses = operation.get("responses", {})
    default_422 = responses.get("422", {}).get("content", {}).get("application/json", {})
    if default_422.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
        del responses["422"]  # FastAPI's own, for a route whose parameters cannot fail
    for parameter in operation.get("parameters", []):
        parameter["schema"] = _without_null(parameter["schema"])
        if parameter["in"] == "header" and parameter["name"].lower() in REQUIRED_HEADERS:
            parameter["required"] = True
    if "401" in responses and "security" not in operation:
        operation["security"] = [{BEARER: []}]


def _declare_path_parameters(path: str, operation: dict[str, Any]) -> None:
    """A string path parameter for each ``{name}`` of ``path`` the operation does not
    declare (a2a-sdk's ``/a2a/rest/tasks/{id}``)."""
    declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
    for name in dict.fromkeys(PATH_TEMPLATE.findall(path)):
        if name not in declared:
            schema = {"type": "string", "minLength": 1}
            parameter = {"name": name, "in": "path", "required": True, "schema": schema}
            operation.setdefault("parameters", []).append(parameter)


def _without_null(schema: dict[str, Any]) -> dict[str, Any]:
    """``X`` for a parameter's ``anyOf: [X, null]``: absent is how a parameter is null."""
    options = schema.get("anyOf")
    if not options or len(options) != 2 or {"type": "null"} not in options:
        return schema
    (kept,) = [o for o in options if o != {"type": "null"}]
    return {**{k: v for k, v in schema.items() if k != "anyOf"}, **kept}


def _hoist_defs(node: Any, schemas: dict[str, Any]) -> None:
    """Move every ``$defs`` into the components and point its references there."""
    if isinstance(node, dict):
        defs = node.pop("$defs", None)
        if defs:
            for name, schema in defs.items():
                _hoist_defs(schema, schemas)
                schemas.setdefault(name, schema)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            node["$ref"] = "#/components/schemas/" + ref.removeprefix("#/$defs/")
        for value in node.values():
            _hoist_defs(value, schemas)
    elif isinstance(node, list):
        for value in node:
            _hoist_defs(value, schemas)
