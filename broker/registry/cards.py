"""The cards agents have advertised, as the broker reads them: one card, the capabilities some
card has served, who serves each capability, and the card a caller is shown of each."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.cache import TimedCache
from broker.db.models import agent_cards_table as cards
from broker.registry.capabilities import any_pattern_allows
from broker.registry.model import visible_to
from broker.tenancy.keys import Principal

CardKey = tuple[str, str, str]  # agent_id, version, capability


async def card(engine: AsyncEngine, cache: TimedCache, key: CardKey) -> dict[str, Any] | None:
    found, value = cache.get(("card", key))
    if found:
        return value  # type: ignore[no-any-return]
    agent_id, version, capability = key
    query = select(cards.c.card).where(
        cards.c.agent_id == agent_id, cards.c.version == version, cards.c.capability == capability
    )
    async with engine.connect() as conn:
        document = (await conn.execute(query)).scalar_one_or_none()
    return cache.put(("card", key), document)  # type: ignore[no-any-return]


SERVED_KEY = "served_capabilities"


async def served_capabilities(engine: AsyncEngine, cache: TimedCache) -> frozenset[str]:
    """Every capability a card has served. Only these may be queued for or named in a metric
    label: a name nobody serves must leave nothing behind (a list in Redis, a label series)."""
    found, value = cache.get(SERVED_KEY)
    if found:
        return value  # type: ignore[no-any-return]
    async with engine.connect() as conn:
        names = (await conn.execute(select(cards.c.capability).distinct())).scalars().all()
    return cache.put(SERVED_KEY, frozenset(names))  # type: ignore[no-any-return]


async def known_capabilities(engine: AsyncEngine) -> dict[str, list[dict[str, Any]]]:
    """capability -> [{"agent_id", "version", "tenants"}] of every card."""
    query = select(cards.c.capability, cards.c.agent_id, cards.c.version, cards.c.card["tenants"])
    async with engine.connect() as conn:
        rows = (await conn.execute(query.order_by(cards.c.capability))).all()
    found: dict[str, list[dict[str, Any]]] = {}
    for capability, agent_id, version, tenants in rows:
        found.setdefault(capability, []).append(
            {"agent_id": agent_id, "version": version, "tenants": tenants}
        )
    return found


async def latest_cards(engine: AsyncEngine, cache: TimedCache) -> dict[str, list[dict[str, Any]]]:
    """Each capability some card has served, with its cards, the one advertised last first:
    what the protocol facades show a caller of a capability (``offered``)."""
    found, value = cache.get("latest_cards")
    if found:
        return value  # type: ignore[no-any-return]
    query = select(cards.c.capability, cards.c.card).order_by(
        cards.c.capability, cards.c.last_seen_at.desc(), cards.c.version.desc()
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    latest: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        latest.setdefault(row.capability, []).append(row.card)
    return cache.put("latest_cards", latest)  # type: ignore[no-any-return]


def offered(
    latest: Mapping[str, Sequence[Mapping[str, Any]]], caller: Principal
) -> dict[str, Mapping[str, Any]]:
    """Of ``latest_cards``, the capabilities ``caller`` may run, each with the newest card its
    tenant may see (a card's ``tenants``): what the protocol facades offer a key (its A2A
    skills, its MCP tools). A capability only hidden cards serve is not offered."""
    found: dict[str, Mapping[str, Any]] = {}
    for capability, documents in latest.items():
        if not any_pattern_allows(caller.capabilities, capability):
            continue
        visible = (d for d in documents if visible_to(d.get("tenants"), caller.tenant))
        if (document := next(visible, None)) is not None:
            found[capability] = document
    return found
