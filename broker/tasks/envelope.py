"""The envelope: what a caller sends to ``POST /tasks``. Unknown fields are rejected."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from broker.errors import InvalidEnvelope
from broker.jsonbody import whole
from broker.registry.addresses import (
    TARGET_MAX,
    TARGET_PATTERN,
    AddressInvalid,
    Target,
    parse_target,
)
from broker.registry.capabilities import NAME_MAX, NAME_PATTERN, is_reserved, is_valid_name
from broker.tasks.resource import FAILED, SUCCEEDED
from broker.webhooks.events import EVENTS_SCHEMA, check_events, event_for_status

ReplyMode = Literal["async", "sync", "stream"]
_PRINTABLE = r"^[\x21-\x7e]+$"
# What a session id may be wherever one is given (its length: ``broker.sessions.ID_MAX``).
SESSION_ID_PATTERN = _PRINTABLE
# The envelope's fields a protocol's call may set beside its capability and payload (an A2A
# message in its metadata or its request's, an MCP tool call in its ``_meta``), named and
# checked as ``POST /tasks`` has them. A2A dropped them, silently: its tasks had no deadline
# and kept their results a day whatever their callers asked.
OPTIONS = (
    "deadline_ms",
    "result_ttl_s",
    "priority",
    "max_attempts",
    "metadata",
    "queue_if_unavailable",
    "target",
    "hint",
)


class Callback(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(max_length=2048)
    events: list[str] = Field(
        default_factory=lambda: [event_for_status(SUCCEEDED), event_for_status(FAILED)],
        max_length=16,
        json_schema_extra=EVENTS_SCHEMA,
    )

    @field_validator("events")
    @classmethod
    def _known_events(cls, value: list[str]) -> list[str]:
        return check_events(value)


class Envelope(BaseModel):
    # strict: JSON types as sent; "45000" is not a number and true is not a priority.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    capability: str = Field(
        max_length=NAME_MAX,
        examples=["invoice.extract"],
        json_schema_extra={"pattern": NAME_PATTERN},
    )
    payload: dict[str, Any] = Field(examples=[{"text": "Invoice No: INV-1\nTotal: USD 10.00"}])
    reply_mode: ReplyMode = "async"
    deadline_ms: int | None = Field(None, gt=0, le=7 * 24 * 3600 * 1000)
    idempotency_key: str | None = Field(None, min_length=1, max_length=255, pattern=_PRINTABLE)
    session_id: str | None = Field(None, min_length=1, max_length=128, pattern=SESSION_ID_PATTERN)
    callback: Callback | None = None
    priority: int | None = Field(None, ge=0, le=9)
    max_attempts: int | None = Field(None, ge=1, le=20)
    source: str | None = Field(None, max_length=128)
    metadata: dict[str, Any] = Field(default_factory=dict)
    queue_if_unavailable: bool = Field(
        False, description="With no live agent, wait in the queue (bounded by the deadline)."
    )
    result_ttl_s: int | None = Field(
        None, gt=0, description="How long the result is kept; capped by the server's maximum."
    )
    target: str | None = Field(
        None,
        # Stated, not checked here: parse_envelope refuses as target_invalid.
        json_schema_extra={"pattern": TARGET_PATTERN, "maxLength": TARGET_MAX},
        description="Pin to one agent: <agent_id>@<version>, <agent_id>@<channel> or "
        "agent://<tenant>/<agent_id>@<version|channel> (the tenant must be the caller's).",
        examples=["invoice-extractor@2.3.1"],
    )
    hint: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        pattern=_PRINTABLE,
        description="An instance to prefer (affinity): it serves the request while ready.",
    )

    @field_validator("deadline_ms", "priority", "max_attempts", "result_ttl_s", mode="before")
    @classmethod
    def _whole(cls, value: Any) -> Any:
        return whole(value)  # 60.0 is 60, as JSON Schema's integer has it

    @property
    def address(self) -> Target | None:
        """The parsed target (valid: ``parse_envelope`` checked it)."""
        return parse_target(self.target) if self.target is not None else None

    @field_validator("capability")
    @classmethod
    def _capability_name(cls, value: str) -> str:
        if not is_valid_name(value):
            if is_reserved(value):
                raise ValueError("is reserved: Celery, kombu or the broker keep keys under it")
            raise ValueError(
                "must be dotted lowercase segments ([a-z][a-z0-9_-]*), at most 8, "
                "not under the reserved 'reach.' prefix"
            )
        return value


def parse_envelope(data: Any) -> Envelope:
    """Validate parsed JSON as an envelope, or raise InvalidEnvelope listing every problem.

    The errors name the field and the rule, never echo the input (it may be large or secret).
    """
    if not isinstance(data, dict):
        raise InvalidEnvelope(
            "the body must be a JSON object",
            errors=[{"field": "", "message": "must be a JSON object"}],
        )
    try:
        envelope = Envelope.model_validate(data)
    except ValidationError as exc:
        errors = [
            {"field": ".".join(str(p) for p in err["loc"])[:200], "message": err["msg"]}
            for err in exc.errors(include_input=False, include_url=False)
        ]
        raise InvalidEnvelope("the envelope is not valid", errors=errors) from None
    try:
        envelope.address  # noqa: B018  # parsed here, so a bad target is a 422 of its own
    except AddressInvalid as exc:
        raise InvalidEnvelope(
            "the target is not an agent address",
            code="target_invalid",
            errors=[{"field": "target", "message": str(exc)}],
        ) from None
    return envelope
