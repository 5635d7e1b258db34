"""What the API reads about agents: cards, instances with their live state, capabilities with
figures measured from finished tasks (never from what an agent says of itself)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.models import agent_cards_table as cards
from broker.db.models import agent_instances_table as instances
from broker.keys import Principal
from broker.registry import OFFLINE, Lease, lease_key, now_s
from broker.tasks import SUCCEEDED
from broker.timestamps import iso

WINDOW_S = 300
CardKey = tuple[str, str, str]  # agent_id, version, capability


@dataclass
class TimedCache:
    """Values read from Postgres, trusted for ``ttl_s``: routing must not query per request."""

    ttl_s: float
    _entries: dict[Any, tuple[float, Any]] = field(default_factory=dict)

    def get(self, key: Any) -> tuple[bool, Any]:
        hit = self._entries.get(key)
        if hit is not None and hit[0] > time.monotonic():
            return True, hit[1]
        return False, None

    def put(self, key: Any, value: Any) -> Any:
        if len(self._entries) > 10_000:
            self._entries.clear()
        self._entries[key] = (time.monotonic() + self.ttl_s, value)
        return value


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


async def success_rates(engine: AsyncEngine, cache: TimedCache) -> dict[tuple[str, str], float]:
    """Per (agent_id, version): the share of tasks finished in the window that succeeded."""
    found, value = cache.get("success_rates")
    if found:
        return value  # type: ignore[no-any-return]
    query = text(
        "SELECT agent_id, agent_version, avg((status = :succeeded)::int) AS rate FROM tasks"
        " WHERE finished_at > now() - make_interval(secs => :window) AND agent_id IS NOT NULL"
        " GROUP BY agent_id, agent_version"
    ).bindparams(succeeded=SUCCEEDED)
    async with engine.connect() as conn:
        rows = (await conn.execute(query, {"window": WINDOW_S})).all()
    return cache.put(  # type: ignore[no-any-return]
        "success_rates", {(r.agent_id, r.agent_version): float(r.rate) for r in rows}
    )


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


async def capability_figures(engine: AsyncEngine, tenant: str) -> dict[str, dict[str, Any]]:
    """Per capability served, over the last five minutes of the tenant's finished tasks."""
    query = text(
        # A card queue is "<capability>@<agent>@<version>": figures are per capability.
        "SELECT split_part(queue, '@', 1) AS capability, count(*) AS tasks,"
        " avg((status = :succeeded)::int) AS success_rate,"
        " percentile_cont(0.5) WITHIN GROUP (ORDER BY run_s) AS p50_s,"
        " percentile_cont(0.95) WITHIN GROUP (ORDER BY run_s) AS p95_s"
        " FROM (SELECT *, extract(epoch FROM finished_at - started_at) AS run_s FROM tasks"
        "       WHERE finished_at > now() - make_interval(secs => :window)"
        "       AND tenant = :tenant AND started_at IS NOT NULL) AS finished GROUP BY 1"
    ).bindparams(succeeded=SUCCEEDED)
    async with engine.connect() as conn:
        rows = (await conn.execute(query, {"window": WINDOW_S, "tenant": tenant})).all()
    return {
        r.capability: {
            "tasks": r.tasks,
            "success_rate": round(float(r.success_rate), 4),
            "p50_run_s": round(float(r.p50_s), 4),
            "p95_run_s": round(float(r.p95_s), 4),
        }
        for r in rows
    }


async def known_capabilities(engine: AsyncEngine) -> dict[str, list[dict[str, Any]]]:
    query = select(cards.c.capability, cards.c.agent_id, cards.c.version)
    async with engine.connect() as conn:
        rows = (await conn.execute(query.order_by(cards.c.capability))).all()
    found: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        found.setdefault(r.capability, []).append({"agent_id": r.agent_id, "version": r.version})
    return found
