"""``/mcp``: the SDK's streamable HTTP transport (stateless) behind our own route.

The route is an ordinary FastAPI route, so a request meets what every other request meets:
the bearer key is checked by ``authenticate`` (401 problem+json before the SDK sees it), the
trace id and the waiting limit apply, and ``/openapi.json`` documents it. The body is read as
``POST /tasks`` reads one, within the API's size and time limits (413, 408 problem+json), and
only as ``application/json`` (415); the SDK would wait for a body without end. Its answer
hands the request, and the body read, to the SDK's session manager, with the caller on the
request's state for the tool handlers.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from mcp.server import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types.jsonrpc import INVALID_REQUEST
from starlette.types import Message, Receive, Scope, Send

from api.contract import AUTHENTICATED, JSON_BODY, answers, json_body
from api.deps import SMALL_BODY_BYTES, authenticate, media_type, read_json_body
from api.mcp.calls import Calls
from api.services import Services, services
from api.sse import Slot
from api.stopping import Stopping
from broker import jsonbody, jsoncodec
from broker.errors import BadRequest, ReachError
from broker.settings import Settings
from broker.tenancy.keys import Principal

PATH = "/mcp"
# The levels above a tool call's arguments: the JSON-RPC body, its params.
ARGUMENTS_LEVEL = 2
Caller = Annotated[Principal, Depends(authenticate)]
INSTRUCTIONS = (
    "Agent-Reach runs each tool as a task on an agent. A call that has not finished within "
    "its wait answers with the task's id and status: poll it with reach_get_task."
)
JSON_RPC_REQUEST = {
    "type": "object",
    "required": ["jsonrpc", "method"],
    "properties": {
        "jsonrpc": {"const": "2.0"},
        "id": {"type": ["string", "integer"]},
        "method": {"type": "string", "examples": ["tools/list", "tools/call"]},
        "params": {"type": "object"},
    },
}

# What the SDK's transport answers itself, with a JSON-RPC error body (a 400 too).
MCP_REFUSALS = {
    406: "Accept must name both application/json and text/event-stream",
    421: "The Host is not one this server answers for",
}
MCP_400 = (
    "Not a JSON-RPC message, or a bad request for the transport (a JSON-RPC error), or the"
    " body did not arrive whole (body_incomplete)"
)


class McpFacade:
    """The MCP server and its session manager; ``running()`` belongs in the app's lifespan."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc
        calls = Calls(svc)
        server: Server[object] = Server(
            "agent-reach",
            version="0.1.0",
            instructions=INSTRUCTIONS,
            on_list_tools=calls.list_tools,
            on_call_tool=calls.call_tool,
        )
        self.manager = StreamableHTTPSessionManager(
            app=server,
            stateless=True,
            security_settings=_host_check(svc.settings),
            max_request_body_size=svc.settings.max_body_bytes,
        )
        self.router = self._router()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with self.manager.run():
            yield

    def _router(self) -> APIRouter:
        router = APIRouter(tags=["mcp"])

        async def mcp(request: Request, caller: Caller) -> Response:
            """MCP over streamable HTTP, stateless: one JSON-RPC request per POST, answered as
            JSON or as an SSE stream that carries its progress notifications. Tools: one per
            capability the key may run, plus ``reach_get_task`` and ``reach_cancel_task``."""
            request.state.caller = caller
            body, request.state.metered = await _read_body(
                request, caller, self.svc.settings.max_body_bytes
            )
            if _bad_request_id(body):
                return _invalid_request("a request's id must be a string or an integer")
            body = lift_arguments(request, body, self.svc.settings.max_json_depth)
            # A tool call may hold its answer open (SSE) for the whole wait: one of the
            # tenant's stream slots until it ends (``api.sse.StreamSlots``).
            slot = self.svc.streams.take(caller.tenant)
            return _HandedOver(self.manager, slot, body, self.svc.stopping)

        router.add_api_route(
            PATH,
            mcp,
            methods=["POST"],
            responses={
                200: {
                    "description": "The JSON-RPC response, as JSON or as an SSE stream",
                    "content": {"application/json": {"schema": {}}, "text/event-stream": {}},
                },
                202: {"description": "A notification or a response, accepted"},
                **_refusals(),
            },
            openapi_extra=json_body(JSON_RPC_REQUEST),
        )
        # POST only: stateless, there is no stream for GET to open nor a session to DELETE
        # (the SDK would hold a GET open for nothing); both get 405 as the spec allows.
        return router


def _refusals() -> dict[int | str, dict[str, Any]]:
    """Ours (problem+json), and the transport's: ``MCP_REFUSALS`` and a 400 of its own."""
    refusals = answers(*AUTHENTICATED, *JSON_BODY, s400=MCP_400)
    refusals[400]["content"]["application/json"] = {}
    for status, what in MCP_REFUSALS.items():
        refusals[status] = {"description": what, "content": {"application/json": {}}}
    return refusals


