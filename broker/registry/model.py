"""Agent cards (durable, Postgres) and instance leases (live, Redis).

A card is what an agent declares about one capability (``Card``: the one list of its fields).

A worker instance holds one lease: ``reach:lease:<instance>``, a JSON document with a TTL,
renewed every TTL/3. For each capability it is ready to serve it also sits in the live index
``reach:live:<capability>``, a sorted set scored by *when its lease expires*. Readers take only
members whose score is in the future, so an index entry can never outlive its lease (the stale
secondary index of seed 004 §4.1): an instance killed with -9 drops out of routing the moment its
lease would have expired, whether or not anything cleaned the index.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields
from typing import Any

from broker.registry import schemas
from broker.registry.addresses import is_agent_id, is_version
from broker.registry.capabilities import is_reserved, is_valid_name
from broker.tasks.retry import DEFAULT_MAX_ATTEMPTS

CARD_SCHEMA_VERSION = 1
DEFAULT_LEASE_TTL_S = 30.0
LEASE_PREFIX = "reach:lease:"
LIVE_PREFIX = "reach:live:"
NOT_READY_PREFIX = "reach:not-ready:"
DRAIN_PREFIX = "reach:drain:"
REMOVED_PREFIX = "reach:removed:"
# Counts remote agents' registrations and removals: a bridge that sees it move checks them
# at once, rather than at its next tick (``workers.bridge.keeper``).
REGISTRATIONS_KEY = "reach:remote:registrations"
REMOVED_TTL_S = 600  # far longer than a bridge's tick, which may renew from a stale read

READY, NOT_READY, DRAINING, SUSPECT, OFFLINE = (
    "ready",
    "not_ready",
    "draining",
    "suspect",
    "offline",
)


def lease_key(instance: str) -> str:
    return LEASE_PREFIX + instance


def live_key(capability: str) -> str:
    return LIVE_PREFIX + capability


def not_ready_key(instance: str, capability: str) -> str:
    return f"{NOT_READY_PREFIX}{instance}:{capability}"


def drain_key(instance: str) -> str:
    return DRAIN_PREFIX + instance


def removed_key(instance: str) -> str:
    """Set while a removed remote agent's lease must not be renewed (``leases.renew``)."""
    return REMOVED_PREFIX + instance


# RabbitMQ's most for a queue's name (an AMQP short string). A longer one's declare failed:
# the bridge stopped, and every remote agent with it; a worker died at start.
QUEUE_NAME_MAX_BYTES = 255


def card_queue(capability: str, agent_id: str, version: str) -> str:
    """The queue of one card, used when several cards serve a capability and routing picks one.
    ``@`` cannot appear in a capability name, so it never collides with a capability queue."""
    return f"{capability}@{agent_id}@{version}"


def instance_queue(card_queue: str, instance: str) -> str:
    """The queue of one instance serving one card: where a hinted request goes (affinity).
    Agent ids and versions have no ``@``, so the instance is everything after the third."""
    return f"{card_queue}@{instance}"


def capability_of(queue: str) -> str:
    """The capability a queue serves: itself, or the part before ``@`` of a card queue."""
    return queue.partition("@")[0]


def instance_of(queue: str) -> str | None:
    """The instance of an instance queue; None for any other queue."""
    parts = queue.split("@", 3)
    return parts[3] if len(parts) == 4 else None


def home_queue(queue: str) -> str:
    """Where a task goes again (a retry, a lost worker's task): an instance queue's card
    queue, since that instance may be gone; any other queue itself."""
    parts = queue.split("@", 3)
    return "@".join(parts[:3]) if len(parts) == 4 else queue


def visible_to(tenants: tuple[str, ...] | list[str] | None, tenant: str) -> bool:
    """Whether a card naming ``tenants`` (None: every tenant) may be used and seen by
    ``tenant``."""
    return tenants is None or tenant in tenants


@dataclass(frozen=True)
class CardRef:
    """What a lease says about each card it serves: enough to route without Postgres."""

    agent_id: str
    version: str
    capability: str
    weight: float = 1.0
    cost_per_call: float = 0.0
    ready: bool = True
    tenants: tuple[str, ...] | None = None  # who may route to it; None: every tenant

    def queue(self) -> str:
        return card_queue(self.capability, self.agent_id, self.version)

    def instance_queue(self, instance: str) -> str:
        return instance_queue(self.queue(), instance)

    def queues(self, instance: str) -> tuple[str, ...]:
        """The queues ``instance`` takes this card's tasks from: the card's, its own (hints),
        and the capability's when the card is every tenant's. What waits in the capability's
        queue may be any tenant's task, so a card naming ``tenants`` never takes from it:
        routing sends its tenants' tasks to the card's queue (``routing``)."""
        own = (self.queue(), self.instance_queue(instance))
        return own if self.tenants is not None else (self.capability, *own)

    def visible_to(self, tenant: str) -> bool:
        return visible_to(self.tenants, tenant)


