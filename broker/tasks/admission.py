"""Deciding, before anything is written, where a request goes and whether its payload fits.

Route to the most specific live capability the caller's key allows (see ``routing``), by the
rules of the request (``policy``: its target, hint, channels, revoked versions, the cards its
tenant may use); none is 503 ``no_agent_available`` unless the envelope asks to wait in the
queue of a card that would serve it (a name nobody ever served would only leave a list in
Redis behind). The payload is checked against the chosen card's input schema and size limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from sqlalchemy.ext.asyncio import AsyncEngine

from broker import jsonbody
from broker.cache import TimedCache
from broker.errors import BadRequest, InvalidEnvelope, Unavailable
from broker.grouping import Grouped
from broker.observability import metrics
from broker.registry import cards, figures, policy, routing, schemas
from broker.registry.model import LEASE_PREFIX, live_key, now_s
from broker.tasks.backpressure import BUCKET_LUA, TokenBucket
from broker.tasks.envelope import Envelope

NO_AGENT_RETRY_AFTER_S = 5
# The metric label of a capability no card has served: not a valid name, so never a real one,
# and one series however many names callers make up.
UNKNOWN_LABEL = "_unknown"
MAX_SCHEMA_ERRORS = 20

GROUP_MAX_REQUESTS = 100

# The rate limit of requests arriving together, in one Redis call: a token per request.
_TOKENS = AsyncScript(
    None,  # type: ignore[arg-type]  # called with the client; bytes need no encoder
    (
        BUCKET_LUA
        + """
local rate, burst, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local waits = {}
for i, key in ipairs(KEYS) do waits[i] = tostring(take_token(key, rate, burst, now)) end
return waits
"""
    ).encode(),
)
# A tenant's token and then the live leases of a capability, for requests arriving together, in
# one Redis call: KEYS[2i-1] the bucket, KEYS[2i] the live index; {wait, leases} each, with no
# leases read for a request that got no token.
_METERED_LEASES = AsyncScript(
    None,  # type: ignore[arg-type]
    (
        BUCKET_LUA
        + routing.LIVE_LEASES_LUA
        + """
local rate, burst, now, prefix = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local answers = {}
for i = 1, #KEYS / 2 do
  local wait = take_token(KEYS[2 * i - 1], rate, burst, now)
  local leases = {}
  if wait == 0 then leases = live_leases(KEYS[2 * i], ARGV[3], prefix) end
  answers[i] = {tostring(wait), leases}
end
return answers
"""
    ).encode(),
)
# The live leases of the capabilities asked for together, in one Redis call.
_LEASES = AsyncScript(
    None,  # type: ignore[arg-type]
    (
        routing.LIVE_LEASES_LUA
        + """
local answers = {}
for i, key in ipairs(KEYS) do answers[i] = live_leases(key, ARGV[1], ARGV[2]) end
return answers
"""
    ).encode(),
)


class Door:
    """The two checks at the door, each grouped over the requests arriving together
    (``grouping``): the tenant's rate, taken before anything slow (reading the body, resolving
    a host name), and the capability's live leases, once the envelope is read. A request
    whose small body had already arrived whole takes both in one call (``live`` with
    ``metering``; ``api.deps.read_metered_body`` says why that is as safe)."""

    def __init__(self, redis: Redis, bucket: TokenBucket) -> None:
        self.redis = redis
        self.bucket = bucket
        self._tokens = Grouped(
            self._take_many, max_items=GROUP_MAX_REQUESTS, name="door", retry_alone=False
        )
        self._leases = Grouped(
            self._leases_many, max_items=GROUP_MAX_REQUESTS, name="leases", retry_alone=True
        )
        self._metered = Grouped(
            self._metered_many, max_items=GROUP_MAX_REQUESTS, name="door+leases", retry_alone=False
        )

    async def take(self, tenant: str) -> None:
        """Take one of the tenant's tokens, or raise RateLimited."""
        self.bucket.check(await self._tokens(tenant))

    async def live(
        self, capability: str, *, metering: str | None = None
    ) -> tuple[float, list[routing.Candidate]]:
        """(when, live candidates) for the capability itself. ``metering``: the tenant whose
        token is taken first, in the same Redis call (RateLimited when none is left)."""
        if metering is None:
            now, leases = await self._leases(capability)
        else:
            wait, now, leases = await self._metered((metering, capability))
            self.bucket.check(wait)
        return now, routing.candidates_from(leases, capability, now)

    async def _take_many(self, tenants: list[str]) -> list[float]:
        keys = [self.bucket.key(tenant) for tenant in tenants]
        args = [self.bucket.rate_per_s, self.bucket.burst, now_s()]
        return [float(w) for w in await _TOKENS(keys=keys, args=args, client=self.redis)]

    async def _metered_many(self, asks: list[tuple[str, str]]) -> list[tuple[float, float, Any]]:
        now = now_s()
        keys = [k for tenant, cap in asks for k in (self.bucket.key(tenant), live_key(cap))]
        args: list[float | str] = [self.bucket.rate_per_s, self.bucket.burst, now, LEASE_PREFIX]
        answers = await _METERED_LEASES(keys=keys, args=args, client=self.redis)
        return [(float(wait), now, leases) for wait, leases in answers]

    async def _leases_many(self, capabilities: list[str]) -> list[tuple[float, Any]]:
        now = now_s()
        keys = [live_key(capability) for capability in capabilities]
        answers = await _LEASES(keys=keys, args=[now, LEASE_PREFIX], client=self.redis)
        return [(now, leases) for leases in answers]


