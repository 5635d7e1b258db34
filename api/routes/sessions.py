"""``/sessions``: a conversation's state with a revision that only grows (``broker.sessions``).

``ETag`` carries the revision; writes need ``If-Match`` (428 without it, 412
``revision_conflict`` naming the current revision when it is stale).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from api.contract import AUTHENTICATED, JSON_BODY, answers, header, json_body, model_schema
from api.deps import authenticate, metered, read_json_body
from api.paging import LIMIT_DEFAULT, CreatedCursor, Limit
from api.schemas import SessionList, SessionResource, SessionRevisions
from api.services import services
from broker import jsonbody, sessions
from broker.tenancy.keys import Principal
from broker.tenancy.usage import ROW_BYTES

router = APIRouter(tags=["sessions"])
Caller = Annotated[Principal, Depends(authenticate)]
Metered = Annotated[Principal, Depends(metered)]
# Required in the document (api.contract): without it a write is 428, not 422.
IfMatch = Annotated[
    str | None,
    Header(
        alias="If-Match",
        description='The revision the write is based on, "<revision>" (a list of them, or *,'
        " as RFC 9110 has it)",
        json_schema_extra={"pattern": "\\S"},
    ),
]
REVISIONS_MAX = 100
ETAG = {"ETag": header('The session\'s revision: "<revision>"')}
SESSION = {"description": "The session", "headers": ETAG, "model": SessionResource}
INVALID = "The body is not valid (session_invalid), or the database refused a value in it"
TOO_LARGE = "Body too large, or the session would be (session_too_large)"
CREATES = {
    201: {"description": "The session, at revision 1", "headers": ETAG, "model": SessionResource},
    **answers(
        *AUTHENTICATED,
        *JSON_BODY,
        409,
        422,
        s409="The tenant's live sessions are at the limit (session_limit_reached)",
        s413=TOO_LARGE,
        s422=INVALID,
    ),
}
WRITES = {
    200: SESSION,
    **answers(*AUTHENTICATED, *JSON_BODY, 404, 412, 422, 428, s413=TOO_LARGE, s422=INVALID),
}


class NewSession(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # JSON types as sent

    state: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    ttl_s: int | None = Field(None, gt=0)

    @field_validator("ttl_s", mode="before")
    @classmethod
    def _whole(cls, value: Any) -> Any:
        return jsonbody.whole(value)  # 60.0 is 60


class Replacement(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # JSON types as sent

    state: dict[str, Any]
    metadata: dict[str, Any] | None = None


PATCH_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "state": {"type": ["object", "null"]},
        "metadata": {"type": ["object", "null"]},
    },
    "description": "A JSON merge patch (RFC 7396) of the session's state and metadata",
}


async def _raw(request: Request) -> bytes:
    return await read_json_body(request, services(request).settings.session_max_bytes + 64 * 1024)


def _parsed(request: Request, raw: bytes) -> Any:
    return jsonbody.parse(raw, max_depth=services(request).settings.max_json_depth)


@contextlib.asynccontextmanager
async def _counted(request: Request, tenant: str, size: int) -> AsyncIterator[None]:
    """A write of about ``size`` bytes, refused (429 ``quota_exceeded``) when it would take
    what the tenant holds in Postgres past its quota: its sessions and their revisions count
    with its tasks (migration 0017). The write's own bytes are counted by Postgres; until the
    next read the estimate stands for them, and is given back if the write fails."""
    quota = services(request).intake.quota.rows
    await quota.take(tenant, size)
    try:
        yield
    except BaseException:
        quota.give_back(tenant, size)
        raise


async def _written(
    request: Request,
    tenant: str,
    session_id: str,
    revision: frozenset[int] | None,
    raw: bytes,
    **change: Any,
) -> JSONResponse:
    """The session written (``state`` and ``metadata``, or ``patch``: ``sessions.write``),
    counted as a revision of about the body's size."""
    settings = services(request).settings
    async with _counted(request, tenant, len(raw) + ROW_BYTES):
        written = await sessions.write(
            services(request).engine,
            tenant,
            session_id,
            revision=revision,
            max_bytes=settings.session_max_bytes,
            revisions_kept=settings.session_revisions_kept,
            **change,
        )
    return _answer(written)


def _validated(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '<body>'}: {e['msg']}" for e in exc.errors()[:10]
        )
        raise sessions.SessionInvalid(problems) from None


def _answer(session: dict[str, Any], status_code: int = 200) -> JSONResponse:
    return JSONResponse(
        session, status_code=status_code, headers={"ETag": sessions.etag(session["revision"])}
    )


