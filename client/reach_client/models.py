"""The API's resources as frozen dataclasses.

Each keeps the JSON it was read from in ``raw`` (what ``reach --json`` prints), so a field the
server adds later is never lost, only not yet typed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from reach_client.errors import TaskFailedError, UnexpectedAnswerError

TaskStatus = Literal["queued", "running", "succeeded", "failed", "cancelled", "expired"]
FINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled", "expired"})
Json = dict[str, Any]
T = TypeVar("T")


def _time(value: Any) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) else None


def _float(value: Any) -> float | None:
    return float(value) if value is not None else None


def _time_or_none(value: Any) -> datetime | None:
    """``_time``, but None for a time it cannot read, where raising would not say the API
    answered wrongly (a webhook call's body, read in the receiver)."""
    try:
        return _time(value)
    except ValueError:
        return None


@dataclass(frozen=True)
class Progress:
    percent: float
    message: str | None = None

    @classmethod
    def from_json(cls, doc: Json) -> Progress:
        return cls(percent=float(doc.get("percent") or 0), message=doc.get("message"))


@dataclass(frozen=True)
class TaskError:
    code: str
    message: str
    retryable: bool = False

    @classmethod
    def from_json(cls, doc: Json) -> TaskError:
        return cls(doc["code"], doc.get("message", ""), bool(doc.get("retryable", False)))


@dataclass(frozen=True)
class AgentRef:
    agent_id: str
    version: str | None = None
    instance: str | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Json) -> AgentRef:
        return cls(doc["agent_id"], doc.get("version"), doc.get("instance"), raw=doc)


@dataclass(frozen=True)
class Task:
    task_id: str
    capability: str
    # One of ``TaskStatus``; from_json does not check it, so a status a newer server adds
    # arrives as it is, never as an error.
    status: TaskStatus
    trace_id: str
    attempts: int = 0
    progress: Progress | None = None
    result: Any = None
    error: TaskError | None = None
    agent: AgentRef | None = None
    session_id: str | None = None
    metadata: Json = field(default_factory=dict)
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    expires_at: datetime | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @property
    def final(self) -> bool:
        """Nothing moves a task out of ``succeeded``, ``failed``, ``cancelled``, ``expired``."""
        return self.status in FINAL

    def raise_for_status(self) -> Task:
        """The task when it succeeded; ``TaskFailedError`` when it ended otherwise."""
        if self.final and self.status != "succeeded":
            raise TaskFailedError(self)
        return self

    @classmethod
    def from_json(cls, doc: Json) -> Task:
        agent = doc.get("agent")
        return cls(
            task_id=doc["task_id"],
            capability=doc["capability"],
            status=doc["status"],
            trace_id=doc.get("trace_id", ""),
            attempts=doc.get("attempts", 0),
            progress=Progress.from_json(doc["progress"]) if doc.get("progress") else None,
            result=doc.get("result"),
            error=TaskError.from_json(doc["error"]) if doc.get("error") else None,
            agent=AgentRef.from_json(agent) if isinstance(agent, dict) else None,
            session_id=doc.get("session_id"),
            metadata=doc.get("metadata") or {},
            created_at=_time(doc.get("created_at")),
            started_at=_time(doc.get("started_at")),
            finished_at=_time(doc.get("finished_at")),
            expires_at=_time(doc.get("expires_at")),
            raw=doc,
        )


@dataclass(frozen=True)
class Event:
    """One event of a task's stream: ``id`` only grows; the final one ends the stream."""

    id: int
    type: str
    data: Any
    trace_id: str | None = None  # the API's StreamEvent allows null
    at: float = 0.0
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @property
    def final(self) -> bool:
        return self.type in FINAL

    @property
    def task(self) -> Task | None:
        """The finished task, which a final event carries."""
        if not (self.final and isinstance(self.data, dict)):
            return None
        try:
            return Task.from_json(self.data)
        except (ValueError, LookupError, TypeError, AttributeError) as exc:
            raise UnexpectedAnswerError(
                f"the final event's task the client cannot read: {type(exc).__name__}: {exc}"
            ) from exc

    @classmethod
    def from_sse(cls, event_id: str, event_type: str, data: str) -> Event:
        doc = json.loads(data)
        return cls(
            id=int(doc.get("seq", event_id)),
            type=doc.get("type", event_type),
            data=doc.get("data"),
            trace_id=doc.get("trace_id"),
            at=float(doc.get("at", 0.0)),
            raw=doc,
        )


