"""The gauges that describe the system rather than this process: messages waiting and the
oldest queued task per capability, and the registry's ready and registered instances.

Computing them reads Postgres (queued tasks, every card and instance) and the broker (a
depth per queue), so each API process does it on a schedule, every ``metrics_refresh_s``, and
``/metrics`` serves the last figures: a scrape costs no query, and the figures are at most
that old. A failed refresh keeps the previous figures and is logged.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy import text

from api.services import Services
from broker.observability import metrics
from broker.registry import cards, routing, views
from broker.registry.model import now_s
from broker.tasks.resource import QUEUED

log = logging.getLogger("reach.metrics")

OLDEST_QUEUED = text(
    "SELECT split_part(queue, '@', 1) AS capability,"
    " extract(epoch FROM now() - min(created_at)) AS age_s"
    " FROM tasks WHERE status = :queued GROUP BY 1"
).bindparams(queued=QUEUED)


async def refresh(state: Services) -> None:
    """Set the system gauges from Postgres, Redis and the broker."""
    known = await cards.known_capabilities(state.engine)
    depths = await state.queue_bound.depths(sorted(known))  # as back-pressure reads them
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
    agents = await views.agents(state.engine, state.redis)
    registered = {i["instance"] for a in agents for i in a["instances"] if i["state"] != "offline"}
    metrics.registry_ready.set(len(live))
    metrics.registry_registered.set(len(registered | live))


async def keep_fresh(state: Services, every_s: float) -> None:
    """Refresh now, then every ``every_s``, until cancelled (the app's lifespan).
    ``state.gauges_refreshed_at``: when the last refresh ended (None before the first)."""
    state.gauges_refreshed_at = None
    while True:
        try:
            await refresh(state)
            state.gauges_refreshed_at = time.time()
            metrics.system_gauges_refreshed.set(state.gauges_refreshed_at)
        except Exception:
            log.exception("system gauges not refreshed; /metrics serves the previous figures")
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # A cancel that arrived in a refresh and was swallowed below it, by a library:
            # without this the loop goes on, and the app's shutdown waits for it forever.
            raise asyncio.CancelledError
        await asyncio.sleep(every_s)
