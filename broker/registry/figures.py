"""What the broker measured of agents and capabilities from the tasks they finished (never from
what an agent says of itself), over the last ``WINDOW_S`` seconds."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.cache import TimedCache
from broker.tasks.resource import SUCCEEDED

WINDOW_S = 300


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
