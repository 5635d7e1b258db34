"""Registering a remote agent: what a registration may say, and the rows it writes.

An operator registers an agent the broker reaches over the network (``PUT /agents/{id}``):
its version, its endpoint and the capabilities it serves. That writes the agent's row (with
the secret the broker signs its calls with, made once) and one card per capability, as a
worker's advertisement would: routing, ``/agents`` and ``/capabilities`` then treat it like
any other agent, once a bridge holds its lease.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from sqlalchemy import Engine, delete, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from broker.db.models import agent_cards_table as agent_cards
from broker.db.models import agent_revocations_table as revocations
from broker.db.models import remote_agents_table as remote_agents
from broker.errors import Conflict, Gone, InvalidEnvelope
from broker.registry import addresses, leases
from broker.registry.model import (
    QUEUE_NAME_MAX_BYTES,
    Card,
    card_queue,
    check_tenants,
    instance_queue,
)
from broker.registry.revocations import agent_lock
from broker.remote.connections import address_refused
from broker.webhooks import signing
from broker.webhooks.ssrf import URL_MAX, Guard, HostLookups, UrlNotAllowed, parse_url

HTTP, A2A = "http", "a2a"
VERSION = rf"^{addresses.VERSION.pattern}$"
MAX_CAPABILITIES = 64


def remote_instance(agent_id: str) -> str:
    """The name of the lease a bridge holds for the agent."""
    return f"{agent_id}@remote"


class RegistrationInvalid(InvalidEnvelope):
    code = "registration_invalid"


class EndpointNotAllowed(RegistrationInvalid):
    code = "endpoint_not_allowed"


def check_queue_names(agent_id: str, version: str, documents: Iterable[Mapping[str, Any]]) -> None:
    """422 ``registration_invalid`` when a queue the bridge would consume for one of these
    cards is past ``QUEUE_NAME_MAX_BYTES`` (RabbitMQ's): the longest, the agent's own under
    its card's. Held on any broker, so a registration does not depend on which one runs."""
    for document in documents:
        capability = document["capability"]
        longest = instance_queue(
            card_queue(capability, agent_id, version), remote_instance(agent_id)
        )
        if len(longest.encode()) > QUEUE_NAME_MAX_BYTES:
            raise RegistrationInvalid(
                f"the queue {capability}@{agent_id}@{version}@… would be "
                f"{len(longest.encode())} bytes, past the {QUEUE_NAME_MAX_BYTES} a queue's name "
                "may have: shorten the capability, the agent id or the version"
            )


class EndpointIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    protocol: Literal["http", "a2a"]
    url: str = Field(min_length=1, max_length=URL_MAX)


MAX_CONCURRENCY = 100_000
MAX_CONCURRENCY_SAYS = (
    "The most calls of the capability in flight at once from one bridge process (each bridge "
    "process holds its own); none: as many as the bridge's slots."
)


class CapabilityIn(BaseModel):
    """One capability an ``http`` agent serves: the card's fields a remote agent may set."""

    model_config = ConfigDict(extra="forbid")

    capability: str = Field(max_length=128)
    description: str | None = Field(None, max_length=2000)
    display_name: str | None = Field(None, max_length=128)
    input_schema: dict[str, Any] | None = None
    output_schema: dict[str, Any] | None = None
    timeout_s: float | None = Field(None, gt=0, le=3600)
    idempotent: bool = False
    streaming: bool = False
    max_attempts: int = Field(3, ge=1, le=20)
    weight: float = Field(1.0, ge=0, le=1000)
    max_payload_bytes: int | None = Field(None, gt=0)
    max_concurrency: int | None = Field(
        None, ge=1, le=MAX_CONCURRENCY, description=MAX_CONCURRENCY_SAYS
    )
    tenants: list[str] | None = Field(
        None, description="The tenants that may use and see it; the registration's otherwise."
    )


class Registration(BaseModel):
    """The body of ``PUT /agents/{agent_id}``."""

    model_config = ConfigDict(extra="forbid")

    version: str = Field(pattern=VERSION)
    endpoint: EndpointIn
    capabilities: list[CapabilityIn] | None = Field(None, min_length=1, max_length=MAX_CAPABILITIES)
    capability_prefix: str | None = Field(
        None,
        max_length=64,
        description="Required for an a2a endpoint (422 without): each skill of its card becomes "
        "the capability <capability_prefix>.<skill id>.",
    )
    description: str | None = Field(None, max_length=2000)
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="Each call's bound, for every capability that names none (an A2A agent's "
        "skills: all of them); REACH_DEFAULT_TASK_TIMEOUT_S otherwise.",
    )
    max_concurrency: int | None = Field(
        None,
        ge=1,
        le=MAX_CONCURRENCY,
        description=MAX_CONCURRENCY_SAYS + " For every capability that names none.",
    )
    tenants: list[str] | None = Field(
        None, description="The tenants that may use and see its cards (default: every tenant)."
    )

    @model_validator(mode="after")
    def _fits_protocol(self) -> Registration:
        if self.endpoint.protocol == HTTP and not self.capabilities:
            raise ValueError("an http agent lists the capabilities it serves")
        if self.endpoint.protocol == A2A and not self.capability_prefix:
            raise ValueError("an a2a agent needs a capability_prefix for its skills")
        if self.endpoint.protocol == A2A and self.capabilities:
            raise ValueError("an a2a agent's capabilities are the skills on its card")
        names = [c.capability for c in self.capabilities or []]
        if len(set(names)) != len(names):
            raise ValueError("a capability is listed twice")
        for tenants in [self.tenants, *(c.tenants for c in self.capabilities or [])]:
            check_tenants(_tenants(tenants))
        return self


