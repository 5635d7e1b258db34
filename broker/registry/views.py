"""Agents and capabilities as the API shows them.

An agent: its cards and every instance that served it, with the instance's live state read
from its lease, its versions with their lifecycle (``revoked`` for good, else the best state
of the instances serving it), its channels; narrowed to what a key is shown. A capability:
who serves it, how many instances are live, and what the broker measured of the caller's own
tasks.

Visibility: a card naming ``tenants`` is shown only to keys of those tenants, and an agent
with no card shown is not shown at all (404 like one that does not exist). Operator keys
see every card: they manage the agents (routing still treats them as their tenant)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from redis.asyncio import Redis
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import agent_cards_table as cards
from broker.db.models import agent_instances_table as instances
from broker.registry import cards as stored_cards
from broker.registry import channels, figures, revocations, routing
from broker.registry.model import (
    DRAINING,
    NOT_READY,
    OFFLINE,
    READY,
    SUSPECT,
    Lease,
    lease_key,
    now_s,
    visible_to,
)
from broker.tenancy.keys import Principal
from broker.timestamps import iso


async def leases(redis: Redis, names: Iterable[str]) -> dict[str, Lease]:
    names = list(names)
    if not names:
        return {}
    raw = await redis.mget([lease_key(n) for n in names])
    return {n: Lease.from_json(r) for n, r in zip(names, raw, strict=True) if r is not None}


def instance_view(row: dict[str, Any], lease: Lease | None, now: float) -> dict[str, Any]:
    state = lease.observed_state(now) if lease is not None else OFFLINE
    heartbeat = lease.heartbeat_at if lease is not None else row["last_seen_at"].timestamp()
    return {
        "instance": row["instance"],
        "hostname": row["hostname"],
        "pid": row["pid"],
        "state": state,
        "seconds_since_heartbeat": round(max(0.0, now - heartbeat), 3),
        "active_tasks": lease.active if lease is not None else 0,
        "lease_ttl_s": row["lease_ttl_s"],
        "started_at": iso(row["started_at"]),
        "stopped_at": iso(row["stopped_at"]) if state == OFFLINE else None,
        "capabilities": sorted({c["capability"] for c in row["cards"]}),
    }


# The best state among a card's instances is its lifecycle (unless revoked).
_LIFECYCLE_ORDER = (READY, SUSPECT, NOT_READY, DRAINING, OFFLINE)
REVOKED = "revoked"


def _lifecycle(states: Iterable[str]) -> str:
    found = set(states)
    return next((s for s in _LIFECYCLE_ORDER if s in found), OFFLINE)


async def agents(
    engine: AsyncEngine, redis: Redis, agent_id: str | None = None
) -> list[dict[str, Any]]:
    """Each agent: its cards, versions, channels and every instance that served it, with
    live state."""
    card_query = select(cards).order_by(cards.c.agent_id, cards.c.capability, cards.c.version)
    instance_query = select(instances)
    if agent_id is not None:
        card_query = card_query.where(cards.c.agent_id == agent_id)
        # Only the rows of instances serving one of its cards, and only their leases read
        instance_query = instance_query.where(instances.c.cards.contains([{"agent_id": agent_id}]))
    async with engine.connect() as conn:
        card_rows = [dict(r._mapping) for r in await conn.execute(card_query)]
        instance_rows = [dict(r._mapping) for r in await conn.execute(instance_query)]
    live = await leases(redis, [r["instance"] for r in instance_rows])
    set_channels = await channels.of_agent(engine, agent_id)
    now = now_s()
    states: dict[tuple[str, str, str], list[str]] = {}
    result: dict[str, dict[str, Any]] = {}
    for row in instance_rows:
        lease = live.get(row["instance"])
        state = lease.observed_state(now) if lease is not None else OFFLINE
        listed = {(c.agent_id, c.version, c.capability) for c in lease.cards} if lease else set()
        for c in row["cards"]:
            key = (c["agent_id"], c["version"], c["capability"])
            # A card its live lease dropped (revoked) is not served there any more.
            states.setdefault(key, []).append(state if key in listed else OFFLINE)
    for row in card_rows:
        entry = result.setdefault(
            row["agent_id"], {"agent_id": row["agent_id"], "cards": [], "instances": []}
        )
        key = (row["agent_id"], row["version"], row["capability"])
        entry["cards"].append(
            {
                **row["card"],
                "lifecycle": _lifecycle(states.get(key, ())),
                "first_seen_at": iso(row["first_seen_at"]),
                "last_seen_at": iso(row["last_seen_at"]),
            }
        )
    for row in instance_rows:
        for served in {c["agent_id"] for c in row["cards"]} & result.keys():
            view = instance_view(row, live.get(row["instance"]), now)
            view[SERVES] = {
                (c["version"], c["capability"]) for c in row["cards"] if c["agent_id"] == served
            }
            result[served]["instances"].append(view)
    for entry in result.values():
        revoked = await revocations.revoked_of(engine, entry["agent_id"])
        _mark_revoked(entry, revoked)
        entry["channels"] = set_channels.get(entry["agent_id"], {})
        entry["instances"].sort(key=lambda i: i["instance"])
        entry["live_instances"] = sum(i["state"] != OFFLINE for i in entry["instances"])
    return list(result.values())


def _mark_revoked(entry: dict[str, Any], revoked: dict[str, Any]) -> None:
    """Each card of a revoked version is ``revoked``; ``versions`` sums the cards up."""
    by_version: dict[str, list[str]] = {}
    for card in entry["cards"]:
        if card["version"] in revoked:
            card["lifecycle"] = REVOKED
        by_version.setdefault(card["version"], []).append(card["lifecycle"])
    entry["versions"] = [
        {
            "version": version,
            "lifecycle": REVOKED if version in revoked else _lifecycle(found),
            "revoked_at": iso(revoked.get(version)),
        }
        for version, found in sorted(by_version.items())
    ]


# What a key other than an operator's is not shown of an instance: its name, host and process,
# and the tasks it holds (every tenant's, as a queue's depth is).
INSTANCE_INTERNALS = ("instance", "hostname", "pid", "active_tasks")
# An instance's view, until ``seen_by``: the (version, capability) cards of the agent it serves.
SERVES = "_serves"


def card_seen_by(card: dict[str, Any], caller: Principal) -> bool:
    """Whether this key is shown the card (and may name it): its tenant may use it and its
    patterns allow the capability. An operator key is shown every card."""
    return caller.is_admin or (
        caller.may_see(card["capability"]) and visible_to(card.get("tenants"), caller.tenant)
    )


def seen_by(found: list[dict[str, Any]], caller: Principal) -> list[dict[str, Any]]:
    """Agents as this key is shown them. An operator key sees everything. Any other key sees
    only cards its tenant may use of capabilities its patterns allow (an agent with none is
    not shown), the versions and channels of those cards, the instances that serve them, and
    no instance's name, host or process id, nor how many tasks it holds (every tenant's)."""
    if caller.is_admin:
        return [
            {**agent, "instances": [_without(v, SERVES) for v in agent["instances"]]}
            for agent in found
        ]
    shown = []
    for agent in found:
        # Without ``tenants``: which other tenants may use a card is theirs to know.
        cards = [
            {k: v for k, v in c.items() if k != "tenants"}
            for c in agent["cards"]
            if card_seen_by(c, caller)
        ]
        if not cards:
            continue
        seen_cards = {(c["version"], c["capability"]) for c in cards}
        versions = {version for version, _ in seen_cards}
        views = []
        for view in agent["instances"]:
            # An instance serving only versions the key is not shown is not shown either.
            served = sorted({capability for version, capability in view[SERVES] & seen_cards})
            if served:
                public = _without(view, SERVES, *INSTANCE_INTERNALS)
                views.append({**public, "capabilities": served})
        live = sum(v["state"] != OFFLINE for v in views)
        shown.append(
            {
                **agent,
                "cards": cards,
                "versions": [v for v in agent["versions"] if v["version"] in versions],
                "channels": _channels_seen(agent["channels"], versions),
                "instances": views,
                "live_instances": live,
            }
        )
    return shown


def _without(view: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in view.items() if k not in keys}


def _channels_seen(found: dict[str, dict[str, Any]], versions: set[str]) -> dict[str, Any]:
    """The channels with the weights of the versions shown; a channel of none of them is not
    shown at all (its name and when it changed are of those who may use its versions)."""
    shown = {}
    for name, channel in found.items():
        weights = {v: w for v, w in channel["versions"].items() if v in versions}
        if weights:
            shown[name] = {**channel, "versions": weights}
    return shown


async def instance_exists(engine: AsyncEngine, agent_id: str, instance: str) -> bool:
    query = select(instances.c.cards).where(instances.c.instance == instance)
    async with engine.connect() as conn:
        served = (await conn.execute(query)).scalar_one_or_none()
    return served is not None and any(c["agent_id"] == agent_id for c in served)


async def capabilities_shown(
    engine: AsyncEngine, caller: Principal
) -> dict[str, list[dict[str, Any]]]:
    """Each capability this key is shown, with its cards it is shown: one its patterns allow
    and some card its tenant may use serves. Any other reads as one nobody serves."""
    known = await stored_cards.known_capabilities(engine)
    allowed = {capability: by for capability, by in known.items() if caller.may_see(capability)}
    return capabilities_seen_by(allowed, caller)


def capabilities_seen_by(
    known: dict[str, list[dict[str, Any]]], caller: Principal
) -> dict[str, list[dict[str, Any]]]:
    """Each capability's cards (``cards.known_capabilities``) this key is shown; a capability
    with none is left out. Operators see each card's ``tenants``; others do not."""
    shown: dict[str, list[dict[str, Any]]] = {}
    for capability, served_by in known.items():
        seen = [c for c in served_by if card_seen_by({**c, "capability": capability}, caller)]
        if not caller.is_admin:
            seen = [{k: v for k, v in c.items() if k != "tenants"} for c in seen]
        if seen:
            shown[capability] = seen
    return shown