async def _read_body(request: Request, caller: Principal, limit: int) -> tuple[bytes, bool]:
    """The body within the API's limits, and whether it took a token of the tenant's rate: a
    body not declared within ``SMALL_BODY_BYTES`` takes one before it is read, as ``POST
    /tasks`` and A2A's do, whatever its method. It was read and parsed twice (ours, then the
    SDK's) with none taken, so a tenant out of tokens held the loop with 1 MiB
    notifications. A small one is read first, as before: the handshake and listings take
    none, and a tool call takes its token when it runs. The transport takes nothing but
    application/json (a bare 400 otherwise, missing included), so neither does this: 415
    problem+json."""
    if media_type(request) != "application/json":
        raise BadRequest(
            "send the JSON-RPC message as application/json", code="unsupported_media_type"
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) <= SMALL_BODY_BYTES:
        return await read_json_body(request, limit), False
    await services(request).door.take(caller.tenant)
    return await read_json_body(request, limit), True


def _bad_request_id(body: bytes) -> bool:
    """A request (it names a method and has an id) whose id is not a string or an integer,
    which is all MCP allows (not null either). The SDK's transport read one as a
    notification, whose extra field it ignores: 202, and nothing ran."""
    try:
        message = jsoncodec.loads(body)
    except ValueError:
        return False  # the transport answers it: -32700
    if not isinstance(message, dict) or "method" not in message or "id" not in message:
        return False
    return type(message["id"]) not in (str, int)


def lift_arguments(request: Request, body: bytes, max_depth: int) -> bytes:
    """A tool call's arguments taken out of ``body`` before the SDK parses it, ``{}`` left in
    their place, for ``Calls.call_tool`` (``request.state.arguments``). The SDK holds its
    parse of a request for as long as the call lasts (a wait of up to ``mcp_wait_s``), and a
    payload of 1 MiB of JSON is some 20 MiB of Python objects; ours are checked as a ``POST
    /tasks`` body is and let go once the task is accepted. A body our parse refuses goes to
    the SDK as it came: the transport's answer, or the tool's refusal (``Calls``)."""
    try:
        # The arguments are the task's payload, held to the depth it has in POST /tasks's
        # body; the rest of the request to the API's limit.
        message = jsonbody.parse(body, max_depth=max_depth + ARGUMENTS_LEVEL)
        if not isinstance(message, dict) or message.get("method") != "tools/call":
            return body
        params = message.get("params")
        if not isinstance(params, dict) or not isinstance(params.get("arguments"), dict):
            return body
        if not params["arguments"]:
            return body
        jsonbody.check_payload_depth(params["arguments"], max_depth=max_depth)
        arguments, params["arguments"] = params["arguments"], {}
        jsonbody.check_depth(message, max_depth=max_depth)
    except ReachError:
        return body
    request.state.arguments = arguments
    return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode()


def _invalid_request(reason: str) -> Response:
    """JSON-RPC's -32600, as the transport answers its own refusals (400, id null)."""
    error = {"code": INVALID_REQUEST, "message": f"Invalid Request: {reason}"}
    content = jsoncodec.dumps({"jsonrpc": "2.0", "id": None, "error": error})
    return Response(content, status_code=400, media_type="application/json")


class _HandedOver(Response):
    """The answer the SDK's transport writes itself, in ``slot`` until it ends. It reads the
    request's body, read already, from ``received``."""

    def __init__(
        self,
        manager: StreamableHTTPSessionManager,
        slot: Slot,
        received: bytes,
        stopping: Stopping,
    ) -> None:
        super().__init__()
        self.manager = manager
        self.slot = slot
        self.received = received
        self.stopping = stopping

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A stopping server's streams end once this answer is out (``api.stopping``)
        with self.slot, self.stopping.answer():
            scope = {**scope, "headers": _json_named_plainly(scope["headers"])}
            await self.manager.handle_request(scope, _replaying(self.received, receive), send)


def _json_named_plainly(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers with the content type, JSON already (``_read_body``), as the SDK's
    transport compares it: ``application/json`` in lower case. It answered a bare 400 to
    ``Application/JSON``, which names the same type."""
    return [
        (name, b"application/json" if name == b"content-type" else value) for name, value in headers
    ]


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` that gives ``body`` first, whole, then what the connection sends next (its
    disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def _host_check(settings: Settings) -> TransportSecuritySettings:
    """Host (and Origin) names checked against ``mcp_allowed_hosts``, when it lists any."""
    hosts = settings.mcp_allowed_hosts
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=bool(hosts),
        allowed_hosts=hosts,
        allowed_origins=[f"{scheme}://{host}" for host in hosts for scheme in ("http", "https")],
    )