def parse(agent_id: str, body: Any) -> Registration:
    """The registration, or RegistrationInvalid (422) saying what is wrong."""
    if not addresses.is_agent_id(agent_id):
        raise RegistrationInvalid(
            "an agent id is 1-64 lowercase letters, digits, '-' or '_', starting with a "
            "letter or digit"
        )
    try:
        return Registration.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '<body>'}: {e['msg']}" for e in exc.errors()[:10]
        )
        raise RegistrationInvalid(problems) from None


def cards_of(agent_id: str, registration: Registration) -> list[Card]:
    """The cards of an ``http`` agent's capabilities; RegistrationInvalid for a bad one."""
    cards = []
    for c in registration.capabilities or []:
        try:
            cards.append(
                Card(
                    capability=c.capability,
                    agent_id=agent_id,
                    version=registration.version,
                    input_schema=c.input_schema,
                    output_schema=c.output_schema,
                    timeout_s=c.timeout_s or registration.timeout_s,
                    idempotent=c.idempotent,
                    streaming=c.streaming,
                    cancellable=True,  # a cancel closes the call
                    display_name=c.display_name,
                    description=c.description or registration.description,
                    weight=c.weight,
                    max_payload_bytes=c.max_payload_bytes,
                    max_concurrency=c.max_concurrency or registration.max_concurrency,
                    max_attempts=c.max_attempts,
                    tenants=_tenants(c.tenants or registration.tenants),
                )
            )
        except SchemaError as exc:
            raise RegistrationInvalid(f"{c.capability}: invalid schema: {exc.message}") from None
        except ValueError as exc:  # the name, a limit
            raise RegistrationInvalid(f"{c.capability}: {exc}") from None
    return cards


def _tenants(given: list[str] | None) -> tuple[str, ...] | None:
    return tuple(given) if given is not None else None


# How a URL an agent is reached at is checked: registration's ``vet_endpoint`` (its name
# looked up), or the bridge's ``check_endpoint`` (its form only).
EndpointCheck = Callable[[str], Awaitable[None]]


