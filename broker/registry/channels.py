"""Channels: an agent's named traffic splits between its versions, set by operators.

``PUT /agents/{agent_id}/channels/{channel}`` with ``{"versions": {"2.3.1": 90, "2.4.0": 10}}``.
A target ``<agent_id>@<channel>`` routes by the channel's weights; ``stable`` is also what
untargeted requests use once the agent has it (without one, every version serves by its
card's weight). Each version named must be one the agent has a card for and not revoked.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import agent_cards_table as cards
from broker.db.models import agent_channels_table as channels
from broker.db.models import agent_revocations_table as revocations
from broker.errors import InvalidEnvelope, NotFound
from broker.registry.addresses import VERSION, is_channel, is_version
from broker.timestamps import iso

MAX_VERSIONS = 16
MAX_WEIGHT = 1_000_000
# The body parse_weights accepts, for the OpenAPI document.
WEIGHTS_SCHEMA = {
    "type": "object",
    "required": ["versions"],
    "additionalProperties": False,
    "properties": {
        "versions": {
            "type": "object",
            "minProperties": 1,
            "maxProperties": MAX_VERSIONS,
            "propertyNames": {"pattern": f"^{VERSION.pattern}$"},
            "additionalProperties": {"type": "number", "minimum": 0, "maximum": MAX_WEIGHT},
            "not": {"additionalProperties": {"maximum": 0}},
            "description": "Weights of versions the agent has and that are not revoked;"
            " at least one above 0",
        }
    },
}


class ChannelInvalid(InvalidEnvelope):
    code = "channel_invalid"


def check_name(channel: str) -> None:
    if not is_channel(channel):
        raise ChannelInvalid(
            "a channel name is 1-63 of [a-z0-9_-], starting with a letter (a version starts "
            "with a digit)"
        )


def parse_weights(body: Any) -> dict[str, float]:
    """``{"versions": {version: weight}}`` -> the weights, or ChannelInvalid."""
    if not isinstance(body, dict) or set(body) != {"versions"}:
        raise ChannelInvalid('the body is {"versions": {"<version>": <weight>, ...}}')
    versions = body["versions"]
    if not isinstance(versions, dict) or not 0 < len(versions) <= MAX_VERSIONS:
        raise ChannelInvalid(f"versions: an object of 1 to {MAX_VERSIONS} versions")
    weights: dict[str, float] = {}
    for version, weight in versions.items():
        if not is_version(version):
            raise ChannelInvalid("versions: each key a version ([0-9][0-9A-Za-z.+_-]*)")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not 0 <= weight <= MAX_WEIGHT  # before ``float``: an int past 1e308 has none
        ):
            raise ChannelInvalid(f"versions: each weight a number from 0 to {MAX_WEIGHT}")
        weights[version] = float(weight)
    if sum(weights.values()) <= 0:
        raise ChannelInvalid("versions: at least one weight above 0")
    return weights


async def put(
    engine: AsyncEngine, agent_id: str, channel: str, weights: dict[str, float]
) -> dict[str, Any]:
    """Set the channel (NotFound ``agent_not_found`` for an agent with no card)."""
    known = select(cards.c.version).where(cards.c.agent_id == agent_id).distinct()
    gone = select(revocations.c.version).where(revocations.c.agent_id == agent_id)
    row = insert(channels).values(agent_id=agent_id, channel=channel, versions=weights)
    statement = row.on_conflict_do_update(
        index_elements=["agent_id", "channel"],
        set_={"versions": row.excluded.versions, "updated_at": func.now()},
    ).returning(channels.c.updated_at)
    async with engine.begin() as conn:
        versions = set((await conn.execute(known)).scalars())
        if not versions:
            raise NotFound("no such agent", code="agent_not_found")
        unknown = sorted(set(weights) - versions)
        if unknown:
            raise ChannelInvalid(f"the agent has no version {unknown[0]!r}")
        revoked = sorted(set(weights) & set((await conn.execute(gone)).scalars()))
        if revoked:
            raise ChannelInvalid(f"version {revoked[0]!r} is revoked")
        updated_at = (await conn.execute(statement)).scalar_one()
    return {"channel": channel, "versions": weights, "updated_at": iso(updated_at)}


async def remove(engine: AsyncEngine, agent_id: str, channel: str) -> bool:
    statement = delete(channels).where(
        channels.c.agent_id == agent_id, channels.c.channel == channel
    )
    async with engine.begin() as conn:
        return bool((await conn.execute(statement)).rowcount)


async def of_agent(engine: AsyncEngine, agent_id: str | None = None) -> dict[str, dict[str, Any]]:
    """agent_id -> channel -> {"versions", "updated_at"} (the read side)."""
    query = select(channels).order_by(channels.c.agent_id, channels.c.channel)
    if agent_id is not None:
        query = query.where(channels.c.agent_id == agent_id)
    found: dict[str, dict[str, Any]] = {}
    async with engine.connect() as conn:
        for r in await conn.execute(query):
            found.setdefault(r.agent_id, {})[r.channel] = {
                "versions": r.versions,
                "updated_at": iso(r.updated_at),
            }
    return found
