"""The cards agents have advertised, as the broker reads them: one card, the capabilities some
card has served, who serves each capability, and the card a caller is shown of each."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import distinct_on
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.cache import TimedCache
from broker.db.models import agent_cards_table as cards
from broker.registry.capabilities import any_pattern_allows
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


async def served_capabilities(engine: AsyncEngine, cache: TimedCache) -> frozenset[str]:
    """Every capability a card has served. Only these may be queued for or named in a metric
    label: a name nobody serves must leave nothing behind (a list in Redis, a label series)."""
    found, value = cache.get("served_capabilities")
    if found:
        return value  # type: ignore[no-any-return]
    async with engine.connect() as conn:
        names = (await conn.execute(select(cards.c.capability).distinct())).scalars().all()
    return cache.put("served_capabilities", frozenset(names))  # type: ignore[no-any-return]


async def known_capabilities(engine: AsyncEngine) -> dict[str, list[dict[str, Any]]]:
    query = select(cards.c.capability, cards.c.agent_id, cards.c.version)
    async with engine.connect() as conn:
        rows = (await conn.execute(query.order_by(cards.c.capability))).all()
    found: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        found.setdefault(r.capability, []).append({"agent_id": r.agent_id, "version": r.version})
    return found


async def latest_cards(engine: AsyncEngine, cache: TimedCache) -> dict[str, dict[str, Any]]:
    """Each capability some card has served, with the card advertised last for it: what the
    protocol facades show a caller of a capability (its description and input schema)."""
    found, value = cache.get("latest_cards")
    if found:
        return value  # type: ignore[no-any-return]
    query = (
        select(cards.c.capability, cards.c.card)
        .ext(distinct_on(cards.c.capability))
        .order_by(cards.c.capability, cards.c.last_seen_at.desc(), cards.c.version.desc())
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    return cache.put("latest_cards", {r.capability: r.card for r in rows})  # type: ignore[no-any-return]


def offered(
    latest: Mapping[str, Mapping[str, Any]], caller: Principal
) -> dict[str, Mapping[str, Any]]:
    """Of ``latest_cards``, the capabilities ``caller`` may run: what the protocol facades
    offer a key (its A2A skills, its MCP tools)."""
    return {
        capability: card
        for capability, card in latest.items()
        if any_pattern_allows(caller.capabilities, capability)
    }