async def check_endpoint(guard: Guard, url: str) -> None:
    """EndpointNotAllowed unless ``url`` has a form the broker calls and its host, when it is
    an address, is one agents may reach. A host name is not looked up: this is how the bridge
    checks a URL it reads from a card (at each health check, before calls), and every
    connection the bridge makes is checked on its own lookup (``GuardedConnector``). A lookup
    here ran in a thread that a name server that never answers held past any deadline,
    until the health checks had none left. Registration looks names up (``vet_endpoint``).
    Async, though it waits for nothing: it is an ``EndpointCheck``, as that one is."""
    try:
        host = parse_url(url).raw_host.decode("ascii")
    except UrlNotAllowed as exc:
        raise _not_allowed(exc.message) from None
    if address_refused(guard, host):
        raise _not_allowed(f"{host} is an address agents may not reach")


async def vet_endpoint(lookups: HostLookups, allow: Iterable[str], tenant: str, url: str) -> None:
    """EndpointNotAllowed unless ``url`` is one the broker may call, its host name looked up
    as the API looks up every URL it is given (``HostLookups``: threads of their own, each
    lookup within their timeout, RateLimited past a few of one tenant at once)."""
    try:
        await lookups.vet(url, allow=allow, tenant=tenant)
    except UrlNotAllowed as exc:
        raise _not_allowed(exc.message) from None


def _not_allowed(reason: str) -> EndpointNotAllowed:
    return EndpointNotAllowed(f"{reason}; REACH_AGENT_NETWORKS lists the networks agents may use")


def documents(cards: list[Card], protocol: str) -> list[dict[str, Any]]:
    """The cards as stored and shown: a worker's, plus how the agent is reached."""
    return [{**card.document(), "endpoint": {"protocol": protocol}} for card in cards]


@dataclass(frozen=True)
class Registered:
    agent_id: str
    version: str
    protocol: str
    url: str
    capability_prefix: str | None
    cards: list[dict[str, Any]]
    secret: str
    created: bool  # a new registration (the secret goes out once, then)

    def view(self) -> dict[str, Any]:
        """The agent as the API shows it; the secret only when it was just made."""
        shown: dict[str, Any] = {
            "agent_id": self.agent_id,
            "version": self.version,
            "endpoint": {"protocol": self.protocol, "url": self.url},
            "capabilities": [d["capability"] for d in self.cards],
            "instance": remote_instance(self.agent_id),
        }
        if self.capability_prefix is not None:
            shown["capability_prefix"] = self.capability_prefix
        if self.created:
            shown["secret"] = self.secret
        return shown


async def refuse_revoked(engine: AsyncEngine, agent_id: str, version: str) -> None:
    """410 ``version_revoked`` for a registration of a revoked version: accepted, it would
    never be routed (a revoked version is out for good). Asked before anything is written;
    ``register`` asks again under the agent's revocation lock."""
    async with engine.connect() as conn:
        await _refuse_revoked(conn, agent_id, version)


async def _refuse_revoked(conn: AsyncConnection, agent_id: str, version: str) -> None:
    revoked = select(revocations.c.agent_id).where(
        revocations.c.agent_id == agent_id, revocations.c.version == version
    )
    if (await conn.execute(revoked)).first() is not None:
        raise Gone(
            f"version {version} of {agent_id} is revoked: register another version",
            code="version_revoked",
        )


async def _refuse_workers_agent(conn: AsyncConnection, agent_id: str) -> None:
    """A worker advertises the cards of its agent (no endpoint): a registration under its id
    would write over them, and routing would take that agent for a remote one."""
    workers = select(agent_cards.c.agent_id).where(
        agent_cards.c.agent_id == agent_id, ~agent_cards.c.card.has_key("endpoint")
    )
    if (await conn.execute(workers.limit(1))).first() is not None:
        raise Conflict(
            f"{agent_id} is the agent of a worker: register the remote agent under another id",
            code="agent_conflict",
        )


