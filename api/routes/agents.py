"""``/agents`` and ``/capabilities``: who serves what, whether it is live, how it is doing."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse, Response

from api.contract import AUTHENTICATED, JSON_BODY, answers, json_body, model_schema
from api.deps import authenticate, metered, read_json_body
from api.schemas import (
    AgentList,
    AgentResource,
    CapabilityList,
    CapabilitySeries,
    ChannelSet,
    DrainRequested,
    RemoteAgent,
    Revocation,
)
from api.services import services
from broker import jsonbody
from broker.errors import Forbidden, NotFound
from broker.registry import addresses, channels, figures, policy, revocations, views
from broker.registry.capabilities import NAME_MAX, NAME_PATTERN
from broker.registry.model import (
    REGISTRATIONS_KEY,
    REMOVED_TTL_S,
    card_queue,
    drain_key,
    lease_key,
    live_key,
    removed_key,
)
from broker.remote import a2a_card, registration
from broker.tenancy.keys import Principal
from broker.webhooks.ssrf import Guard

router = APIRouter(tags=["agents"])
Caller = Annotated[Principal, Depends(authenticate)]
Metered = Annotated[Principal, Depends(metered)]  # routes that do real work take a token
DRAIN_FLAG_TTL_S = 24 * 3600
INSTANCE_MAX = 255  # ``agent_instances.instance``
REGISTRATION_MAX_BYTES = 512 * 1024
CHANNEL_MAX_BYTES = 16 * 1024
# Path parameters as the grammar of ``broker.registry.addresses`` has them: anything else
# names nothing (404), or the database refused it (422 invalid_data).
AgentId = Annotated[str, Path(json_schema_extra={"pattern": f"^{addresses.AGENT_ID.pattern}$"})]
Version = Annotated[str, Path(json_schema_extra={"pattern": f"^{addresses.VERSION.pattern}$"})]
Channel = Annotated[str, Path(json_schema_extra={"pattern": f"^{addresses.CHANNEL.pattern}$"})]
CapabilityName = Annotated[
    str, Path(json_schema_extra={"pattern": NAME_PATTERN, "maxLength": NAME_MAX})
]
ADMIN = "Not an admin key (admin_required)"


def _nameable(agent_id: str) -> str:
    """``agent_id`` when an agent could have it; 404 ``agent_not_found`` otherwise, before
    any query (a NUL reached Postgres, which refuses it in text: 422 ``invalid_data``)."""
    if addresses.AGENT_ID.fullmatch(agent_id) is None:
        raise NotFound("no such agent", code="agent_not_found")
    return agent_id


def _named(text: str, fits: Callable[[str], bool], what: str) -> str:
    """``text`` when a version, channel or instance could be named so; 404 ``<what>_not_found``
    otherwise, before any query, as for ``_nameable``."""
    if not fits(text):
        raise NotFound(f"no such {what} of this agent", code=f"{what}_not_found")
    return text


def _an_instance(text: str) -> bool:
    """Whether a worker could be named ``text`` (its column's length, printable: no NUL)."""
    return 0 < len(text) <= INSTANCE_MAX and text.isprintable()


@router.get("/agents", response_model=AgentList, responses=answers(*AUTHENTICATED))
async def list_agents(request: Request, caller: Metered) -> JSONResponse:
    """Every agent that advertised a card, with its instances and their state. A key other
    than an operator's sees only agents of capabilities its patterns allow, and no instance's
    name, host, process id or count of tasks held (every tenant's)."""
    state = services(request)
    # Every card and every instance kept (``REACH_INSTANCE_RETENTION_S``): a token, and one
    # tenant's lists one at a time, as its task lists
    async with state.heavy_reads.turn(caller.tenant, "agents"):
        found = views.seen_by(await views.agents(state.engine, state.redis), caller)
    return JSONResponse({"agents": found})


@router.get(
    "/agents/{agent_id}",
    response_model=AgentResource,
    responses=answers(*AUTHENTICATED, 404, 422),
)
async def get_agent(agent_id: AgentId, request: Request, caller: Metered) -> JSONResponse:
    """An agent's cards and instances: state and seconds since the last heartbeat."""
    state = services(request)
    found = await views.agents(state.engine, state.redis, agent_id=_nameable(agent_id))
    found = views.seen_by(found, caller)
    if not found:
        raise NotFound("no such agent", code="agent_not_found")
    return JSONResponse(found[0])


@router.put(
    "/agents/{agent_id}/channels/{channel}",
    response_model=ChannelSet,
    responses=answers(
        *AUTHENTICATED,
        *JSON_BODY,
        403,
        404,
        422,
        s403=ADMIN,
        s422="The channel or its weights are not valid, or name a version the agent lacks or"
        " that is revoked (channel_invalid)",
    ),
    openapi_extra=json_body(channels.WEIGHTS_SCHEMA),
)
async def put_channel(
    agent_id: AgentId, channel: Channel, request: Request, caller: Caller
) -> JSONResponse:
    """Set a channel: ``{"versions": {"2.3.1": 90, "2.4.0": 10}}``, weights of versions the
    agent has and that are not revoked. A target ``<agent_id>@<channel>`` routes by it;
    ``stable`` is also what untargeted requests use. Admin only."""
    _require_admin(caller, "setting channels")
    channels.check_name(channel)
    state = services(request)
    raw = await read_json_body(request, CHANNEL_MAX_BYTES)
    weights = channels.parse_weights(jsonbody.parse(raw, max_depth=4))
    answer = await channels.put(state.engine, _nameable(agent_id), channel, weights)
    policy.forget(state.card_cache)
    return JSONResponse(answer)


@router.delete(
    "/agents/{agent_id}/channels/{channel}",
    status_code=204,
    responses=answers(*AUTHENTICATED, 403, 404, 422, s403=ADMIN),
)
async def delete_channel(
    agent_id: AgentId, channel: Channel, request: Request, caller: Caller
) -> Response:
    """Remove a channel (without ``stable``, every version serves by its card's weight).
    Admin only."""
    _require_admin(caller, "removing channels")
    state = services(request)
    agent_id, channel = _nameable(agent_id), _named(channel, addresses.is_channel, "channel")
    if not await channels.remove(state.engine, agent_id, channel):
        raise NotFound("no such channel of this agent", code="channel_not_found")
    policy.forget(state.card_cache)
    return Response(status_code=204)


@router.post(
    "/agents/{agent_id}/versions/{version}/revoke",
    response_model=Revocation,
    responses=answers(*AUTHENTICATED, 403, 404, 422, s403=ADMIN),
)
async def revoke_version(
    agent_id: AgentId, version: Version, request: Request, caller: Caller
) -> JSONResponse:
    """Take a version out of routing for good (lifecycle ``revoked``): no request is routed
    to it, a target naming it is 410 ``version_revoked``, and its instances' lease renewals
    drop it. There is no undo: deploy a new version. Admin only."""
    _require_admin(caller, "revoking versions")
    state = services(request)
    agent_id, version = _nameable(agent_id), _named(version, addresses.is_version, "version")
    answer = await revocations.revoke(
        state.engine, state.redis, agent_id, version, by=caller.key_id
    )
    policy.forget(state.card_cache)
    return JSONResponse(answer)


def _require_admin(caller: Principal, what: str) -> None:
    if not caller.is_admin:
        raise Forbidden(f"{what} needs an admin key", code="admin_required")


@router.post(
    "/agents/{agent_id}/instances/{instance}/drain",
    status_code=202,
    response_model=DrainRequested,
    responses=answers(*AUTHENTICATED, 403, 404, 422, s403=ADMIN),
)
async def drain_instance(
    agent_id: AgentId, instance: str, request: Request, caller: Caller
) -> JSONResponse:
    """Stop an instance taking work; it finishes what it holds, then goes offline. Admin only."""
    if not caller.is_admin:
        raise Forbidden("draining needs an admin key", code="admin_required")
    state = services(request)
    agent_id, instance = _nameable(agent_id), _named(instance, _an_instance, "instance")
    if not await views.instance_exists(state.engine, agent_id, instance):
        raise NotFound("no such instance of this agent", code="instance_not_found")
    await state.redis.set(drain_key(instance), "1", ex=DRAIN_FLAG_TTL_S)
    return JSONResponse({"instance": instance, "drain": "requested"}, status_code=202)


@router.put(
    "/agents/{agent_id}",
    responses={
        200: {"description": "Updated", "model": RemoteAgent},
        201: {
            "description": "Registered; the answer holds the secret, shown once",
            "model": RemoteAgent,
        },
        **answers(
            *AUTHENTICATED,
            *JSON_BODY,
            403,
            409,
            410,
            422,
            s403=ADMIN,
            s409="The id is a worker's agent (agent_conflict): a remote agent needs an id of its"
            " own",
            s410="The version was revoked (version_revoked): register another",
            s422="The registration is not valid (registration_invalid), its endpoint is not"
            " allowed or its host did not resolve in time (endpoint_not_allowed), or its card"
            " cannot be read",
        ),
    },
    openapi_extra=json_body(model_schema(registration.Registration)),
)
async def register_agent(agent_id: AgentId, request: Request, caller: Caller) -> JSONResponse:
    """Register (201) or update (200) an agent the broker reaches over the network: an
    ``http`` agent with the capabilities it lists, an ``a2a`` agent by its card's URL, each
    skill as ``<capability_prefix>.<skill id>``. The first answer carries ``secret``, once:
    the broker signs every call to the agent with it (Standard Webhooks headers). Admin
    only."""
    if not caller.is_admin:
        raise Forbidden("registering agents needs an admin key", code="admin_required")
    state = services(request)
    raw = await read_json_body(request, REGISTRATION_MAX_BYTES)
    given = registration.parse(agent_id, jsonbody.parse(raw, max_depth=32))
    allow = state.settings.agent_networks
    # Host names looked up in the API's lookup threads, each within REACH_DNS_TIMEOUT_S
    vet = functools.partial(registration.vet_endpoint, state.lookups, allow, caller.tenant)
    if given.endpoint.protocol == registration.A2A:
        card = await a2a_card.read(
            given.endpoint.url,
            Guard(allow=allow),
            timeout_s=state.settings.remote_health_timeout_s,
            vet=vet,
        )
        documents = a2a_card.documents(agent_id, given, card)
    else:
        cards = registration.cards_of(agent_id, given)
        documents = registration.documents(cards, given.endpoint.protocol)
        await vet(given.endpoint.url)
    registration.check_queue_names(agent_id, given.version, documents)
    await registration.refuse_revoked(state.engine, agent_id, given.version)
    # Renewals may go on (a removal before this one stopped them): see ``leases.renew``
    await state.redis.delete(removed_key(registration.remote_instance(agent_id)))
    registered = await registration.register(state.engine, agent_id, given, documents)
    policy.forget(state.card_cache)  # its cards route here at once, as a channel's change does
    await state.redis.incr(REGISTRATIONS_KEY)  # the bridges check it now, not at their next tick
    return JSONResponse(registered.view(), status_code=201 if registered.created else 200)


@router.delete(
    "/agents/{agent_id}",
    status_code=204,
    responses=answers(*AUTHENTICATED, 403, 404, 422, s403=ADMIN),
)
async def deregister_agent(agent_id: AgentId, request: Request, caller: Caller) -> Response:
    """Remove a remote agent: routing stops at once, the bridge stops calling it. Admin
    only; a worker's agent goes away by stopping its worker."""
    if not caller.is_admin:
        raise Forbidden("removing agents needs an admin key", code="admin_required")
    state = services(request)
    served = await registration.deregister(state.engine, _nameable(agent_id))
    if served is None:
        raise NotFound("no such remote agent", code="agent_not_found")
    instance = registration.remote_instance(agent_id)
    pipe = state.redis.pipeline(transaction=True)
    for capability in served:
        pipe.zrem(live_key(capability), instance)
    pipe.delete(lease_key(instance))
    # A bridge's renewal from a read before the removal is refused (``leases.renew``)
    pipe.set(removed_key(instance), 1, ex=REMOVED_TTL_S)
    pipe.incr(REGISTRATIONS_KEY)
    await pipe.execute()
    policy.forget(state.card_cache)  # a request only its cards serve is refused at once
    return Response(status_code=204)


@router.get("/capabilities", response_model=CapabilityList, responses=answers(*AUTHENTICATED))
async def list_capabilities(request: Request, caller: Caller) -> JSONResponse:
    """Each capability the key's patterns allow and some card its tenant may use serves: live
    instances, and figures from the last 5 minutes of the caller's tenant's tasks. Queue
    depth, shared by every tenant, is shown to operator keys only."""
    state = services(request)
    shown = await views.capabilities_shown(state.engine, caller)
    depths = await _queue_depths(request, shown) if caller.is_admin else None
    found = await views.capabilities(
        state.engine, state.redis, shown, caller, depths, state.aggregates
    )
    return JSONResponse({"capabilities": found})


@router.get(
    "/capabilities/{capability}/series",
    response_model=CapabilitySeries,
    responses=answers(
        *AUTHENTICATED,
        404,
        422,
        s404="No such capability, or none this key is shown (capability_not_found)",
        s422="window_s or step_s is not a whole number within its bounds (invalid_parameter)",
    ),
)
async def get_capability_series(
    capability: CapabilityName,
    request: Request,
    caller: Metered,  # an aggregate over up to a day of tasks: real work, a token
    window_s: Annotated[
        int,
        Query(
            ge=figures.SERIES_WINDOW_MIN_S,
            le=figures.SERIES_WINDOW_MAX_S,
            description="How far back, in seconds: the buckets cover at least this much",
        ),
    ] = figures.SERIES_WINDOW_S,
    step_s: Annotated[
        int,
        Query(
            ge=figures.SERIES_STEP_MIN_S,
            le=figures.SERIES_STEP_MAX_S,
            description="Each bucket's length in seconds; buckets start at multiples of it",
        ),
    ] = figures.SERIES_STEP_S,
) -> JSONResponse:
    """The caller's tenant's tasks of a capability over the last ``window_s`` (an hour), in
    buckets of ``step_s`` (a minute) by when they finished, oldest first, the last one still
    filling. Per bucket, and in ``total`` over them all: the tasks that ran, how many
    succeeded and failed, and p50/p95 of their run time (started to finished) and total time
    (accepted to finished); a bucket without tasks has zeros and null times. Shown for the
    capabilities ``GET /capabilities`` lists, and counted the same way (by the capability
    that served each task, of the tasks the key may read)."""
    state = services(request)
    if capability not in await views.capabilities_shown(state.engine, caller):
        raise NotFound("no such capability", code="capability_not_found")
    sees = tuple(sorted(caller.sees))
    series = await state.aggregates.get(
        caller.tenant,
        "series",
        (capability, window_s, step_s, sees),
        lambda: figures.capability_series(
            state.engine,
            caller.tenant,
            capability,
            window_s=window_s,
            step_s=step_s,
            patterns=sees,
        ),
    )
    return JSONResponse(series)


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
