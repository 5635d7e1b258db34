"""``/metrics`` for Prometheus. The gauges that describe the system rather than this process
(queue depth, the oldest queued task, registry health) are read when scraped."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from broker import catalog, metrics, routing
from broker.registry import now_s

router = APIRouter(tags=["health"])

OLDEST_QUEUED = text(
    "SELECT split_part(queue, '@', 1) AS capability,"
    " extract(epoch FROM now() - min(created_at)) AS age_s"
    " FROM tasks WHERE status = 'queued' GROUP BY 1"
)


@router.get("/metrics", response_class=Response)
async def prometheus_metrics(request: Request) -> Response:
    """Prometheus text format. Holds no tenant data: counts by route, capability and code."""
    state = request.app.state
    known = await catalog.known_capabilities(state.engine)
    depths = await anyio.to_thread.run_sync(state.dispatcher.queue_depths, sorted(known))
    async with state.engine.connect() as conn:
        ages = {r.capability: float(r.age_s) for r in await conn.execute(OLDEST_QUEUED)}
    now = now_s()
    live: set[str] = set()
    for capability in known:
        metrics.queue_depth.labels(capability).set(depths.get(capability, 0))
        metrics.queue_oldest_age.labels(capability).set(ages.get(capability, 0.0))
        live |= {
            c.lease.instance for c in await routing.live_candidates(state.redis, capability, now)
        }
    agents = await catalog.agents(state.engine, state.redis)
    registered = {i["instance"] for a in agents for i in a["instances"] if i["state"] != "offline"}
    metrics.registry_ready.set(len(live))
    metrics.registry_registered.set(len(registered | live))
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
