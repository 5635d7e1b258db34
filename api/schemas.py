"""Response shapes, for the OpenAPI document at ``/docs``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class Progress(BaseModel):
    percent: float
    message: str | None = None


class TaskError(BaseModel):
    code: str
    message: str
    retryable: bool


class AgentRef(BaseModel):
    agent_id: str
    version: str | None = None
    instance: str | None = None


class TaskResource(BaseModel):
    task_id: str
    capability: str
    status: str
    progress: Progress | None = None
    result: Any = None
    error: TaskError | None = None
    attempts: int
    agent: AgentRef | None = None
    trace_id: str
    session_id: str | None = None
    metadata: dict[str, Any]
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    expires_at: str


class TaskList(BaseModel):
    tasks: list[TaskResource]
    next_cursor: str | None


class Problem(BaseModel):
    type: str
    title: str
    status: int
    detail: str
    code: str
    trace_id: str | None = None
    instance: str | None = None


_problem = {"model": Problem, "content": {"application/problem+json": {}}}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {**_problem, "description": description}
    for status, description in {
        400: "Malformed request",
        401: "Missing or invalid API key",
        403: "Not for this key: a capability outside its patterns (capability_not_allowed),"
        " a tenant-wide setting (tenant_admin_required), an operator action (admin_required)",
        404: "No such resource for this tenant, or none this key's patterns let it see",
        408: "The body did not arrive in time",
        413: "Body or payload too large",
        422: "Envelope or parameters invalid",
        429: "Over the tenant's rate; retry after Retry-After",
        503: "A backing service is unavailable; retry after Retry-After",
    }.items()
}
