"""Revoked versions: taken out of routing for good (lifecycle ``revoked``).

Postgres holds them (``agent_revocations``), durably; Redis holds the same names in one set,
``REVOKED_KEY``, which every lease renewal reads in the transaction that writes the lease
(``leases.renew``): a revoked version's card is dropped from the lease and from the live
index, whichever worker or bridge renews it. A worker also reads Postgres when it starts,
and a bridge on every tick, so a Redis that lost the set does not bring a version back.
The API's routing reads Postgres through the routing cache (``policy``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from redis.asyncio import Redis
from sqlalchemy import Engine, Select, func, select, tuple_
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import agent_cards_table as cards
from broker.db.models import agent_revocations_table as revocations
from broker.errors import NotFound
from broker.timestamps import iso

REVOKED_KEY = "reach:revoked"


def agent_lock(agent_id: str) -> Select[Any]:
    """The statement that takes ``agent_id``'s revocation lock to the end of the transaction.
    A revocation and a registration of one agent take turns under it: a registration that
    read no revocation of its version before one was written would be stored, and never
    routed."""
    return select(func.pg_advisory_xact_lock(func.hashtext(f"revoke:{agent_id}")))


def member(agent_id: str, version: str) -> str:
    """The version's name in ``REVOKED_KEY``."""
    return f"{agent_id}@{version}"


async def revoke(
    engine: AsyncEngine, redis: Redis, agent_id: str, version: str, *, by: str
) -> dict[str, Any]:
    """Revoke a version some card of the agent has (else NotFound ``version_not_found``).
    Revoking again changes nothing and answers the first revocation."""
    known = select(cards.c.version).where(cards.c.agent_id == agent_id, cards.c.version == version)
    statement = (
        insert(revocations)
        .values(agent_id=agent_id, version=version, revoked_by=by)
        .on_conflict_do_nothing(index_elements=["agent_id", "version"])
    )
    read = select(revocations.c.revoked_at).where(
        revocations.c.agent_id == agent_id, revocations.c.version == version
    )
    async with engine.begin() as conn:
        await conn.execute(agent_lock(agent_id))
        if (await conn.execute(known.limit(1))).first() is None:
            raise NotFound("no such version of this agent", code="version_not_found")
        await conn.execute(statement)
        revoked_at: datetime = (await conn.execute(read)).scalar_one()
    await redis.sadd(REVOKED_KEY, member(agent_id, version))
    return {
        "agent_id": agent_id,
        "version": version,
        "lifecycle": "revoked",
        "revoked_at": iso(revoked_at),
    }


async def revoked_of(engine: AsyncEngine, agent_id: str) -> dict[str, datetime]:
    """The agent's revoked versions, with when (the read side)."""
    query = select(revocations.c.version, revocations.c.revoked_at).where(
        revocations.c.agent_id == agent_id
    )
    async with engine.connect() as conn:
        return {r.version: r.revoked_at for r in await conn.execute(query)}


def revoked_among(engine: Engine, versions: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which of these (agent_id, version) are revoked (a worker's or a bridge's check)."""
    if not versions:
        return set()
    query = select(revocations.c.agent_id, revocations.c.version).where(
        tuple_(revocations.c.agent_id, revocations.c.version).in_(versions)
    )
    with engine.connect() as conn:
        return {(r.agent_id, r.version) for r in conn.execute(query)}
