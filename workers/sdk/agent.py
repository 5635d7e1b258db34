"""Where agents register what they can do. Importing an agent module fills ``agent``."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator

from broker.registry import schemas
from broker.registry.model import Card, capability_of

if TYPE_CHECKING:
    from workers.sdk.context import Context

# ``handler(ctx, payload)``: a function, a generator, an ``async def`` or an async generator.
Handler = Callable[["Context", dict[str, Any]], Any]


Readiness = Callable[[], bool]


@dataclass(frozen=True)
class CapabilitySpec:
    """A capability this process serves: its card, the handler, and its readiness check."""

    card: Card
    handler: Handler
    readiness: Readiness | None = None

    @property
    def name(self) -> str:
        return self.card.capability

    @cached_property
    def is_async(self) -> bool:
        """An ``async def`` handler or an async generator: it runs on the event loop."""
        return any(
            inspect.iscoroutinefunction(call) or inspect.isasyncgenfunction(call)
            for call in _calls_of(self.handler)
        )

    @cached_property
    def is_async_generator(self) -> bool:
        return any(inspect.isasyncgenfunction(call) for call in _calls_of(self.handler))

    @cached_property
    def validator(self) -> Draft202012Validator | None:
        """The input schema's validator, built once per process (not once per task)."""
        schema = self.card.input_schema
        return schemas.validator(schema) if schema else None


def _calls_of(handler: Handler) -> tuple[object, ...]:
    """What calling ``handler`` runs: itself, and an object's ``__call__`` (an instance of a
    class with ``async def __call__`` was taken for a sync handler, and its coroutine was
    returned unawaited as its result)."""
    call = inspect.getattr_static(type(handler), "__call__", None)
    return (handler, call)


class AgentRegistry:
    """The capabilities this process can serve, by name."""

    def __init__(self) -> None:
        self._specs: dict[str, CapabilitySpec] = {}

    def capability(
        self, name: str, *, readiness: Readiness | None = None, **card: Any
    ) -> Callable[[Handler], Handler]:
        """Register ``handler(ctx, payload)`` as the agent serving capability ``name``.

        The keywords are the card's fields (``broker.registry.model.Card``: ``agent_id`` is
        required; ``version``, ``input_schema``, ``timeout_s``, ``idempotent``, ``weight`` ...);
        any other keyword is kept in the card's ``extra``. The description defaults to the
        handler's docstring. ``readiness`` is called once a lease renewal, on a thread of its
        own (``workers.readiness``), and while it returns False (or raises, or has run longer
        than the lease's TTL) the worker stops taking this capability's tasks.
        """
        declared = Card.declare(name, **card)

        def register(handler: Handler) -> Handler:
            existing = self._specs.get(name)
            if existing is not None and existing.handler is not handler:
                raise ValueError(
                    f"capability {name!r} is already served by {existing.card.agent_id}"
                )
            doc = (handler.__doc__ or "").strip() or None
            described = dataclasses.replace(declared, description=declared.description or doc)
            self._specs[name] = CapabilitySpec(described, handler, readiness)
            return handler

        return register

    def get(self, name: str) -> CapabilitySpec | None:
        return self._specs.get(name)

    def for_queue(self, queue: str) -> CapabilitySpec | None:
        """The spec serving a message of ``queue``: a capability's queue or a card's."""
        return self.get(capability_of(queue))

    def __iter__(self) -> Iterator[CapabilitySpec]:
        return iter(list(self._specs.values()))


agent = AgentRegistry()
