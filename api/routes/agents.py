"""``/agents`` and ``/capabilities``: who serves what, whether it is live, how it is doing."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from api.deps import authenticate
from api.schemas import ERROR_RESPONSES
from api.services import services
from broker.errors import Forbidden, NotFound
from broker.registry import cards, views
from broker.registry.model import card_queue, drain_key
from broker.tenancy.keys import Principal

router = APIRouter(tags=["agents"])
Caller = Annotated[Principal, Depends(authenticate)]
DRAIN_FLAG_TTL_S = 24 * 3600


@router.get("/agents", responses=ERROR_RESPONSES)
async def list_agents(request: Request, caller: Caller) -> dict[str, Any]:
    """Every agent that advertised a card, with its instances and their state. A key other
    than an operator's sees only agents of capabilities its patterns allow, and no instance's
    name, host or process id."""
    state = services(request)
    return {"agents": views.seen_by(await views.agents(state.engine, state.redis), caller)}


@router.get("/agents/{agent_id}", responses=ERROR_RESPONSES)
async def get_agent(agent_id: str, request: Request, caller: Caller) -> dict[str, Any]:
    """An agent's cards and instances: state and seconds since the last heartbeat."""
    state = services(request)
    found = await views.agents(state.engine, state.redis, agent_id=agent_id)
    found = views.seen_by(found, caller)
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
    state = services(request)
    if not await views.instance_exists(state.engine, agent_id, instance):
        raise NotFound("no such instance of this agent", code="instance_not_found")
    await state.redis.set(drain_key(instance), "1", ex=DRAIN_FLAG_TTL_S)
    return JSONResponse({"instance": instance, "drain": "requested"}, status_code=202)


@router.get("/capabilities", responses=ERROR_RESPONSES)
async def list_capabilities(request: Request, caller: Caller) -> dict[str, Any]:
    """Each capability the key's patterns allow: live instances, and figures from the last 5
    minutes of the caller's tenant's tasks. Queue depth, shared by every tenant, is shown to
    operator keys only."""
    state = services(request)
    known = await cards.known_capabilities(state.engine)
    shown = {capability: by for capability, by in known.items() if caller.may_see(capability)}
    depths = await _queue_depths(request, shown) if caller.is_admin else None
    found = await views.capabilities(state.engine, state.redis, shown, caller.tenant, depths)
    return {"capabilities": found}


async def _queue_depths(request: Request, known: dict[str, list[dict[str, Any]]]) -> dict[str, int]:
    """Per capability: its own queue plus its cards' queues."""
    queues = {
        capability: [
            capability,
            *(card_queue(capability, c["agent_id"], c["version"]) for c in served_by),
        ]
        for capability, served_by in known.items()
    }
    every_queue = [q for names in queues.values() for q in names]
    depths = await anyio.to_thread.run_sync(services(request).dispatcher.queue_depths, every_queue)
    return {capability: sum(depths[q] for q in names) for capability, names in queues.items()}
