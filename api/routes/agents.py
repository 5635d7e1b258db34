"""``/agents`` and ``/capabilities``: who serves what, whether it is live, how it is doing."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from api.deps import authenticate
from api.schemas import ERROR_RESPONSES
from broker import catalog, routing
from broker.errors import Forbidden, NotFound
from broker.keys import Principal
from broker.registry import card_queue, drain_key, now_s

router = APIRouter(tags=["agents"])
Caller = Annotated[Principal, Depends(authenticate)]
DRAIN_FLAG_TTL_S = 24 * 3600


@router.get("/agents", responses=ERROR_RESPONSES)
async def list_agents(request: Request, caller: Caller) -> dict[str, Any]:
    """Every agent that advertised a card, with its instances and their state."""
    state = request.app.state
    return {"agents": await catalog.agents(state.engine, state.redis)}


@router.get("/agents/{agent_id}", responses=ERROR_RESPONSES)
async def get_agent(agent_id: str, request: Request, caller: Caller) -> dict[str, Any]:
    """An agent's cards and instances: state and seconds since the last heartbeat."""
    state = request.app.state
    found = await catalog.agents(state.engine, state.redis, agent_id=agent_id)
    if not found:
        raise NotFound("no such agent", code="agent_not_found")
    return found[0]


@router.post(
    "/agents/{agent_id}/instances/{instance}/drain", status_code=202, responses=ERROR_RESPONSES
)
async def drain_instance(
    agent_id: str, instance: str, request: Request, caller: Caller
) -> JSONResponse:
    """Stop an instance taking work; it finishes what it holds, then goes offline. Admin only."""
    if not caller.is_admin:
        raise Forbidden("draining needs an admin key", code="admin_required")
    state = request.app.state
    if not await catalog.instance_exists(state.engine, agent_id, instance):
        raise NotFound("no such instance of this agent", code="instance_not_found")
    await state.redis.set(drain_key(instance), "1", ex=DRAIN_FLAG_TTL_S)
    return JSONResponse({"instance": instance, "drain": "requested"}, status_code=202)


@router.get("/capabilities", responses=ERROR_RESPONSES)
async def list_capabilities(request: Request, caller: Caller) -> dict[str, Any]:
    """Each capability: live instances, queue depth, and figures from the last 5 minutes."""
    state = request.app.state
    known = await catalog.known_capabilities(state.engine)
    figures = await catalog.capability_figures(state.engine)
    now = now_s()
    queues = {
        capability: [
            capability,
            *(card_queue(capability, c["agent_id"], c["version"]) for c in served_by),
        ]
        for capability, served_by in known.items()
    }
    every_queue = [q for names in queues.values() for q in names]
    depths = await anyio.to_thread.run_sync(state.dispatcher.queue_depths, every_queue)
    result = []
    for capability, served_by in known.items():
        live = await routing.live_candidates(state.redis, capability, now)
        result.append(
            {
                "capability": capability,
                "cards": served_by,
                "live_instances": len(live),
                # The capability's queue plus its cards' queues.
                "queue_depth": sum(depths[q] for q in queues[capability]),
                "window_s": catalog.WINDOW_S,
                "measured": figures.get(
                    capability,
                    {"tasks": 0, "success_rate": None, "p50_run_s": None, "p95_run_s": None},
                ),
            }
        )
    return {"capabilities": result}
