"""Response shapes, for the OpenAPI document at ``/docs``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


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
    payload: Any = Field(
        default=None, description="The envelope's payload: with include=payload only"
    )


class TaskList(BaseModel):
    tasks: list[TaskResource]
    next_cursor: str | None


class SessionResource(BaseModel):
    session_id: str
    revision: int
    state: dict[str, Any]
    metadata: dict[str, Any]
    created_at: str
    updated_at: str
    expires_at: str


class SessionList(BaseModel):
    sessions: list[SessionResource]
    next_cursor: str | None


class SeriesFigures(BaseModel):
    tasks: int = Field(description="Tasks that ran and finished: succeeded, failed or stopped")
    succeeded: int
    failed: int
    p50_run_s: float | None = Field(description="Median run time, started to finished")
    p95_run_s: float | None
    p50_total_s: float | None = Field(description="Median total time, accepted to finished")
    p95_total_s: float | None


class SeriesBucket(SeriesFigures):
    start_at: str = Field(description="The bucket holds tasks finished from here for step_s")


class CapabilitySeries(BaseModel):
    capability: str
    window_s: int
    step_s: int
    total: SeriesFigures
    buckets: list[SeriesBucket]


class ProblemField(BaseModel):
    field: str
    message: str


class Problem(BaseModel):
    """RFC 9457 problem details; ``code`` is stable, ``errors`` lists each invalid field."""

    type: str
    title: str
    status: int
    detail: str
    code: str
    trace_id: str | None = None
    instance: str | None = None
    errors: list[ProblemField] | None = None


class StreamEvent(BaseModel):
    """The JSON of an SSE frame's ``data`` line. ``seq`` is also the frame's ``id`` and
    ``type`` its ``event``: status, progress, output, then one final succeeded, failed,
    cancelled or expired (whose ``data`` is the task)."""

    seq: int
    type: str
    data: Any
    trace_id: str | None = None
    at: float