@router.post(
    "/sessions",
    status_code=201,
    responses=CREATES,
    openapi_extra={
        "requestBody": {
            "required": False,
            "content": {"application/json": {"schema": model_schema(NewSession)}},
        }
    },
)
async def create_session(request: Request, caller: Metered) -> JSONResponse:
    """A new session (``state``, ``metadata``, ``ttl_s``: all optional), at revision 1; 409
    ``session_limit_reached`` when the tenant holds as many live ones as it may."""
    settings = services(request).settings
    raw = await _raw(request)
    given = _validated(NewSession, _parsed(request, raw) if raw else {})
    ttl_s = min(given.ttl_s or settings.session_ttl_s, settings.session_max_ttl_s)
    # the session and its first revision, each about the body's size
    async with _counted(request, caller.tenant, 2 * (len(raw) + ROW_BYTES)):
        created = await sessions.create(
            services(request).engine,
            caller.tenant,
            state=given.state,
            metadata=given.metadata,
            ttl_s=ttl_s,
            max_bytes=settings.session_max_bytes,
            max_per_tenant=settings.session_max_per_tenant,
            turns=services(request).heavy_reads,
        )
    return _answer(created, 201)


@router.get("/sessions", response_model=SessionList, responses=answers(*AUTHENTICATED, 400, 422))
async def list_sessions(
    request: Request,
    caller: Caller,
    limit: Limit = LIMIT_DEFAULT,
    cursor: CreatedCursor = None,
) -> JSONResponse:
    """The tenant's live sessions, newest first (by creation); pass ``next_cursor`` back as
    ``cursor`` for more. Expired ones are not listed."""
    state = services(request)
    # Its byte budget measures each candidate's state (up to 256 KiB of JSON each): one
    # tenant's lists run one at a time, with its task lists (``OneAtATime``).
    async with state.heavy_reads.turn(caller.tenant, "list"):
        found, next_cursor = await sessions.list_live(
            state.engine,
            caller.tenant,
            limit=min(limit, state.settings.list_page_max),
            cursor=cursor,
            max_bytes=state.settings.list_page_max_bytes,
        )
    return JSONResponse({"sessions": found, "next_cursor": next_cursor})


@router.get("/sessions/{session_id}", responses={200: SESSION, **answers(*AUTHENTICATED, 404, 422)})
async def get_session(session_id: str, request: Request, caller: Caller) -> JSONResponse:
    """The session; ``ETag`` is its revision. Unknown, expired and other tenants' are 404."""
    return _answer(await sessions.get(services(request).engine, caller.tenant, session_id))


@router.put(
    "/sessions/{session_id}",
    responses=WRITES,
    openapi_extra=json_body(model_schema(Replacement)),
)
async def replace_session(
    session_id: str, request: Request, caller: Metered, if_match: IfMatch = None
) -> JSONResponse:
    """Replace the state (and the metadata, when given) at the revision ``If-Match`` names."""
    revision = sessions.revision_of(if_match)
    raw = await _raw(request)
    given = _validated(Replacement, _parsed(request, raw))
    return await _written(
        request,
        caller.tenant,
        session_id,
        revision,
        raw,
        state=given.state,
        metadata=given.metadata,
    )


@router.patch(
    "/sessions/{session_id}",
    responses=WRITES,
    openapi_extra=json_body(PATCH_SCHEMA, "application/merge-patch+json"),
)
async def patch_session(
    session_id: str, request: Request, caller: Metered, if_match: IfMatch = None
) -> JSONResponse:
    """A JSON merge patch (RFC 7396) of the session: ``{"state": {"cart": null}}`` removes
    ``state.cart``. Only ``state`` and ``metadata`` may be patched."""
    revision = sessions.revision_of(if_match)
    raw = await _raw(request)
    patch = _parsed(request, raw)
    # The patch is checked whole before the revision: a malformed one is 422 at any revision.
    if (
        not isinstance(patch, dict)
        or set(patch) - set(sessions.PATCHABLE)
        or any(v is not None and not isinstance(v, dict) for v in patch.values())
    ):
        raise sessions.SessionInvalid(
            "a patch is an object of state and metadata, each an object or null"
        )
    return await _written(request, caller.tenant, session_id, revision, raw, patch=patch)


@router.delete(
    "/sessions/{session_id}", status_code=204, responses=answers(*AUTHENTICATED, 404, 422)
)
async def delete_session(session_id: str, request: Request, caller: Metered) -> Response:
    await sessions.remove(services(request).engine, caller.tenant, session_id)
    return Response(status_code=204)


@router.get(
    "/sessions/{session_id}/revisions",
    response_model=SessionRevisions,
    responses=answers(*AUTHENTICATED, 404, 422),
)
async def list_revisions(
    session_id: str,
    request: Request,
    caller: Caller,
    limit: Annotated[int, Query(ge=1, le=REVISIONS_MAX)] = 20,
) -> JSONResponse:
    """The last revisions, newest first, each with the task that wrote it (null: the API);
    fewer when their states would pass the page's byte budget (list_page_max_bytes). Only
    the last session_revisions_kept are kept: older ones are gone."""
    state = services(request)
    async with state.heavy_reads.turn(caller.tenant, "list"):  # as GET /sessions
        found = await sessions.history(
            state.engine,
            caller.tenant,
            session_id,
            limit=limit,
            max_bytes=state.settings.list_page_max_bytes,
        )
    return JSONResponse({"session_id": session_id, "revisions": found})
