"""A2A agents' cards: fetched, read, and turned into ours, one per skill.

An A2A agent is registered by the URL of its card and a capability prefix. Each skill on the
card becomes the capability ``<prefix>.<skill id>``: the id lowercased, each run of characters
our names do not allow made one ``-``, a dot kept as a segment's end; an id that still does
not make a name (one starting with a digit, one spelling a reserved name) is refused. The
skill's name and description become the card's; ``streaming`` is the agent card's. The
bridge calls the agent at the first interface on its card that it speaks (``interface``:
JSON-RPC or HTTP+JSON, at a protocol version the a2a-sdk speaks, the card's order being the
agent's preference), and checks its health by fetching the card.

That interface is checked against the networks agents may reach each time the card is read:
at registration with its host name looked up (``read``), by the bridge by its form and any
address written in it (``checked``; each connection the bridge makes is checked on its own
lookup). The a2a-sdk is given the card with that interface alone: given the whole card, it
picks one itself (one of protocol version 1.0 before the card's first), which nobody had
checked.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import aiohttp
from a2a.client.card_resolver import parse_agent_card
from a2a.client.client_factory import major_minor
from a2a.types import AgentCard, AgentInterface
from a2a.utils.constants import (
    PROTOCOL_VERSION_0_3,
    PROTOCOL_VERSION_CURRENT,
    VERSION_HEADER,
    TransportProtocol,
)
from google.protobuf.json_format import ParseError

from broker import jsoncodec
from broker.registry.capabilities import is_valid_name
from broker.registry.model import Card
from broker.remote.connections import JsonElements, guarded_session, read_body
from broker.remote.registration import (
    A2A,
    MAX_CAPABILITIES,
    EndpointCheck,
    EndpointNotAllowed,
    Registration,
    RegistrationInvalid,
    check_endpoint,
)
from broker.webhooks.ssrf import Guard

BINDINGS = (TransportProtocol.JSONRPC.value, TransportProtocol.HTTP_JSON.value)
MAX_CARD_BYTES = 2**20
# A card goes through protobuf in Python, on the loop every call of the bridge shares (about
# 0.7 us an element): 1 MiB of empty skills took 1.6 s, again after each round of failures
# and at every health check. 64 skills of 60 tags and 60 examples each are about 16,000.
MAX_CARD_ELEMENTS = 20_000
DESCRIPTION_MAX, DISPLAY_NAME_MAX = 2000, 128
_NOT_IN_NAMES = re.compile(r"[^a-z0-9_-]+")


class CardUnavailable(RegistrationInvalid):
    """The card could not be fetched, or what was fetched is not an agent card we can use."""


def capability_name(prefix: str, skill_id: str) -> str:
    """``<prefix>.<skill id>`` in our name grammar; RegistrationInvalid when no valid name
    comes of it."""
    segments = [_NOT_IN_NAMES.sub("-", s).strip("-") for s in skill_id.strip().lower().split(".")]
    name = ".".join([prefix, *segments])
    if not all(segments) or not is_valid_name(name):
        raise RegistrationInvalid(
            f"the skill id {skill_id[:100]!r} does not make a capability name under "
            f"{prefix!r} (lowercase segments starting with a letter)"
        )
    return name


def interface(card: AgentCard) -> AgentInterface | None:
    """The interface the bridge calls: the card's first it speaks, a binding of ``BINDINGS``
    at a protocol version the a2a-sdk speaks."""
    return next((i for i in card.supported_interfaces if _speaks(i)), None)


def _speaks(candidate: AgentInterface) -> bool:
    # The versions the a2a-sdk's ClientFactory takes: none given, or 0.3 and later.
    if candidate.protocol_binding not in BINDINGS:
        return False
    try:
        version = candidate.protocol_version
        return not version or major_minor(version) >= major_minor(PROTOCOL_VERSION_0_3)
    except ValueError:  # packaging's InvalidVersion
        return False


async def checked(guard: Guard, card: AgentCard, check: EndpointCheck | None = None) -> AgentCard:
    """The card with its ``interface`` alone, once that passes ``check`` (EndpointNotAllowed):
    by default the bridge's, ``check_endpoint``, which looks no name up."""
    called = interface(card)
    assert called is not None  # parse() refuses a card without one
    try:
        await (check or functools.partial(check_endpoint, guard))(called.url)
    except EndpointNotAllowed as exc:
        raise EndpointNotAllowed(f"the card's {called.protocol_binding} interface: {exc}") from None
    trimmed = AgentCard()
    trimmed.CopyFrom(card)
    trimmed.ClearField("supported_interfaces")
    trimmed.supported_interfaces.append(called)
    return trimmed