NOTHING_MEASURED = {"tasks": 0, "success_rate": None, "p50_run_s": None, "p95_run_s": None}


async def capabilities(
    engine: AsyncEngine,
    redis: Redis,
    known: dict[str, list[dict[str, Any]]],
    caller: Principal,
    depths: dict[str, int] | None,
    aggregates: figures.Aggregates,
) -> list[dict[str, Any]]:
    """Each capability of ``known`` (its cards, those this key is shown): live instances
    (of those cards), and figures from the last ``WINDOW_S`` of the tenant's tasks the key
    may read.
    ``depths`` (queue depth, shared by every tenant) is given for operator keys only."""
    tenant, sees = caller.tenant, tuple(sorted(caller.sees))
    measured = await aggregates.get(
        tenant, "figures", sees, lambda: figures.capability_figures(engine, tenant, sees)
    )
    rules = routing.Rules(tenant=None if caller.is_admin else caller.tenant)
    now = now_s()
    shown = []
    for capability, served_by in known.items():
        live = rules.narrow(await routing.live_candidates(redis, capability, now))
        view = {
            "capability": capability,
            "cards": served_by,
            "live_instances": len(live),
            "window_s": figures.WINDOW_S,
            "measured": measured.get(capability, NOTHING_MEASURED),
        }
        if depths is not None:
            view["queue_depth"] = depths[capability]
        shown.append(view)
    return shown