async def admit(
    envelope: Envelope,
    *,
    tenant: str,
    allowed: Sequence[str],
    door: Door,
    engine: AsyncEngine,
    cache: TimedCache,
    metered: bool = True,
) -> str:
    """The queue to publish to; raises when the request cannot be served as sent. The tenant's
    rate was taken before the body was read (``Door.take``), or, when not ``metered``, is
    taken here, in the call that reads the live leases. ``allowed``: the caller's key
    patterns, which bound the fallback up the prefix chain as they bound the capability asked
    for."""
    # First: a request whose token is taken here is refused before anything else is read.
    known = await door.live(envelope.capability, metering=None if metered else tenant)
    known_policy = await policy.current(engine, cache)
    rules = known_policy.rules(
        tenant=tenant, capability=envelope.capability, target=envelope.address, hint=envelope.hint
    )
    rates = await figures.success_rates(engine, cache)
    route = await routing.resolve(
        door.redis,
        envelope.capability,
        allowed=allowed,
        success_rates=rates,
        known=known,
        rules=rules,
    )
    if route is None:
        return await _unrouted(envelope, known_policy, rules, engine, cache)
    key = (route.card.agent_id, route.card.version, route.card.capability)
    document = await cards.card(engine, cache, key)
    if document is not None:
        check_payload(document, envelope.payload, cache)
    return route.queue


async def _unrouted(
    envelope: Envelope,
    known_policy: policy.Policy,
    rules: routing.Rules,
    engine: AsyncEngine,
    cache: TimedCache,
) -> str:
    """The queue to wait in when nothing the key allows is live, or 503 no_agent_available.
    Read only on this path: a routed request costs no extra query. A capability only cards
    the tenant may not see serve reads as one nobody ever served."""
    served = envelope.capability in await cards.served_capabilities(engine, cache)
    if envelope.queue_if_unavailable and served:
        waiting = known_policy.waiting_queue(rules, envelope.capability)
        if waiting is not None:
            return waiting
    metrics.routing_failures.labels(envelope.capability if served else UNKNOWN_LABEL).inc()
    seen = served and known_policy.serves(envelope.capability, rules.tenant)
    detail = "or a capability it falls back to" if seen else "(no agent has ever served it)"
    raise Unavailable(
        f"no live agent serves {envelope.capability!r} {detail}",
        code="no_agent_available",
        retry_after_s=NO_AGENT_RETRY_AFTER_S,
    )


def check_payload(document: dict[str, Any], payload: Any, cache: TimedCache) -> None:
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
        validator = cache.put(key, schemas.validator(schema))
    try:
        problems = schemas.problems(validator, payload)
    except schemas.PayloadUncheckable as exc:
        raise InvalidEnvelope(
            f"the payload cannot be checked against the input schema of "
            f"{document['agent_id']}: {exc}",
            code="payload_invalid",
        ) from None
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
