"""Deciding, before anything is written, where a request goes and whether its payload fits.

Route to the most specific live capability (see ``routing``); none live is 503
``no_agent_available`` unless the envelope asks to wait in the queue. The payload is checked
against the chosen card's input schema and size limit.
"""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from sqlalchemy.ext.asyncio import AsyncEngine

from broker import catalog, jsonbody, metrics, routing
from broker.backpressure import BUCKET_LUA, TokenBucket
from broker.envelope import Envelope
from broker.errors import BadRequest, InvalidEnvelope, Unavailable
from broker.registry import LEASE_PREFIX, live_key, now_s

NO_AGENT_RETRY_AFTER_S = 5
MAX_SCHEMA_ERRORS = 20

# The door, in one Redis call: the tenant's token, then (if it got one) the live leases of the
# capability asked for. A refused request reads nothing more.
_DOOR = AsyncScript(
    None,  # type: ignore[arg-type]  # called with the client; bytes need no encoder
    (
        BUCKET_LUA
        + routing.LIVE_LEASES_LUA
        + """
local wait = take_token(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]))
if wait > 0 then return {tostring(wait)} end
return {'0', live_leases(KEYS[2], ARGV[4], ARGV[5])}
"""
    ).encode(),
)


async def admit(
    envelope: Envelope,
    *,
    tenant: str,
    bucket: TokenBucket,
    redis: Redis,
    engine: AsyncEngine,
    cache: catalog.TimedCache,
) -> str:
    """The queue to publish to; raises when the tenant is over its rate (429) or the request
    cannot be served as sent."""
    now = now_s()
    answer = await _DOOR(
        keys=[bucket.key(tenant), live_key(envelope.capability)],
        args=[*bucket.args(), now, LEASE_PREFIX],
        client=redis,
    )
    bucket.check(float(answer[0]))
    known = (now, routing.candidates_from(answer[1], envelope.capability, now))
    rates = await catalog.success_rates(engine, cache)
    route = await routing.resolve(redis, envelope.capability, success_rates=rates, known=known)
    if route is None:
        if envelope.queue_if_unavailable:
            return envelope.capability
        metrics.routing_failures.labels(envelope.capability).inc()
        raise Unavailable(
            f"no live agent serves {envelope.capability!r} or a capability it falls back to",
            code="no_agent_available",
            retry_after_s=NO_AGENT_RETRY_AFTER_S,
        )
    key = (route.card.agent_id, route.card.version, route.card.capability)
    document = await catalog.card(engine, cache, key)
    if document is not None:
        check_payload(document, envelope.payload, cache)
    return route.queue


def check_payload(document: dict[str, Any], payload: Any, cache: catalog.TimedCache) -> None:
    limit = (document.get("constraints") or {}).get("max_payload_bytes")
    if limit is not None:
        _, size = jsonbody.digest(payload)
        if size > limit:
            raise BadRequest(
                f"payload is {size} bytes; {document['agent_id']} takes at most {limit}",
                code="payload_too_large",
            )
    schema = document.get("input_schema")
    if not schema:
        return
    key = ("validator", document["agent_id"], document["version"], document["capability"])
    found, validator = cache.get(key)
    if not found:
        validator = cache.put(key, Draft202012Validator(schema))
    problems = sorted(validator.iter_errors(payload), key=lambda e: list(e.absolute_path))
    if problems:
        errors = [
            {
                "field": "/".join(str(p) for p in ("payload", *e.absolute_path)),
                "message": e.message[:300],
            }
            for e in problems[:MAX_SCHEMA_ERRORS]
        ]
        raise InvalidEnvelope(
            f"the payload does not match the input schema of {document['agent_id']}",
            code="payload_invalid",
            errors=errors,
        )