def parse(body: bytes) -> AgentCard:
    """The card in ``body``; CardUnavailable when it is not one the bridge can call."""
    if JsonElements().add(body, most=MAX_CARD_ELEMENTS) > MAX_CARD_ELEMENTS:
        raise CardUnavailable(f"the agent card holds more than {MAX_CARD_ELEMENTS} elements")
    try:
        card = parse_agent_card(jsoncodec.loads(body))
    except (ValueError, ParseError) as exc:  # jsoncodec's errors, nesting included
        raise CardUnavailable(f"not an agent card: {exc}") from None
    if interface(card) is None:
        raise CardUnavailable(
            "the agent card names no JSON-RPC or HTTP+JSON interface of protocol 0.3 or later"
        )
    return card


async def fetch(session: aiohttp.ClientSession, url: str, timeout_s: float) -> AgentCard:
    """GET the card (no redirects, at most ``MAX_CARD_BYTES``) within ``timeout_s``."""
    headers = {"Accept": "application/json", VERSION_HEADER: PROTOCOL_VERSION_CURRENT}
    try:
        async with session.get(
            url,
            headers=headers,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as answer:
            if answer.status != 200:
                raise CardUnavailable(f"the agent card URL answered {answer.status}")
            body = await read_body(answer, MAX_CARD_BYTES)
    except (aiohttp.ClientError, TimeoutError) as exc:
        reason = str(exc) or f"no answer within {timeout_s:g} s"
        raise CardUnavailable(f"the agent card could not be fetched: {reason}") from None
    if len(body) > MAX_CARD_BYTES:
        raise CardUnavailable("the agent card is larger than 1 MiB")
    return parse(body)


async def read(url: str, guard: Guard, timeout_s: float, vet: EndpointCheck) -> AgentCard:
    """The card at ``url`` as a registration reads it: the URL and the interface the bridge
    would call both pass ``vet``, registration's check (EndpointNotAllowed), and the card
    answers in time."""
    await vet(url)
    async with guarded_session(guard) as session:
        card = await fetch(session, url, timeout_s)
    return await checked(guard, card, vet)


def documents(agent_id: str, registration: Registration, card: AgentCard) -> list[dict[str, Any]]:
    """Our cards for the agent's skills, as stored: each names its skill in ``endpoint``."""
    prefix = registration.capability_prefix or ""
    if not is_valid_name(prefix):
        raise RegistrationInvalid(f"capability_prefix {prefix!r} is not a capability name")
    if not card.skills:
        raise RegistrationInvalid("the agent card lists no skills")
    if len(card.skills) > MAX_CAPABILITIES:
        raise RegistrationInvalid(f"the agent card lists more than {MAX_CAPABILITIES} skills")
    found: dict[str, str] = {}
    shown = []
    for skill in card.skills:
        name = capability_name(prefix, skill.id)
        if name in found:
            raise RegistrationInvalid(
                f"the skills {found[name]!r} and {skill.id!r} are both {name}"
            )
        found[name] = skill.id
        description = skill.description or registration.description or card.description
        ours = Card(
            capability=name,
            agent_id=agent_id,
            version=registration.version,
            streaming=card.capabilities.streaming,
            cancellable=True,  # CancelTask
            timeout_s=registration.timeout_s,
            max_concurrency=registration.max_concurrency,
            display_name=skill.name[:DISPLAY_NAME_MAX] or None,
            description=description[:DESCRIPTION_MAX] or None,
            tenants=tuple(registration.tenants) if registration.tenants else None,
        )
        shown.append({**ours.document(), "endpoint": {"protocol": A2A, "skill": skill.id}})
    return shown