async def register(
    engine: AsyncEngine,
    agent_id: str,
    registration: Registration,
    cards: list[dict[str, Any]],
) -> Registered:
    """Write the agent and its cards in one transaction. The secret is made on the first
    registration and kept by the next ones."""
    values = {
        "agent_id": agent_id,
        "version": registration.version,
        "protocol": registration.endpoint.protocol,
        "url": registration.endpoint.url,
        "capability_prefix": registration.capability_prefix,
        "cards": cards,
        "secret": signing.new_secret(),
    }
    insert_row = insert(remote_agents).values(values)
    upsert = insert_row.on_conflict_do_update(
        index_elements=["agent_id"],
        set_={
            **{k: insert_row.excluded[k] for k in values if k not in ("agent_id", "secret")},
            "updated_at": func.now(),
        },
    ).returning(
        remote_agents.c.secret,
        (remote_agents.c.created_at == remote_agents.c.updated_at).label("created"),
    )
    async with engine.begin() as conn:
        # A revocation of this version that lands meanwhile is seen (Gone), not stored beside
        await conn.execute(agent_lock(agent_id))
        await _refuse_revoked(conn, agent_id, registration.version)
        await _refuse_workers_agent(conn, agent_id)
        row = (await conn.execute(upsert)).one()
        if cards:
            await conn.execute(leases.card_upsert(cards))
    return Registered(
        agent_id=agent_id,
        version=registration.version,
        protocol=registration.endpoint.protocol,
        url=registration.endpoint.url,
        capability_prefix=registration.capability_prefix,
        cards=cards,
        secret=row.secret,
        created=bool(row.created),
    )


async def deregister(engine: AsyncEngine, agent_id: str) -> list[str] | None:
    """Remove the agent; the capabilities it served, or None when no such remote agent is
    registered. Its cards stay, as a stopped worker's do, for an operator to see what was
    there."""
    query = (
        delete(remote_agents)
        .where(remote_agents.c.agent_id == agent_id)
        .returning(remote_agents.c.cards)
    )
    async with engine.begin() as conn:
        documents = (await conn.execute(query)).scalar_one_or_none()
    return None if documents is None else [d["capability"] for d in documents]


@dataclass(frozen=True)
class RemoteAgent:
    """A registered agent as a bridge serves it."""

    agent_id: str
    version: str
    protocol: str
    url: str
    capability_prefix: str | None
    cards: tuple[Card, ...]
    secret: str
    skills: Mapping[str, str] = field(default_factory=dict)  # a2a: capability -> skill id


def load_all(engine: Engine) -> list[RemoteAgent]:
    """Every registered remote agent (the bridge's view, read every few seconds)."""
    with engine.connect() as conn:
        rows = conn.execute(select(remote_agents).order_by(remote_agents.c.agent_id)).all()
    return [
        RemoteAgent(
            agent_id=r.agent_id,
            version=r.version,
            protocol=r.protocol,
            url=r.url,
            capability_prefix=r.capability_prefix,
            cards=tuple(card_from_document(d) for d in r.cards),
            secret=r.secret,
            skills={
                d["capability"]: d["endpoint"]["skill"]
                for d in r.cards
                if "skill" in (d.get("endpoint") or {})
            },
        )
        for r in rows
    ]


def card_from_document(document: dict[str, Any]) -> Card:
    """The card a stored document describes (the fields a remote card sets)."""
    constraints = document.get("constraints") or {}
    timeout_ms = constraints.get("timeout_hint_ms")
    return Card(
        capability=document["capability"],
        agent_id=document["agent_id"],
        version=document["version"],
        input_schema=document.get("input_schema"),
        output_schema=document.get("output_schema"),
        timeout_s=timeout_ms / 1000 if timeout_ms else None,
        idempotent=bool(document.get("idempotent")),
        streaming=bool(document.get("streaming")),
        cancellable=bool(document.get("cancellable")),
        display_name=document.get("display_name"),
        description=document.get("description"),
        weight=float(document.get("tags", [{}])[0].get("weight", 1.0)),
        max_payload_bytes=constraints.get("max_payload_bytes"),
        max_concurrency=document.get("max_concurrency"),
        max_attempts=int(document.get("max_attempts") or 3),
        tenants=_tenants(document.get("tenants")),
    )
