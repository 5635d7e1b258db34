"""Response shapes, for the OpenAPI document at ``/docs``.

Routes answer with a ``JSONResponse`` of what the broker renders and name the model as
``response_model`` only to describe it: FastAPI neither filters nor re-validates a response
it is handed, so a model here can never drop or rename a field on the wire. Closed sets
(statuses, states, lifecycles) are ``Literal``s; ``tests/unit/test_schemas.py`` holds them
equal to the broker's own constants.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from broker.tasks.resource import Status


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
    status: Status
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


# Webhooks and deliveries (``broker.webhooks.subscriptions.render``, ``delivery_log.render``).

EventType = Literal[
    "task.succeeded", "task.failed", "task.cancelled", "task.expired", "task.progress"
]
DeliveryStatus = Literal["pending", "sending", "succeeded", "failed", "dead"]


class WebhookResource(BaseModel):
    webhook_id: str
    url: str
    events: list[EventType]
    capabilities: list[str] = Field(description="Capability patterns; empty: all")
    description: str | None
    status: Literal["enabled", "disabled"]
    disabled_at: str | None
    disabled_reason: str | None
    previous_secret_expires_at: str | None = Field(
        description="Until then the secret before the last rotation signs too"
    )
    created_at: str


class WebhookWithSecret(WebhookResource):
    secret: str = Field(description="The signing secret (whsec_...): shown this once")


class WebhookList(BaseModel):
    webhooks: list[WebhookResource]


class DeliveryAttempt(BaseModel):
    attempt: int
    at: str
    status_code: int | None = Field(description="null: no response (timeout, refused, reset)")
    error: str | None
    latency_ms: int
    address: str | None = Field(description="The address connected to")
    response_excerpt: str | None


class Delivery(BaseModel):
    delivery_id: str
    message_id: str = Field(description="The webhook-id header: the same on every attempt")
    webhook_id: str | None = Field(description="null: the task's own callback")
    kind: Literal["subscription", "callback"]
    task_id: str
    event_type: EventType
    url: str
    status: DeliveryStatus
    attempt_count: int
    next_attempt_at: str | None = Field(description="When pending: the next attempt is due")
    last_status_code: int | None
    last_error: str | None
    created_at: str
    finished_at: str | None
    attempts: list[DeliveryAttempt]


class DeliveryPage(BaseModel):
    deliveries: list[Delivery]
    next_cursor: str | None


class TaskDeliveries(BaseModel):
    deliveries: list[Delivery]


class CallbackSecret(BaseModel):
    secret: str = Field(description="The secret that signs the tenant's callbacks: shown once")
    previous_secret_expires_at: str | None = Field(
        description="Until then the previous secret signs too; null: there was none"
    )


# Agents, their cards and instances (``broker.registry.views``), and operators' answers.

InstanceState = Literal["ready", "not_ready", "draining", "suspect", "offline"]
Lifecycle = Literal["ready", "suspect", "not_ready", "draining", "offline", "revoked"]


class CardTag(BaseModel):
    tag: str
    weight: float


class CardConstraints(BaseModel):
    max_payload_bytes: int | None
    timeout_hint_ms: int | None


class CardEndpoint(BaseModel):
    protocol: Literal["http", "a2a"]
    skill: str | None = Field(default=None, description="a2a: the skill the card runs")


class CardView(BaseModel):
    """A card as its agent advertised it (``broker.registry.model.Card.document``), with its
    lifecycle and when it was seen."""

    schema_version: int
    agent_id: str
    capability: str
    version: str
    display_name: str
    description: str | None
    owner: str | None
    tags: list[CardTag]
    input_schema: dict[str, Any] | None
    output_schema: dict[str, Any] | None
    constraints: CardConstraints
    max_concurrency: int | None
    cost_per_call: float
    idempotent: bool
    streaming: bool
    cancellable: bool
    lease_ttl_s: float
    max_attempts: int
    tenants: list[str] | None = Field(
        default=None,
        description="Who may use it (null: every tenant); shown to operator keys only",
    )
    extra: dict[str, Any]
    endpoint: CardEndpoint | None = Field(
        default=None, description="A remote agent's: how the broker reaches it"
    )
    lifecycle: Lifecycle
    first_seen_at: str
    last_seen_at: str


class InstanceView(BaseModel):
    instance: str | None = Field(default=None, description="Shown to operator keys only")
    hostname: str | None = Field(default=None, description="Shown to operator keys only")
    pid: int | None = Field(default=None, description="Shown to operator keys only")
    state: InstanceState
    seconds_since_heartbeat: float
    active_tasks: int | None = Field(
        default=None, description="Shown to operator keys only: every tenant's tasks count"
    )
    lease_ttl_s: float
    started_at: str
    stopped_at: str | None = Field(description="When offline")
    capabilities: list[str]


class VersionView(BaseModel):
    version: str
    lifecycle: Lifecycle = Field(description="revoked, else the best of its cards' states")
    revoked_at: str | None


class ChannelView(BaseModel):
    versions: dict[str, float] = Field(description="Version -> weight")
    updated_at: str


class AgentResource(BaseModel):
    agent_id: str
    cards: list[CardView]
    instances: list[InstanceView]
    versions: list[VersionView]
    channels: dict[str, ChannelView]
    live_instances: int


class AgentList(BaseModel):
    agents: list[AgentResource]


class ChannelSet(ChannelView):
    channel: str


class Revocation(BaseModel):
    agent_id: str
    version: str
    lifecycle: Literal["revoked"]
    revoked_at: str


class DrainRequested(BaseModel):
    instance: str
    drain: Literal["requested"]


class RemoteEndpoint(BaseModel):
    protocol: Literal["http", "a2a"]
    url: str


class RemoteAgent(BaseModel):
    agent_id: str
    version: str
    endpoint: RemoteEndpoint
    capabilities: list[str]
    instance: str = Field(description="The bridge's instance that holds the agent's leases")
    capability_prefix: str | None = Field(default=None, description="a2a: the skills' prefix")
    secret: str | None = Field(
        default=None,
        description="Signs every call to the agent (whsec_...): in the first answer only",
    )


# Capabilities (``broker.registry.views.capabilities``).


class CapabilityCard(BaseModel):
    agent_id: str
    version: str
    tenants: list[str] | None = Field(
        default=None, description="Who may use it (null: every tenant); operator keys only"
    )


class CapabilityFigures(BaseModel):
    tasks: int
    success_rate: float | None
    p50_run_s: float | None
    p95_run_s: float | None


class CapabilityResource(BaseModel):
    capability: str
    cards: list[CapabilityCard]
    live_instances: int
    window_s: int = Field(description="What measured covers: the last window_s seconds")
    measured: CapabilityFigures = Field(description="The caller's tenant's finished tasks")
    queue_depth: int | None = Field(
        default=None, description="Messages waiting, every tenant's: operator keys only"
    )


class CapabilityList(BaseModel):
    capabilities: list[CapabilityResource]


# Sessions' revisions (``broker.sessions.history``).


class SessionRevision(BaseModel):
    revision: int
    state: dict[str, Any]
    task_id: str | None = Field(description="The task that wrote it; null: the API")
    created_at: str


class SessionRevisions(BaseModel):
    session_id: str
    revisions: list[SessionRevision]


class Readiness(BaseModel):
    status: Literal["ready"]
    checks: dict[str, Literal["ok"]] = Field(description="Each dependency: postgres, redis")
