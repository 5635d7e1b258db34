"""``/tasks``: submit an envelope, read a task, list a tenant's tasks."""

from __future__ import annotations

import logging
import re
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response

from api import replies
from api.contract import (
    AUTHENTICATED,
    EVENT_STREAM,
    JSON_BODY,
    answers,
    header,
    json_body,
    model_schema,
)
from api.deps import authenticate, read_metered_body
from api.paging import LIMIT_DEFAULT, Cursor, Limit
from api.rawjson import StoredJSONResponse, spliced
from api.schemas import TaskList, TaskResource
from api.services import Services, services
from api.sse import EventStreamResponse, Slot
from broker import jsonbody, sessions
from broker.errors import BadRequest
from broker.observability import metrics
from broker.registry.capabilities import NAME_MAX, NAME_PATTERN, is_valid_name
from broker.tasks import queries
from broker.tasks.envelope import SESSION_ID_PATTERN, Envelope, parse_envelope
from broker.tasks.resource import Status, render
from broker.tasks.submission import Accepted
from broker.tenancy.keys import Principal

log = logging.getLogger("reach.api")
router = APIRouter(tags=["tasks"])
Caller = Annotated[Principal, Depends(authenticate)]
LAST_EVENT_ID_PATTERN = "^[0-9]{1,18}$"
LAST_EVENT_ID = re.compile(LAST_EVENT_ID_PATTERN)
TASK = {"$ref": "#/components/schemas/TaskResource"}
LOCATION = {"Location": header("The task: /tasks/{task_id}")}
SUBMITTED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "sync: the task, finished within the wait. stream: its events",
        "headers": LOCATION,
        "content": {"application/json": {"schema": TASK}, **EVENT_STREAM},
    },
    202: {
        "description": "async, or sync not finished within the wait: the task as it stands",
        "headers": LOCATION,
        "content": {"application/json": {"schema": TASK}},
    },
}


def _merge_idempotency_header(data: Any, header: str | None) -> Any:
    if header is None or not isinstance(data, dict):
        return data
    in_body = data.get("idempotency_key")
    if in_body is not None and in_body != header:
        raise BadRequest(
            "Idempotency-Key header and idempotency_key differ", code="envelope_invalid"
        )
    return {**data, "idempotency_key": header}


@router.post(
    "/tasks",
    status_code=202,
    response_model=TaskResource,
    responses={
        **SUBMITTED,
        **answers(
            *AUTHENTICATED,
            *JSON_BODY,
            403,
            404,
            409,
            410,
            422,
            s404="The target names no agent this key may see (agent_not_found)",
            s409="The idempotency key's task is being released; retry (conflict_retry)",
            s503="No live agent serves the capability (no_agent_available), the queue is full"
            " or unavailable, or the server is overloaded; retry after Retry-After",
        ),
    },
    openapi_extra=json_body(model_schema(Envelope)),
)
async def submit_task(request: Request, caller: Caller) -> Response:
    """Submit an envelope. ``async``: 202 with the task at once, poll ``Location``.
    ``sync``: 200 with the finished task if it finishes within the wait, else 202.
    ``stream``: the task's events as ``text/event-stream``."""
    started = time.perf_counter()
    state = services(request)
    accepted, reply, slot = await _accept(request, caller, state, started)
    try:
        return await replies.answer(
            state, caller, reply, accepted, started=started, slot=slot, receive=request.receive
        )
    except BaseException:
        if slot is not None:
            slot.release()
        raise


async def _accept(
    request: Request, caller: Principal, state: Services, started: float
) -> tuple[Accepted, replies.Reply, Slot | None]:
    """The envelope read and its task accepted, with what the answer needs of it, and the
    stream's slot. The body and its parse end here, before a wait or a stream that lasts
    seconds to minutes: 1 MiB of JSON is some 20 MiB of Python objects, held that long."""
    raw, token_taken = await read_metered_body(request, caller, state.settings.max_body_bytes)
    data = jsonbody.parse(raw, max_depth=state.settings.max_json_depth)
    envelope = parse_envelope(
        _merge_idempotency_header(data, request.headers.get("idempotency-key"))
    )
    # A stream's slot before the task is written: a tenant holding all of its own is refused
    # with nothing written, and the stream the task was accepted for always opens.
    slot = state.streams.take(caller.tenant) if envelope.reply_mode == "stream" else None
    try:
        accepted = await state.intake.submit(
            caller, envelope, trace_id=request.state.trace_id, metered=token_taken
        )
    except BaseException:
        if slot is not None:
            slot.release()
        raise
    metrics.submit_duration.observe(time.perf_counter() - started)
    return accepted, replies.Reply.of(state, envelope), slot


