"""Agent cards (durable, Postgres) and instance leases (live, Redis).

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
from dataclasses import dataclass, field
from typing import Any

CARD_SCHEMA_VERSION = 1
DEFAULT_LEASE_TTL_S = 30.0
LEASE_PREFIX = "reach:lease:"
LIVE_PREFIX = "reach:live:"
NOT_READY_PREFIX = "reach:not-ready:"
DRAIN_PREFIX = "reach:drain:"

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


def card_queue(capability: str, agent_id: str, version: str) -> str:
    """The queue of one card, used when several cards serve a capability and routing picks one.
    ``@`` cannot appear in a capability name, so it never collides with a capability queue."""
    return f"{capability}@{agent_id}@{version}"


def capability_of(queue: str) -> str:
    """The capability a queue serves: itself, or the part before ``@`` of a card queue."""
    return queue.partition("@")[0]


@dataclass(frozen=True)
class CardRef:
    """What a lease says about each card it serves: enough to route without Postgres."""

    agent_id: str
    version: str
    capability: str
    weight: float = 1.0
    cost_per_call: float = 0.0
    ready: bool = True

    def queue(self) -> str:
        return card_queue(self.capability, self.agent_id, self.version)


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
        data["cards"] = tuple(CardRef(**c) for c in data.get("cards", []))
        return cls(**data)


def now_s() -> float:
    return time.time()
