"""Where agents register what they can do. Importing an agent module fills ``agent``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator

from broker.capabilities import is_valid_name

if TYPE_CHECKING:
    from workers.sdk.context import Context

Handler = Callable[["Context", dict[str, Any]], Any]


@dataclass(frozen=True)
class CapabilitySpec:
    name: str
    agent_id: str
    version: str
    handler: Handler
    input_schema: dict[str, Any] | None = None
    timeout_s: float | None = None
    idempotent: bool = False
    display_name: str | None = None
    description: str | None = None
    card: dict[str, Any] = field(default_factory=dict)

    def validator(self) -> Draft202012Validator | None:
        return Draft202012Validator(self.input_schema) if self.input_schema else None


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
        timeout_s: float | None = None,
        idempotent: bool = False,
        display_name: str | None = None,
        description: str | None = None,
        **card: Any,
    ) -> Callable[[Handler], Handler]:
        """Register ``handler(ctx, payload)`` as the agent serving capability ``name``."""
        if not is_valid_name(name):
            raise ValueError(f"invalid capability name: {name!r}")
        if input_schema is not None:
            Draft202012Validator.check_schema(input_schema)

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
                timeout_s=timeout_s,
                idempotent=idempotent,
                display_name=display_name,
                description=description or (handler.__doc__ or "").strip() or None,
                card=card,
            )
            return handler

        return register

    def get(self, name: str) -> CapabilitySpec | None:
        return self._specs.get(name)

    def __iter__(self) -> Iterator[CapabilitySpec]:
        return iter(list(self._specs.values()))


agent = AgentRegistry()
