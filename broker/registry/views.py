"""Agents and capabilities as the API shows them.

An agent: its cards and every instance that served it, with the instance's live state read
from its lease, narrowed to what a key is shown. A capability: who serves it, how many
instances are live, and what the broker measured of the caller's own tasks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from redis.asyncio import Redis
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import agent_cards_table as cards
from broker.db.models import agent_instances_table as instances
from broker.registry import figures, routing
from broker.registry.model import OFFLINE, Lease, lease_key, now_s
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


async def agents(
    engine: AsyncEngine, redis: Redis, agent_id: str | None = None
) -> list[dict[str, Any]]:
    """Each agent: its cards and every instance that served it, with live state."""
    card_query = select(cards).order_by(cards.c.agent_id, cards.c.capability, cards.c.version)
    if agent_id is not None:
        card_query = card_query.where(cards.c.agent_id == agent_id)
    async with engine.connect() as conn:
        card_rows = [dict(r._mapping) for r in await conn.execute(card_query)]
        instance_rows = [dict(r._mapping) for r in await conn.execute(select(instances))]
    live = await leases(redis, [r["instance"] for r in instance_rows])
    now = now_s()
    result: dict[str, dict[str, Any]] = {}
    for row in card_rows:
        entry = result.setdefault(
            row["agent_id"], {"agent_id": row["agent_id"], "cards": [], "instances": []}
        )
        entry["cards"].append(
            {
                **row["card"],
                "first_seen_at": iso(row["first_seen_at"]),
                "last_seen_at": iso(row["last_seen_at"]),
            }
        )
    for row in instance_rows:
        for served in {c["agent_id"] for c in row["cards"]} & result.keys():
            view = instance_view(row, live.get(row["instance"]), now)
            result[served]["instances"].append(view)
    for entry in result.values():
        entry["instances"].sort(key=lambda i: i["instance"])
        entry["live_instances"] = sum(i["state"] != OFFLINE for i in entry["instances"])
    return list(result.values())


INSTANCE_INTERNALS = ("instance", "hostname", "pid")


def seen_by(found: list[dict[str, Any]], caller: Principal) -> list[dict[str, Any]]:
    """Agents as this key is shown them. An operator key sees everything. Any other key sees
    only cards of capabilities its patterns allow (an agent with none is not shown), the
    instances that serve them, and no instance's name, host or process id."""
    if caller.is_admin:
        return found
    shown = []
    for agent in found:
        cards = [c for c in agent["cards"] if caller.may_see(c["capability"])]
        if not cards:
            continue
        views = []
        for view in agent["instances"]:
            served = [c for c in view["capabilities"] if caller.may_see(c)]
            if served:
                public = {k: v for k, v in view.items() if k not in INSTANCE_INTERNALS}
                views.append({**public, "capabilities": served})
        live = sum(v["state"] != OFFLINE for v in views)
        shown.append({**agent, "cards": cards, "instances": views, "live_instances": live})
    return shown


async def instance_exists(engine: AsyncEngine, agent_id: str, instance: str) -> bool:
    query = select(instances.c.cards).where(instances.c.instance == instance)
    async with engine.connect() as conn:
        served = (await conn.execute(query)).scalar_one_or_none()
    return served is not None and any(c["agent_id"] == agent_id for c in served)


NOTHING_MEASURED = {"tasks": 0, "success_rate": None, "p50_run_s": None, "p95_run_s": None}


async def capabilities(
    engine: AsyncEngine,
    redis: Redis,
    known: dict[str, list[dict[str, Any]]],
    tenant: str,
    depths: dict[str, int] | None,
) -> list[dict[str, Any]]:
    """Each capability of ``known`` (its cards): live instances, and figures from the last
    ``WINDOW_S`` of the tenant's tasks. ``depths`` (queue depth, shared by every tenant) is
    given for operator keys only."""
    measured = await figures.capability_figures(engine, tenant)
    now = now_s()
    shown = []
    for capability, served_by in known.items():
        view = {
            "capability": capability,
            "cards": served_by,
            "live_instances": len(await routing.live_candidates(redis, capability, now)),
            "window_s": figures.WINDOW_S,
            "measured": measured.get(capability, NOTHING_MEASURED),
        }
        if depths is not None:
            view["queue_depth"] = depths[capability]
        shown.append(view)
    return shown
