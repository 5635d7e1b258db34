"""Where agents register what they can do. Importing an agent module fills ``agent``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator

from broker.registry.capabilities import is_reserved, is_valid_name
from broker.registry.model import CARD_SCHEMA_VERSION, DEFAULT_LEASE_TTL_S
from broker.tasks.retry import DEFAULT_MAX_ATTEMPTS

if TYPE_CHECKING:
    from workers.sdk.context import Context

Handler = Callable[["Context", dict[str, Any]], Any]


Readiness = Callable[[], bool]


@dataclass(frozen=True)
class CapabilitySpec:
    name: str
    agent_id: str
    version: str
    handler: Handler
    input_schema: dict[str, Any] | None = None
    output_schema: dict[str, Any] | None = None
    timeout_s: float | None = None
    idempotent: bool = False
    streaming: bool = False
    cancellable: bool = False
    display_name: str | None = None
    description: str | None = None
    owner: str | None = None
    weight: float = 1.0
    tags: tuple[tuple[str, float], ...] = ()
    max_payload_bytes: int | None = None
    max_concurrency: int | None = None
    cost_per_call: float = 0.0
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    readiness: Readiness | None = None
    card: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def validator(self) -> Draft202012Validator | None:
        """The input schema's validator, built once per process (not once per task)."""
        return Draft202012Validator(self.input_schema) if self.input_schema else None

    def card_document(self) -> dict[str, Any]:
        """The card as it is advertised and stored (schema ``CARD_SCHEMA_VERSION``)."""
        return {
            "schema_version": CARD_SCHEMA_VERSION,
            "agent_id": self.agent_id,
            "capability": self.name,
            "version": self.version,
            "display_name": self.display_name or self.agent_id,
            "description": self.description,
            "owner": self.owner,
            "tags": [{"tag": self.name, "weight": self.weight}]
            + [{"tag": t, "weight": w} for t, w in self.tags],
            "input_schema": self.input_schema,
            "output_schema": self.output_schema,
            "constraints": {
                "max_payload_bytes": self.max_payload_bytes,
                "timeout_hint_ms": int(self.timeout_s * 1000) if self.timeout_s else None,
            },
            "max_concurrency": self.max_concurrency,
            "cost_per_call": self.cost_per_call,
            "idempotent": self.idempotent,
            "streaming": self.streaming,
            "cancellable": self.cancellable,
            "lease_ttl_s": self.lease_ttl_s,
            "max_attempts": self.max_attempts,
            "extra": self.card,
        }


class AgentRegistry:
    """The capabilities this process can serve, by name."""

    def __init__(self) -> None:
        self._specs: dict[str, CapabilitySpec] = {}

    def capability(
        self,
        name: str,
        *,
        agent_id: str,
        version: str = "0.1.0",
        input_schema: dict[str, Any] | None = None,
        output_schema: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        idempotent: bool = False,
        streaming: bool = False,
        cancellable: bool = False,
        display_name: str | None = None,
        description: str | None = None,
        owner: str | None = None,
        weight: float = 1.0,
        tags: dict[str, float] | None = None,
        max_payload_bytes: int | None = None,
        max_concurrency: int | None = None,
        cost_per_call: float = 0.0,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        readiness: Readiness | None = None,
        **card: Any,
    ) -> Callable[[Handler], Handler]:
        """Register ``handler(ctx, payload)`` as the agent serving capability ``name``.

        ``weight`` is the traffic weight among cards serving the same capability (a canary
        takes 0.05); ``readiness`` is called every lease renewal, and while it returns False
        the worker stops taking this capability's tasks.
        """
        if not is_valid_name(name):
            why = " (reserved for Celery, kombu or the broker)" if is_reserved(name) else ""
            raise ValueError(f"invalid capability name: {name!r}{why}")
        for schema in (input_schema, output_schema):
            if schema is not None:
                Draft202012Validator.check_schema(schema)
        if weight < 0 or cost_per_call < 0 or lease_ttl_s <= 0 or max_attempts < 1:
            raise ValueError("weight, cost_per_call >= 0; lease_ttl_s > 0; max_attempts >= 1")

        def register(handler: Handler) -> Handler:
            existing = self._specs.get(name)
            if existing is not None and existing.handler is not handler:
                raise ValueError(f"capability {name!r} is already served by {existing.agent_id}")
            self._specs[name] = CapabilitySpec(
                name=name,
                agent_id=agent_id,
                version=version,
                handler=handler,
                input_schema=input_schema,
                output_schema=output_schema,
                timeout_s=timeout_s,
                idempotent=idempotent,
                streaming=streaming,
                cancellable=cancellable,
                display_name=display_name,
                description=description or (handler.__doc__ or "").strip() or None,
                owner=owner,
                weight=weight,
                tags=tuple((tags or {}).items()),
                max_payload_bytes=max_payload_bytes,
                max_concurrency=max_concurrency,
                cost_per_call=cost_per_call,
                lease_ttl_s=lease_ttl_s,
                max_attempts=max_attempts,
                readiness=readiness,
                card=card,
            )
            return handler

        return register

    def get(self, name: str) -> CapabilitySpec | None:
        return self._specs.get(name)

    def __iter__(self) -> Iterator[CapabilitySpec]:
        return iter(list(self._specs.values()))


agent = AgentRegistry()