@dataclass(frozen=True)
class Instance:
    state: str
    seconds_since_heartbeat: float | None = None
    capabilities: list[str] = field(default_factory=list)
    # names, hosts, pids and the tasks an instance holds (every tenant's): operator keys only
    active_tasks: int | None = None
    instance: str | None = None
    hostname: str | None = None
    pid: int | None = None
    lease_ttl_s: float | None = None
    started_at: datetime | None = None
    stopped_at: datetime | None = None  # when offline
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Json) -> Instance:
        return cls(
            state=doc["state"],
            seconds_since_heartbeat=doc.get("seconds_since_heartbeat"),
            capabilities=list(doc.get("capabilities", [])),
            active_tasks=doc.get("active_tasks"),
            instance=doc.get("instance"),
            hostname=doc.get("hostname"),
            pid=doc.get("pid"),
            lease_ttl_s=_float(doc.get("lease_ttl_s")),
            started_at=_time(doc.get("started_at")),
            stopped_at=_time(doc.get("stopped_at")),
            raw=doc,
        )


@dataclass(frozen=True)
class AgentVersion:
    """One version of an agent: ``revoked`` for good, else the best state of its cards."""

    version: str
    lifecycle: str
    revoked_at: datetime | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Json) -> AgentVersion:
        return cls(
            version=doc["version"],
            lifecycle=doc["lifecycle"],
            revoked_at=_time(doc.get("revoked_at")),
            raw=doc,
        )


@dataclass(frozen=True)
class Channel:
    """An agent's channel: the weight of each version it sends to."""

    versions: dict[str, float]
    updated_at: datetime | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Json) -> Channel:
        return cls(
            versions={str(v): float(w) for v, w in (doc.get("versions") or {}).items()},
            updated_at=_time(doc.get("updated_at")),
            raw=doc,
        )


@dataclass(frozen=True)
class Agent:
    agent_id: str
    cards: list[Json]
    instances: list[Instance]
    live_instances: int = 0
    versions: list[AgentVersion] = field(default_factory=list)
    channels: dict[str, Channel] = field(default_factory=dict)
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @property
    def capabilities(self) -> list[str]:
        return sorted({c["capability"] for c in self.cards if "capability" in c})

    @classmethod
    def from_json(cls, doc: Json) -> Agent:
        return cls(
            agent_id=doc["agent_id"],
            cards=list(doc.get("cards", [])),
            instances=[Instance.from_json(i) for i in doc.get("instances", [])],
            live_instances=doc.get("live_instances", 0),
            versions=[AgentVersion.from_json(v) for v in doc.get("versions") or []],
            channels={
                name: Channel.from_json(c) for name, c in (doc.get("channels") or {}).items()
            },
            raw=doc,
        )


@dataclass(frozen=True)
class Capability:
    capability: str
    cards: list[Json]
    live_instances: int
    measured: Json = field(default_factory=dict)
    queue_depth: int | None = None  # operator keys only
    window_s: int | None = None  # what ``measured`` covers: the last window_s seconds
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @property
    def success_rate(self) -> float | None:
        value = self.measured.get("success_rate")
        return float(value) if value is not None else None

    @classmethod
    def from_json(cls, doc: Json) -> Capability:
        return cls(
            capability=doc["capability"],
            cards=list(doc.get("cards", [])),
            live_instances=doc.get("live_instances", 0),
            measured=doc.get("measured") or {},
            queue_depth=doc.get("queue_depth"),
            window_s=doc.get("window_s"),
            raw=doc,
        )


@dataclass(frozen=True)
class Session:
    session_id: str
    revision: int
    state: Json
    metadata: Json = field(default_factory=dict)
    created_at: datetime | None = None
    updated_at: datetime | None = None
    expires_at: datetime | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Json) -> Session:
        return cls(
            session_id=doc["session_id"],
            revision=doc["revision"],
            state=doc.get("state") or {},
            metadata=doc.get("metadata") or {},
            created_at=_time(doc.get("created_at")),
            updated_at=_time(doc.get("updated_at")),
            expires_at=_time(doc.get("expires_at")),
            raw=doc,
        )


