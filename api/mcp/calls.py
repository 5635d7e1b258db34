"""The MCP server's two handlers: ``tools/list`` and ``tools/call``, on the API's services.

The caller was authenticated before the request reached the SDK (``api.mcp.route``) and
rides on the request's state. A capability's tool submits through the same intake as
``POST /tasks`` (after a token of the tenant's rate, as a submit takes), then waits as a sync
submit does (refused ``unauthenticated`` once the key is revoked meanwhile); its task's
``progress`` events go to the client as progress notifications when the call carries a
progress token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any

from mcp.server.context import ServerRequestContext
from mcp.server.session import ServerSession
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    CallToolRequestParams,
    CallToolResult,
    ListToolsResult,
    PaginatedRequestParams,
    Tool,
)
from starlette.requests import Request

from api import errors, replies
from api.mcp import tools
from api.services import Services
from broker import jsonbody, outages
from broker.errors import BadRequest, ReachError, Unavailable
from broker.registry import cards
from broker.tasks import queries
from broker.tasks.envelope import OPTIONS, parse_envelope
from broker.tasks.events import PROGRESS
from broker.tasks.resource import render
from broker.tasks.submission import Accepted
from broker.tenancy.keys import Principal

Context = ServerRequestContext[Any, Any]
# What an outage and a refused value answer (a bug: ``errors.BUG_MESSAGE``), naming nothing
# of them: the SDK's older protocol path sends an exception's text (a pool's limits, a host
# and port, SQL).
UNAVAILABLE = Unavailable("a backing service cannot be reached")
REFUSED_VALUE = ReachError("the database refused a value in the request", code="invalid_data")
SOURCE = "mcp"  # the tasks' ``source``: where they came from, for the audit
# After the task has ended, how long its progress notifications still sent may take.
PROGRESS_DRAIN_S = 1.0

log = logging.getLogger("reach.api")


class Calls:
    """The handlers the SDK's ``Server`` calls, bound to the app's services."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc

    async def list_tools(
        self, ctx: Context, params: PaginatedRequestParams | None
    ) -> ListToolsResult:
        try:
            return ListToolsResult(tools=await self._tools(ctx))
        except outages.UNAVAILABLE_ERRORS as exc:
            log.warning("MCP tools/list: %s: %s", type(exc).__name__, exc)
            raise MCPError(INTERNAL_ERROR, UNAVAILABLE.message) from None
        except MCPError:
            raise
        except Exception as exc:
            raise _hidden("tools/list", exc) from None

    async def call_tool(self, ctx: Context, params: CallToolRequestParams) -> CallToolResult:
        caller = _caller(ctx)
        lifted = _lifted(ctx)
        arguments = lifted if lifted is not None else params.arguments or {}
        try:
            if params.name == tools.GET_TASK:
                task = await queries.visible_task(self.svc.engine, caller, _task_id(arguments))
                return tools.task_view(render(task))
            if params.name == tools.CANCEL_TASK:
                task = await self.svc.canceller.cancel_visible(caller, _task_id(arguments))
                return tools.task_view(render(task))
            if params.name not in {tool.name for tool in await self._tools(ctx)}:
                raise MCPError(INVALID_PARAMS, f"no tool {params.name!r}")
            return await self._run(ctx, caller, params.name, arguments, ours=lifted is not None)
        except ReachError as exc:
            return tools.refusal(exc)
        except outages.UNAVAILABLE_ERRORS as exc:
            log.warning("MCP tools/call: %s: %s", type(exc).__name__, exc)
            return tools.refusal(UNAVAILABLE)
        except outages.REFUSED_VALUE_ERRORS:
            return tools.refusal(REFUSED_VALUE)
        except MCPError:
            raise
        except Exception as exc:
            raise _hidden("tools/call", exc) from None

    async def _tools(self, ctx: Context) -> list[Tool]:
        known = await cards.latest_cards(self.svc.engine, self.svc.card_cache)
        return [*tools.capability_tools(known, _caller(ctx)), *tools.TASK_TOOLS]

    async def _accept(
        self, ctx: Context, caller: Principal, capability: str, payload: Any, *, ours: bool
    ) -> Accepted:
        """The tool's task accepted, after a token of the tenant's rate (unless a large body
        took it already). Its envelope ends here, before the wait."""
        svc = self.svc
        if not getattr(_request(ctx).state, "metered", False):
            await svc.door.take(caller.tenant)
        if not ours:
            # The arguments meet the checks a POST body meets (NUL, lone surrogates, NaN, huge
            # integers, depth): the SDK's parser let them through, Postgres would refuse them.
            max_depth = svc.settings.max_json_depth
            payload = jsonbody.parse(json.dumps(payload).encode(), max_depth=max_depth)
            jsonbody.check_payload_depth(payload, max_depth=max_depth)
        fields = _envelope_options(ctx, svc.settings.max_json_depth)
        fields.update(capability=capability, payload=payload, source=SOURCE)
        envelope = parse_envelope(fields)
        return await svc.intake.submit(caller, envelope, trace_id=_request(ctx).state.trace_id)

    async def _run(
        self,
        ctx: Context,
        caller: Principal,
        capability: str,
        payload: dict[str, Any],
        *,
        ours: bool,
    ) -> CallToolResult:
        """``ours``: ``payload`` is our own parse, lifted out of the body before the SDK's
        (``api.mcp.route.lift_arguments``): let go of here once the task is accepted, so the
        wait holds nothing of it."""
        svc = self.svc
        accepted = await self._accept(ctx, caller, capability, payload, ours=ours)
        if ours:
            payload.clear()
        task_id = accepted.row["id"]
        forwarding = None
        if ctx.meta and ctx.meta.get("progress_token") is not None:
            forwarding = asyncio.create_task(_forward_progress(svc, caller, task_id, ctx.session))
        try:
            # As accepted when an outage cuts the wait (``replies.waited``): not an error.
            task, final = await replies.waited(svc, caller, accepted.row, svc.settings.mcp_wait_s)
            if final and forwarding is not None:
                await asyncio.wait({forwarding}, timeout=PROGRESS_DRAIN_S)
        finally:
            if forwarding is not None:
                forwarding.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await forwarding
        if final:
            return tools.outcome(task, ctx.protocol_version)
        return tools.still_running(task)


