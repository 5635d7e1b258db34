"""``/webhooks``: a tenant's subscriptions, their delivery log, and redelivery.

Every path is per tenant: another tenant's webhook or delivery is 404, like an unknown one.
Within the tenant a key reaches only subscriptions its patterns cover (whose ``capabilities``
filter lets through nothing the key may not see); a tenant-admin key reaches them all.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from api.contract import AUTHENTICATED, JSON_BODY, answers, header, json_body, model_schema
from api.deps import authenticate, metered, read_json_body
from api.paging import LIMIT_DEFAULT, Cursor, Limit
from api.schemas import Delivery, DeliveryPage, WebhookList, WebhookResource, WebhookWithSecret
from api.services import services
from broker import jsonbody
from broker.errors import BadRequest, Forbidden, NotFound
from broker.registry.capabilities import patterns_cover
from broker.tasks.resource import parse_task_id
from broker.tenancy.keys import Principal
from broker.webhooks import delivery_log, subscriptions
from broker.webhooks.subscriptions import WebhookSpec, render

router = APIRouter(tags=["webhooks"])
Caller = Annotated[Principal, Depends(authenticate)]
Metered = Annotated[Principal, Depends(metered)]  # routes that do real work take a token
SPEC_MAX_BYTES = 16 * 1024
REDELIVERY = answers(
    *AUTHENTICATED,
    404,
    409,
    s409="The webhook is disabled, the delivery cannot be sent again (delivery_not_redeliverable)"
    " or its message expired with the task (delivery_expired)",
)
REDELIVERED: dict[int | str, dict[str, Any]] = {
    202: {"description": "The delivery, sent once more", "model": Delivery}
}


def parse_id(raw: str, what: str) -> uuid.UUID:
    """A canonical UUID from the path, else 404 (an id we never issued does not exist)."""
    parsed = parse_task_id(raw)
    if parsed is None:
        raise NotFound(f"no such {what}", code=f"{what}_not_found")
    return parsed


def reaches(caller: Principal, webhook: dict[str, Any]) -> bool:
    """Whether the key's patterns cover everything the subscription's filter lets through."""
    return patterns_cover(caller.sees, webhook["capabilities"])


async def _webhook(request: Request, caller: Principal, raw_id: str) -> dict[str, Any]:
    """The subscription if this key reaches it, else 404 like an unknown one."""
    engine = services(request).engine
    found = await subscriptions.get(engine, caller.tenant, parse_id(raw_id, "webhook"))
    if found is None or not reaches(caller, found):
        raise NotFound("no such webhook", code="webhook_not_found")
    return found


async def _spec(request: Request) -> WebhookSpec:
    raw = await read_json_body(request, SPEC_MAX_BYTES)
    data = jsonbody.parse(raw, max_depth=8)
    try:
        return WebhookSpec.model_validate(data)
    except ValidationError as exc:
        errors = [
            {"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"]}
            for e in exc.errors(include_input=False, include_url=False)
        ]
        raise BadRequest(
            "the webhook is not valid", code="webhook_invalid", errors=errors
        ) from None


@router.post(
    "/webhooks",
    status_code=201,
    response_model=WebhookWithSecret,
    responses={
        201: {
            "description": "The subscription with its signing secret, shown once",
            "headers": {"Location": header("The subscription: /webhooks/{webhook_id}")},
        },
        **answers(
            *AUTHENTICATED,
            *JSON_BODY,
            403,
            422,
            s422="The webhook is not valid (webhook_invalid), its URL is not allowed"
            " (url_not_allowed), or the tenant has as many as it may (webhook_limit_reached)",
        ),
    },
    openapi_extra=json_body(model_schema(WebhookSpec)),
)
async def create_webhook(request: Request, caller: Metered) -> JSONResponse:
    """Subscribe a URL to task events (``url``, ``events``, ``capabilities`` patterns,
    ``description``). The answer holds the signing ``secret``: it is never shown again.
    A filter wider than the key's patterns (no filter: every capability) needs a tenant-admin
    key."""
    state = services(request)
    spec = await _spec(request)
    if not patterns_cover(caller.sees, spec.capabilities):
        raise Forbidden(
            "a webhook for capabilities outside this key's patterns needs a tenant-admin key",
            code="tenant_admin_required",
        )
    await state.lookups.vet(spec.url, allow=state.settings.webhook_allow, tenant=caller.tenant)
    row, secret = await subscriptions.create(
        state.engine,
        caller.tenant,
        spec,
        max_per_tenant=state.settings.webhook_max_per_tenant,
        turns=state.heavy_reads,
    )
    headers = {"Location": f"/webhooks/{row['id']}"}
    return JSONResponse({**render(row), "secret": secret}, status_code=201, headers=headers)


@router.get("/webhooks", response_model=WebhookList, responses=answers(*AUTHENTICATED))
async def list_webhooks(request: Request, caller: Caller) -> JSONResponse:
    """The subscriptions this key reaches (a tenant has at most a few dozen)."""
    rows = await subscriptions.list_for(services(request).engine, caller.tenant)
    return JSONResponse({"webhooks": [render(r) for r in rows if reaches(caller, r)]})


@router.get(
    "/webhooks/{webhook_id}",
    response_model=WebhookResource,
    responses=answers(*AUTHENTICATED, 404),
)
async def get_webhook(webhook_id: str, request: Request, caller: Caller) -> JSONResponse:
    return JSONResponse(render(await _webhook(request, caller, webhook_id)))


@router.delete("/webhooks/{webhook_id}", status_code=204, responses=answers(*AUTHENTICATED, 404))
async def delete_webhook(webhook_id: str, request: Request, caller: Caller) -> Response:
    """Remove the subscription and its delivery log; attempts still due are dropped."""
    # A filter never changes, so the subscription read is still the one removed.
    webhook = await _webhook(request, caller, webhook_id)
    if not await subscriptions.remove(services(request).engine, caller.tenant, webhook["id"]):
        raise NotFound("no such webhook", code="webhook_not_found")
    return Response(status_code=204)


@router.post(
    "/webhooks/{webhook_id}/rotate-secret",
    response_model=WebhookWithSecret,
    responses=answers(*AUTHENTICATED, 404),
)
async def rotate_secret(webhook_id: str, request: Request, caller: Metered) -> JSONResponse:
    """A new secret, shown once; the old one keeps signing (alongside) for the grace period."""
    state = services(request)
    webhook = await _webhook(request, caller, webhook_id)
    rotated = await subscriptions.rotate(
        state.engine,
        caller.tenant,
        webhook["id"],
        grace_s=state.settings.webhook_rotation_grace_s,
    )
    if rotated is None:
        raise NotFound("no such webhook", code="webhook_not_found")
    row, secret = rotated
    return JSONResponse({**render(row), "secret": secret})


@router.get(
    "/webhooks/{webhook_id}/deliveries",
    response_model=DeliveryPage,
    responses=answers(*AUTHENTICATED, 400, 404, 422),
)
async def webhook_deliveries(
    webhook_id: str,
    request: Request,
    caller: Caller,
    limit: Limit = LIMIT_DEFAULT,
    cursor: Cursor = None,
) -> JSONResponse:
    """Its deliveries, newest first, each with its latest 20 attempts (``attempt_count``
    counts them all): time, status code, error, latency and the address connected to."""
    state = services(request)
    webhook = await _webhook(request, caller, webhook_id)
    rows, next_cursor = await delivery_log.page(
        state.engine,
        caller.tenant,
        delivery_log.of_webhook(webhook["id"]),
        limit=min(limit, state.settings.list_page_max),
        cursor=cursor,
    )
    return JSONResponse({"deliveries": rows, "next_cursor": next_cursor})


@router.post(
    "/webhooks/{webhook_id}/deliveries/{delivery_id}/redeliver",
    status_code=202,
    responses={**REDELIVERED, **REDELIVERY},
)
async def redeliver(
    webhook_id: str, delivery_id: str, request: Request, caller: Metered
) -> JSONResponse:
    """Send a failed or dead delivery once more, with the same webhook-id and body."""
    webhook = await _webhook(request, caller, webhook_id)
    scope = delivery_log.of_webhook(webhook["id"])
    return await send_again(request, caller.tenant, parse_id(delivery_id, "delivery"), scope)


async def send_again(
    request: Request, tenant: str, delivery_id: uuid.UUID, scope: Any
) -> JSONResponse:
    """Redeliver within ``scope`` and answer with the delivery as it now stands."""
    state = services(request)
    scheduled = len(state.settings.webhook_schedule_s)
    attempt = await delivery_log.redeliver(
        state.engine, tenant, delivery_id, scope, scheduled=scheduled
    )
    # A publish lost here is not lost for good: the sweep republishes late deliveries.
    await anyio.to_thread.run_sync(state.dispatcher.deliver, delivery_id, attempt)
    rows, _ = await delivery_log.page(state.engine, tenant, delivery_log.only(delivery_id), limit=1)
    return JSONResponse(rows[0], status_code=202)