@dataclass(frozen=True)
class SessionRevision:
    revision: int
    state: Json
    task_id: str | None = None  # the task that wrote it; None: written through the API
    created_at: datetime | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Json) -> SessionRevision:
        return cls(
            revision=doc["revision"],
            state=doc.get("state") or {},
            task_id=doc.get("task_id"),
            created_at=_time(doc.get("created_at")),
            raw=doc,
        )


@dataclass(frozen=True)
class Webhook:
    webhook_id: str
    url: str
    events: list[str]
    status: str
    capabilities: list[str] | None = None
    description: str | None = None
    secret: str | None = field(default=None, repr=False)  # in the answer to create only
    created_at: datetime | None = None
    disabled_at: datetime | None = None
    disabled_reason: str | None = None
    # Until then the secret before the last rotation signs too
    previous_secret_expires_at: datetime | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Json) -> Webhook:
        return cls(
            webhook_id=doc["webhook_id"],
            url=doc["url"],
            events=list(doc.get("events", [])),
            status=doc.get("status", "enabled"),
            capabilities=doc.get("capabilities"),
            description=doc.get("description"),
            secret=doc.get("secret"),
            created_at=_time(doc.get("created_at")),
            disabled_at=_time(doc.get("disabled_at")),
            disabled_reason=doc.get("disabled_reason"),
            previous_secret_expires_at=_time(doc.get("previous_secret_expires_at")),
            raw=doc,
        )


@dataclass(frozen=True)
class DeliveryAttempt:
    attempt: int
    status_code: int | None = None
    error: str | None = None
    latency_ms: float | None = None
    at: datetime | None = None
    address: str | None = None  # the address connected to
    response_excerpt: str | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Json) -> DeliveryAttempt:
        return cls(
            attempt=doc["attempt"],
            status_code=doc.get("status_code"),
            error=doc.get("error"),
            latency_ms=doc.get("latency_ms"),
            at=_time(doc.get("at")),
            address=doc.get("address"),
            response_excerpt=doc.get("response_excerpt"),
            raw=doc,
        )


@dataclass(frozen=True)
class Delivery:
    delivery_id: str
    task_id: str
    event_type: str
    url: str
    status: str
    attempt_count: int = 0
    webhook_id: str | None = None
    last_status_code: int | None = None
    last_error: str | None = None
    attempts: list[DeliveryAttempt] = field(default_factory=list)
    created_at: datetime | None = None
    # The ``webhook-id`` header: the same on every attempt, so the receiver dedupes on it
    message_id: str | None = None
    kind: str | None = None  # "subscription", or "callback" (the task's own; no webhook_id)
    next_attempt_at: datetime | None = None  # when pending: the next attempt is due
    finished_at: datetime | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Json) -> Delivery:
        attempts = [DeliveryAttempt.from_json(a) for a in doc.get("attempts", [])]
        return cls(
            delivery_id=doc["delivery_id"],
            task_id=doc["task_id"],
            event_type=doc["event_type"],
            url=doc["url"],
            status=doc["status"],
            attempt_count=doc.get("attempt_count", 0),
            webhook_id=doc.get("webhook_id"),
            last_status_code=doc.get("last_status_code"),
            last_error=doc.get("last_error"),
            attempts=attempts,
            created_at=_time(doc.get("created_at")),
            message_id=doc.get("message_id"),
            kind=doc.get("kind"),
            next_attempt_at=_time(doc.get("next_attempt_at")),
            finished_at=_time(doc.get("finished_at")),
            raw=doc,
        )


@dataclass(frozen=True)
class WebhookEvent:
    """A verified webhook call's body: ``{"type", "timestamp", "data": <the task>}``.
    ``timestamp`` is None when absent or unreadable (its text stays in ``raw``)."""

    type: str
    timestamp: datetime | None
    data: Any
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @property
    def task(self) -> Task | None:
        return Task.from_json(self.data) if isinstance(self.data, dict) else None

    @classmethod
    def from_json(cls, doc: Json) -> WebhookEvent:
        return cls(
            type=doc["type"],
            timestamp=_time_or_none(doc.get("timestamp")),
            data=doc.get("data"),
            raw=doc,
        )


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a listing; ``next_cursor`` is None on the last."""

    items: list[T]
    next_cursor: str | None