async def _forward_progress(
    svc: Services, caller: Principal, task_id: uuid.UUID, session: ServerSession
) -> None:
    """Each ``progress`` event of the task as an MCP progress notification (percent of 100),
    until its final event, or until the key is revoked (the wait then ends the call)."""
    async for event in replies.task_events(svc, caller, task_id):
        if event is not None and event.type == PROGRESS:
            data = event.data
            await session.report_progress(float(data["percent"]), 100, data.get("message"))


# What a tool call's ``_meta`` may set of its task's envelope: what an A2A message may, and the
# session its turn belongs to and its idempotency key (``POST /tasks``'s ``Idempotency-Key``).
META_OPTIONS = (*OPTIONS, "session_id", "idempotency_key")


def _envelope_options(ctx: Context, max_depth: int) -> dict[str, Any]:
    """The envelope's fields the call's ``_meta`` sets (``META_OPTIONS``), checked as a POST
    body's values are (the SDK's parser lets NUL, NaN and huge integers through)."""
    meta: dict[str, Any] = dict(ctx.meta or {})
    found = {name: meta[name] for name in META_OPTIONS if name in meta}
    if not found:
        return {}
    parsed: dict[str, Any] = jsonbody.parse(json.dumps(found).encode(), max_depth=max_depth)
    return parsed


def _hidden(method: str, exc: Exception) -> MCPError:
    """A bug, logged with its traceback and answered as MCP's internal error."""
    log.error("MCP %s failed", method, exc_info=exc)
    return MCPError(INTERNAL_ERROR, errors.BUG_MESSAGE)


def _lifted(ctx: Context) -> dict[str, Any] | None:
    """The call's arguments as ``api.mcp.route.lift_arguments`` took them out of its body,
    once: None when they were left to the SDK."""
    state = _request(ctx).state
    arguments: dict[str, Any] | None = getattr(state, "arguments", None)
    if arguments is not None:
        del state.arguments
    return arguments


def _request(ctx: Context) -> Request:
    """The HTTP request the call came in (``api.mcp.route`` serves no other transport)."""
    if not isinstance(ctx.request, Request):
        raise MCPError(INTERNAL_ERROR, "the MCP server is served over HTTP only")
    return ctx.request


def _caller(ctx: Context) -> Principal:
    caller: Principal = _request(ctx).state.caller
    return caller


def _task_id(arguments: dict[str, Any]) -> str:
    """The call's ``task_id``. Without one the call is refused as a tool's result with
    ``isError`` (MCP has a tool's input errors so, for the model to correct), not -32602."""
    task_id = arguments.get("task_id")
    if not isinstance(task_id, str):
        raise BadRequest("task_id (a string) is required", code="invalid_parameter")
    return task_id
