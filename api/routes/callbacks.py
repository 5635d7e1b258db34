"""Per-task callbacks: the secret that signs them, and a task's deliveries.

A task's deliveries include its own callback and every subscription it matched. The secret is
the tenant's, so only a tenant-admin key sets it; a task's deliveries are seen by the keys
that see the task.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from api.contract import AUTHENTICATED, answers
from api.deps import authenticate, metered
from api.routes.webhooks import REDELIVERED, REDELIVERY, parse_id, reaches, send_again
from api.schemas import CallbackSecret, TaskDeliveries
from api.services import services
from broker.errors import Forbidden, NotFound
from broker.tasks import queries
from broker.tenancy.keys import Principal
from broker.timestamps import iso
from broker.webhooks import delivery_log, subscriptions
from broker.webhooks.subscriptions import rotate_callback_secret

router = APIRouter(tags=["webhooks"])
Caller = Annotated[Principal, Depends(authenticate)]
Metered = Annotated[Principal, Depends(metered)]  # routes that do real work take a token
TASK_DELIVERIES_MAX = 100


@router.post(
    "/callbacks/secret",
    status_code=201,
    response_model=CallbackSecret,
    responses=answers(*AUTHENTICATED, 403),
)
async def create_callback_secret(request: Request, caller: Metered) -> JSONResponse:
    """Create (or rotate) the secret that signs this tenant's task callbacks; shown once.
    After a rotation the previous secret keeps signing until ``previous_secret_expires_at``.
    Needs a tenant-admin key: the secret signs the callbacks of every task of the tenant."""
    if not caller.manages_tenant:
        raise Forbidden(
            "the callback secret is the tenant's: it needs a tenant-admin key",
            code="tenant_admin_required",
        )
    state = services(request)
    secret, previous_expires_at = await rotate_callback_secret(
        state.engine, caller.tenant, grace_s=state.settings.webhook_rotation_grace_s
    )
    body = {"secret": secret, "previous_secret_expires_at": iso(previous_expires_at)}
    return JSONResponse(body, status_code=201)


@router.get(
    "/tasks/{task_id}/deliveries",
    response_model=TaskDeliveries,
    responses=answers(*AUTHENTICATED, 404),
)
async def task_deliveries(task_id: str, request: Request, caller: Caller) -> JSONResponse:
    """Every delivery of the task's events (its callback and matching subscriptions), each
    with its attempts. Kept after the task itself expires, for the delivery log's lifetime."""
    state = services(request)
    tid, scope = await _deliveries_seen(request, caller, task_id)
    rows, _ = await delivery_log.page(state.engine, caller.tenant, scope, limit=TASK_DELIVERIES_MAX)
    if not rows and await queries.get_task(state.engine, caller.tenant, tid) is None:
        raise NotFound("no such task", code="task_not_found")
    return JSONResponse({"deliveries": rows})


@router.post(
    "/tasks/{task_id}/deliveries/{delivery_id}/redeliver",
    status_code=202,
    responses={**REDELIVERED, **REDELIVERY},
)
async def redeliver_for_task(
    task_id: str, delivery_id: str, request: Request, caller: Metered
) -> JSONResponse:
    """Send a failed or dead delivery of this task once more (its callback's too)."""
    _, scope = await _deliveries_seen(request, caller, task_id)
    return await send_again(request, caller.tenant, parse_id(delivery_id, "delivery"), scope)


async def _deliveries_seen(
    request: Request, caller: Principal, task_id: str
) -> tuple[uuid.UUID, Any]:
    """The task's id and which of its deliveries this key sees: all of them for a key that
    sees every capability. The log outlives the task but does not record its capability, so a
    key limited to some capabilities sees them only while it still sees the task, and only
    the task's callback and the subscriptions the key reaches; else 404."""
    tid = parse_id(task_id, "task")
    if "*" in caller.sees:
        return tid, delivery_log.of_task(tid)
    engine = services(request).engine
    if await queries.get_task(engine, caller.tenant, tid, patterns=caller.sees) is None:
        raise NotFound("no such task", code="task_not_found")
    webhooks = await subscriptions.list_for(engine, caller.tenant)
    return tid, delivery_log.of_task(tid, [w["id"] for w in webhooks if reaches(caller, w)])
