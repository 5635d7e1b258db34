"""Per-request dependencies: the app's services, the caller's key (and a rate token for the
routes that do work), and the body read within its size and time limits."""

from __future__ import annotations

import asyncio
from typing import Annotated

import anyio
from fastapi import Depends, Request
from starlette.requests import ClientDisconnect

from api.middleware import PLACE, Place
from api.services import services
from broker.errors import BadRequest, BodyTimeout, BodyTooLarge, Unauthenticated
from broker.tenancy.keys import Principal, secret_matches, split_token


async def authenticate(request: Request) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("an API key is required: Authorization: Bearer <key>")
    parts = split_token(token.strip())
    if parts is None:
        raise Unauthenticated("the API key is not valid")
    key_id, secret = parts
    state = services(request)
    client = request.client.host if request.client is not None else "unknown"
    row = await state.key_cache.get(state.engine, key_id, client=client)
    if row is None or not secret_matches(secret, row["secret_hash"]):
        raise Unauthenticated("the API key is not valid")
    state.tenant_of_key.remember(key_id, row["tenant"])
    place: Place | None = request.scope.get("state", {}).get(PLACE)
    if place is not None:  # from now on the request waits in its tenant's share
        place.move_to(row["tenant"])
    state.requests.take(row["tenant"])
    return Principal(
        key_id=key_id,
        tenant=row["tenant"],
        capabilities=tuple(row["capabilities"]),
        is_admin=row["is_admin"],
        tenant_admin=row["tenant_admin"],
    )


SMALL_BODY_BYTES = 4096  # a body this small that has arrived is read before the token


async def metered(
    request: Request, caller: Annotated[Principal, Depends(authenticate)]
) -> Principal:
    """The caller, once it has taken one of its tenant's tokens (429 ``rate_limited`` when
    none is left): for the routes that do real work, before their body is read."""
    await services(request).door.take(caller.tenant)
    return caller


async def read_metered_body(request: Request, caller: Principal, limit: int) -> tuple[bytes, bool]:
    """The body, and whether the tenant's token was taken (``metered``): a caller out of
    tokens is refused before its body is read, whatever the body does.

    Except for a small body already here whole: it is read in one step without waiting, and
    its token is then taken in the same Redis call as the route lookup (``Door.live``),
    one round trip fewer. Reading at most ``SMALL_BODY_BYTES`` that have arrived costs less
    than the authentication every refused request pays anyway, and a body still on its way
    is not waited for: the token comes first, as for any other body."""
    door = services(request).door
    declared = request.headers.get("content-length", "")
    if not (declared.isdigit() and int(declared) <= SMALL_BODY_BYTES):
        await door.take(caller.tenant)
        return await read_json_body(request, limit), True
    reading = asyncio.ensure_future(read_json_body(request, limit))
    await asyncio.sleep(0)  # a body that has arrived is read in this one step
    if reading.done() and reading.exception() is None:
        return reading.result(), False
    try:
        await door.take(caller.tenant)
    except BaseException:
        reading.cancel()
        raise
    return await reading, True


async def read_json_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it passes ``limit`` (before it is all in memory) or when
    it has not all arrived within ``body_read_timeout_s`` (408 ``body_timeout``)."""
    timeout_s = services(request).settings.body_read_timeout_s
    try:
        with anyio.fail_after(timeout_s):
            return await _read_within(request, limit)
    except TimeoutError:
        raise BodyTimeout(f"the body did not arrive within {timeout_s:g} s") from None


def media_type(request: Request, missing: str = "") -> str:
    """The request's media type, without parameters, lower-cased: media type names are
    case-insensitive (RFC 9110, 8.3.1), so ``Application/JSON`` is JSON too."""
    return request.headers.get("content-type", missing).split(";")[0].strip().lower()


async def _read_within(request: Request, limit: int) -> bytes:
    content_type = media_type(request, "application/json")
    if not (content_type == "application/json" or content_type.endswith("+json")):
        raise BadRequest("send the envelope as application/json", code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the body is larger than {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise BodyTooLarge(f"the body is larger than {limit} bytes")
    except ClientDisconnect:
        raise BadRequest(
            "the connection closed before the body was whole", code="body_incomplete"
        ) from None
    return bytes(body)
