"""Deciding, before anything is written, where a request goes and whether its payload fits.

Route to the most specific live capability the caller's key allows (see ``routing``); none is
503 ``no_agent_available`` unless the envelope asks to wait in the queue of a capability some
card has served (a name nobody ever served would only leave a list in Redis behind). The
payload is checked against the chosen card's input schema and size limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jsonschema import Draft202012Validator
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from sqlalchemy.ext.asyncio import AsyncEngine

from broker import catalog, jsonbody, metrics, routing
from broker.backpressure import BUCKET_LUA, TokenBucket
from broker.envelope import Envelope
from broker.errors import BadRequest, InvalidEnvelope, Unavailable
from broker.grouping import Grouped
from broker.registry import LEASE_PREFIX, live_key, now_s

NO_AGENT_RETRY_AFTER_S = 5
# The metric label of a capability no card has served: not a valid name, so never a real one,
# and one series however many names callers make up.
UNKNOWN_LABEL = "_unknown"
MAX_SCHEMA_ERRORS = 20

GROUP_MAX_REQUESTS = 100

# The door, in one Redis call for every request arriving together: per request, the tenant's
# token, then (if it got one) the live leases of the capability asked for. KEYS come in pairs
# (bucket, live index); a refused request reads nothing more.
_DOOR = AsyncScript(
    None,  # type: ignore[arg-type]  # called with the client; bytes need no encoder
    (
        BUCKET_LUA
        + routing.LIVE_LEASES_LUA
        + """
local rate, burst, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local answers = {}
for i = 0, #KEYS / 2 - 1 do
  local wait = take_token(KEYS[2 * i + 1], rate, burst, now)
  if wait > 0 then
    answers[i + 1] = {tostring(wait)}
  else
    answers[i + 1] = {'0', live_leases(KEYS[2 * i + 2], ARGV[3], ARGV[4])}
  end
end
return answers
"""
    ).encode(),
)


class Door:
    """The rate limit and the route lookup of requests arriving together, in one Redis call
    (``grouping``)."""

    def __init__(self, redis: Redis, bucket: TokenBucket) -> None:
        self.redis = redis
        self.bucket = bucket
        self._grouped = Grouped(
            self._many, max_items=GROUP_MAX_REQUESTS, name="door", retry_alone=False
        )

    async def enter(self, tenant: str, capability: str) -> tuple[float, list[routing.Candidate]]:
        """Take the tenant's token (or raise RateLimited); (when, live candidates) for the
        capability itself."""
        now, wait, leases = await self._grouped((tenant, capability))
        self.bucket.check(wait)
        return now, routing.candidates_from(leases, capability, now)

    async def _many(self, requests: list[tuple[str, str]]) -> list[tuple[float, float, Any]]:
        now = now_s()
        keys: list[str] = []
        for tenant, capability in requests:
            keys += [self.bucket.key(tenant), live_key(capability)]
        args: list[float | str] = [self.bucket.rate_per_s, self.bucket.burst, now, LEASE_PREFIX]
        answers = await _DOOR(keys=keys, args=args, client=self.redis)
        return [(now, float(a[0]), a[1] if len(a) > 1 else None) for a in answers]


async def admit(
    envelope: Envelope,
    *,
    tenant: str,
    allowed: Sequence[str],
    door: Door,
    engine: AsyncEngine,
    cache: catalog.TimedCache,
) -> str:
    """The queue to publish to; raises when the tenant is over its rate (429) or the request
    cannot be served as sent. ``allowed``: the caller's key patterns, which bound the fallback
    up the prefix chain as they bound the capability asked for."""
    known = await door.enter(tenant, envelope.capability)
    rates = await catalog.success_rates(engine, cache)
    route = await routing.resolve(
        door.redis, envelope.capability, allowed=allowed, success_rates=rates, known=known
    )
    if route is None:
        return await _unrouted(envelope, engine, cache)
    key = (route.card.agent_id, route.card.version, route.card.capability)
    document = await catalog.card(engine, cache, key)
    if document is not None:
        check_payload(document, envelope.payload, cache)
    return route.queue


async def _unrouted(envelope: Envelope, engine: AsyncEngine, cache: catalog.TimedCache) -> str:
    """The queue to wait in when nothing the key allows is live, or 503 no_agent_available.
    Read only on this path: a routed request costs no extra query."""
    served = envelope.capability in await catalog.served_capabilities(engine, cache)
    if envelope.queue_if_unavailable and served:
        return envelope.capability
    metrics.routing_failures.labels(envelope.capability if served else UNKNOWN_LABEL).inc()
    detail = "or a capability it falls back to" if served else "(no agent has ever served it)"
    raise Unavailable(
        f"no live agent serves {envelope.capability!r} {detail}",
        code="no_agent_available",
        retry_after_s=NO_AGENT_RETRY_AFTER_S,
    )


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