@router.get(
    "/tasks/{task_id}/events",
    responses={
        200: {"description": "The task's events", "content": EVENT_STREAM},
        **answers(*AUTHENTICATED, 400, 404),
    },
    response_class=EventStreamResponse,
)
async def task_events(
    task_id: str,
    request: Request,
    caller: Caller,
    last_event_id: Annotated[
        str | None,
        Header(
            description="Resume after this event id (a seq this stream sent)",
            json_schema_extra={"pattern": LAST_EVENT_ID_PATTERN},
        ),
    ] = None,
) -> EventStreamResponse:
    """SSE: the task's events from the start, or after ``Last-Event-ID``; ends after the final
    event. Opening it on a finished task replays the log."""
    task = await queries.visible_task(services(request).engine, caller, task_id)
    after = 0
    if last_event_id is not None:
        if LAST_EVENT_ID.fullmatch(last_event_id.strip()) is None:
            raise BadRequest(
                "Last-Event-ID must be an event id this stream sent", code="invalid_last_event_id"
            )
        after = int(last_event_id.strip())
    return replies.event_stream(services(request), caller, task["id"], after=after, task=task)


@router.get(
    "/tasks/{task_id}", response_model=TaskResource, responses=answers(*AUTHENTICATED, 404, 422)
)
async def get_task(
    task_id: str,
    request: Request,
    caller: Caller,
    include: Annotated[
        Literal["payload"] | None,
        Query(description="payload: add the envelope's payload to the task"),
    ] = None,
) -> StoredJSONResponse:
    """The task. Unknown, expired, other tenants' ids and tasks of capabilities outside the
    key's patterns are all 404. ``include=payload`` adds the envelope's ``payload`` (the
    console shows it and submits it again)."""
    engine = services(request).engine
    row = await queries.visible_task(
        engine, caller, task_id, payload=include == "payload", as_text=True
    )
    resource = render(row)
    if include == "payload":
        resource["payload"] = row["payload"]
    return StoredJSONResponse(spliced(resource, queries.TEXT_JSON))


@router.get("/tasks", response_model=TaskList, responses=answers(*AUTHENTICATED, 400, 422))
async def list_tasks(
    request: Request,
    caller: Caller,
    capability: Annotated[
        str | None, Query(max_length=NAME_MAX, json_schema_extra={"pattern": NAME_PATTERN})
    ] = None,
    status: Status | None = None,
    session_id: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=sessions.ID_MAX,
            pattern=SESSION_ID_PATTERN,
            description="Only the tasks of this session (none for another tenant's)",
        ),
    ] = None,
    limit: Limit = LIMIT_DEFAULT,
    cursor: Cursor = None,
) -> JSONResponse:
    """The tenant's tasks of capabilities the key's patterns allow, newest first; pass
    ``next_cursor`` back as ``cursor`` for more. ``session_id``: only that session's."""
    if capability is not None and not is_valid_name(capability):
        raise BadRequest("capability is not a valid name", code="invalid_parameter")
    state = services(request)
    async with state.heavy_reads.turn(caller.tenant, "list"):
        found, next_cursor = await queries.list_tasks(
            state.engine,
            caller.tenant,
            capability=capability,
            status=status,
            limit=min(limit, state.settings.list_page_max),
            cursor=cursor,
            patterns=caller.sees,
            max_bytes=state.settings.list_page_max_bytes,
            session_id=session_id,
        )
    return JSONResponse({"tasks": found, "next_cursor": next_cursor})


@router.post(
    "/tasks/{task_id}/cancel",
    response_model=TaskResource,
    responses=answers(*AUTHENTICATED, 404, 409, s409="The task is final already (task_final)"),
)
async def cancel_task(task_id: str, request: Request, caller: Caller) -> JSONResponse:
    """Cancel a queued or running task: it ends ``cancelled``. A running agent is told through
    its context, and stopped outright when its card says it is cancellable. 409 if final."""
    return JSONResponse(render(await services(request).canceller.cancel_visible(caller, task_id)))
