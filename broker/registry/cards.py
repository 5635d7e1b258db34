"""The cards agents have advertised, as the broker reads them: one card, the capabilities some
card has served, and who serves each capability."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.cache import TimedCache
from broker.db.models import agent_cards_table as cards

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