@dataclass(frozen=True)
class Card:
    """What an agent declares about one capability. Its fields are the card's, once: the SDK's
    ``@agent.capability`` takes them as keywords and ``document()`` is the card as advertised
    and stored (schema ``CARD_SCHEMA_VERSION``).

    ``weight`` is the traffic weight among cards serving the same capability (a canary takes
    0.05); ``tags`` are extra routing tags with their weights; ``tenants`` names the tenants
    that may route to the card and see it (None: every tenant); ``extra`` keeps any other
    field an agent declares, for the card's readers."""

    capability: str
    agent_id: str
    version: str = "0.1.0"
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
    tenants: tuple[str, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not is_valid_name(self.capability):
            why = (
                " (reserved for Celery, kombu or the broker)"
                if is_reserved(self.capability)
                else ""
            )
            raise ValueError(f"invalid capability name: {self.capability!r}{why}")
        if not is_agent_id(self.agent_id):
            raise ValueError(
                f"invalid agent id {self.agent_id!r}: 1-64 lowercase letters, digits, '-' or "
                "'_', starting with a letter or digit"
            )
        if not is_version(self.version):
            raise ValueError(
                f"invalid version {self.version!r}: it starts with a digit, then up to 63 of "
                "[0-9A-Za-z.+_-]"
            )
        check_tenants(self.tenants)
        for schema in (self.input_schema, self.output_schema):
            if schema is not None:
                schemas.check(schema)
        if self.input_schema is not None and not schemas.allows_objects(self.input_schema):
            raise ValueError("input_schema must allow an object: a task's payload is one")
        if (
            min(self.weight, self.cost_per_call) < 0
            or self.lease_ttl_s <= 0
            or self.max_attempts < 1
        ):
            raise ValueError("weight, cost_per_call >= 0; lease_ttl_s > 0; max_attempts >= 1")
        if self.max_concurrency is not None and (
            isinstance(self.max_concurrency, bool)
            or not isinstance(self.max_concurrency, int)
            or self.max_concurrency < 1
        ):
            raise ValueError("max_concurrency is a whole number of runs, at least 1")

    @classmethod
    def declare(cls, capability: str, **given: Any) -> Card:
        """A card from keywords: each of the card's fields by name (``tags`` as a mapping of
        tag to weight), and any other keyword kept in ``extra``."""
        known = {f.name for f in fields(cls)} - {"capability", "extra"}
        extra = {name: value for name, value in given.items() if name not in known}
        chosen = {name: value for name, value in given.items() if name in known}
        chosen["tags"] = tuple(dict(chosen.get("tags") or {}).items())
        if chosen.get("tenants") is not None:
            chosen["tenants"] = tuple(chosen["tenants"])
        return cls(capability=capability, **chosen, extra=extra)

    def ref(self) -> CardRef:
        return CardRef(
            self.agent_id,
            self.version,
            self.capability,
            self.weight,
            self.cost_per_call,
            tenants=self.tenants,
        )

    def document(self) -> dict[str, Any]:
        tags = [(self.capability, self.weight), *self.tags]
        return {
            "schema_version": CARD_SCHEMA_VERSION,
            "agent_id": self.agent_id,
            "capability": self.capability,
            "version": self.version,
            "display_name": self.display_name or self.agent_id,
            "description": self.description,
            "owner": self.owner,
            "tags": [{"tag": tag, "weight": weight} for tag, weight in tags],
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
            "tenants": list(self.tenants) if self.tenants is not None else None,
            "extra": self.extra,
        }


@dataclass(frozen=True)
class Lease:
    instance: str
    state: str
    heartbeat_at: float
    started_at: float
    lease_ttl_s: float
    hostname: str = ""
    pid: int = 0
    active: int = 0
    cards: tuple[CardRef, ...] = field(default_factory=tuple)

    @property
    def renew_every_s(self) -> float:
        return self.lease_ttl_s / 3

    def observed_state(self, now: float) -> str:
        """Its own state, unless a renewal is late: then ``suspect``."""
        if self.state in (READY, NOT_READY) and now - self.heartbeat_at > 1.5 * self.renew_every_s:
            return SUSPECT
        return self.state

    def to_json(self) -> str:
        data = {**self.__dict__, "cards": [c.__dict__ for c in self.cards]}
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Lease:
        data: dict[str, Any] = json.loads(raw)
        data["cards"] = tuple(_card_ref(c) for c in data.get("cards", []))
        return cls(**data)


def _card_ref(data: dict[str, Any]) -> CardRef:
    tenants = data.get("tenants")
    return CardRef(**{**data, "tenants": tuple(tenants) if tenants is not None else None})


TENANTS_MAX = 100


def check_tenants(tenants: tuple[str, ...] | None) -> None:
    """ValueError unless ``tenants`` is None or 1 to ``TENANTS_MAX`` tenant names."""
    if tenants is None:
        return
    if not tenants or len(tenants) > TENANTS_MAX:
        raise ValueError(f"tenants: 1 to {TENANTS_MAX} names (leave it out for every tenant)")
    # as a key's tenant is (``key_store``): a name no key can have (one holding a control
    # character, or white space at an end) made a card that was never routed to, with no
    # word at registration
    if not all(
        isinstance(t, str) and 0 < len(t) <= 64 and t.isprintable() and t == t.strip()
        for t in tenants
    ):
        raise ValueError(
            "tenants: each a name of 1 to 64 printable characters, with no white space at "
            "either end (as a key's tenant)"
        )


def now_s() -> float:
    return time.time()
