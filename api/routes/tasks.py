"""``/tasks``: submit an envelope, read a task, list a tenant's tasks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from api.deps import authenticate, read_json_body
from api.schemas import ERROR_RESPONSES, TaskList, TaskResource
from broker import jsonbody, queries
from broker.admission import admit
from broker.capabilities import any_pattern_allows, is_valid_name
from broker.envelope import Envelope, parse_envelope
from broker.errors import BadRequest, Forbidden, InvalidEnvelope, NotFound
from broker.keys import Principal
from broker.submission import submit
from broker.tasks import parse_task_id, render

router = APIRouter(tags=["tasks"])
Caller = Annotated[Principal, Depends(authenticate)]
StatusFilter = Literal["queued", "running", "succeeded", "failed", "cancelled", "expired"]


def _merge_idempotency_header(data: Any, header: str | None) -> Any:
    if header is None or not isinstance(data, dict):
        return data
    in_body = data.get("idempotency_key")
    if in_body is not None and in_body != header:
        raise BadRequest(
            "Idempotency-Key header and idempotency_key differ", code="envelope_invalid"
        )
    return {**data, "idempotency_key": header}


def _not_yet(envelope: Envelope) -> None:
    if envelope.reply_mode != "async":
        raise InvalidEnvelope(
            f"reply_mode {envelope.reply_mode!r} is not served yet; use 'async' and poll",
            code="reply_mode_unsupported",
        )
    if envelope.callback is not None:
        raise InvalidEnvelope(
            "callbacks are not served yet; poll the task", code="callback_unsupported"
        )


@router.post(
    "/tasks",
    status_code=202,
    response_model=TaskResource,
    responses=ERROR_RESPONSES,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": Envelope.model_json_schema()}},
        }
    },
)
async def submit_task(request: Request, caller: Caller) -> JSONResponse:
    """Submit an envelope. 202 with the task at once; poll ``Location`` for the outcome."""
    state = request.app.state
    raw = await read_json_body(request, state.settings.max_body_bytes)
    data = jsonbody.parse(raw, max_depth=state.settings.max_json_depth)
    envelope = parse_envelope(
        _merge_idempotency_header(data, request.headers.get("idempotency-key"))
    )
    if not any_pattern_allows(caller.capabilities, envelope.capability):
        raise Forbidden(
            f"this key may not run {envelope.capability!r}", code="capability_not_allowed"
        )
    _not_yet(envelope)
    queue = await admit(envelope, redis=state.redis, engine=state.engine, cache=state.catalog_cache)
    accepted = await submit(
        state.engine,
        state.dispatcher,
        caller,
        envelope,
        queue=queue,
        trace_id=request.state.trace_id,
        settings=state.settings,
    )
    task = render(accepted.row)
    headers = {"Location": f"/tasks/{task['task_id']}"}
    if accepted.replayed:
        headers["Idempotent-Replayed"] = "true"
    return JSONResponse(task, status_code=202, headers=headers)


@router.get("/tasks/{task_id}", response_model=TaskResource, responses=ERROR_RESPONSES)
async def get_task(task_id: str, request: Request, caller: Caller) -> JSONResponse:
    """The task. Unknown, expired and other tenants' ids are all 404."""
    tid = parse_task_id(task_id)
    row = (
        None
        if tid is None
        else await queries.get_task(request.app.state.engine, caller.tenant, tid)
    )
    if row is None:
        raise NotFound("no such task", code="task_not_found")
    return JSONResponse(render(row))


@router.get("/tasks", response_model=TaskList, responses=ERROR_RESPONSES)
async def list_tasks(
    request: Request,
    caller: Caller,
    capability: Annotated[str | None, Query(max_length=128)] = None,
    status: StatusFilter | None = None,
    limit: Annotated[int, Query(ge=1)] = 50,
    cursor: Annotated[str | None, Query(max_length=64)] = None,
) -> JSONResponse:
    """The tenant's tasks, newest first; pass ``next_cursor`` back as ``cursor`` for more."""
    if capability is not None and not is_valid_name(capability):
        raise BadRequest("capability is not a valid name", code="invalid_parameter")
    state = request.app.state
    rows, next_cursor = await queries.list_tasks(
        state.engine,
        caller.tenant,
        capability=capability,
        status=status,
        limit=min(limit, state.settings.list_page_max),
        cursor=cursor,
    )
    return JSONResponse({"tasks": [render(r) for r in rows], "next_cursor": next_cursor})
