"""Deciding, before anything is written, where a request goes and whether its payload fits.

Route to the most specific live capability the caller's key allows (see ``routing``), by the
rules of the request (``policy``: its target, hint, channels, revoked versions, the cards its
tenant may use); none is 503 ``no_agent_available`` unless the envelope asks to wait in the
queue of a card that would serve it (a name nobody ever served would only leave a list in
Redis behind). The payload is checked against the chosen card's input schema and size limit;
one that waits in a queue, against the cards whose instances take from that queue (it fits
when one of them takes it). A payload of many values is checked on a thread (``Door.fit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
from jsonschema import Draft202012Validator
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from sqlalchemy.ext.asyncio import AsyncEngine

from broker import jsonbody
from broker.cache import TimedCache
from broker.errors import BadRequest, InvalidEnvelope, Unavailable
from broker.grouping import Grouped
from broker.observability import metrics
from broker.registry import cards, figures, policy, routing, schemas
from broker.registry.model import LEASE_PREFIX, card_queue, live_key, now_s
from broker.tasks.backpressure import BUCKET_LUA, TokenBucket
from broker.tasks.envelope import Envelope
from broker.tenancy.heavy import OneAtATime

NO_AGENT_RETRY_AFTER_S = 5
# The metric label of a capability no card has served: not a valid name, so never a real one,
# and one series however many names callers make up.
UNKNOWN_LABEL = "_unknown"
MAX_SCHEMA_ERRORS = 20
# A payload holding more values than this is checked against its schema on a thread. The check
# is pure Python, a few microseconds a value (a 1 MiB array of small integers: 1.8 s); on a
# thread the event loop still gets the GIL every switch interval, so no request waits for the
# whole check. Counted in values, not bytes, as the check costs (a long string is one value).
CHECK_ON_THREAD_VALUES = 2_000
# Such checks at once in this process, a tenant's one at a time. They share the GIL with the
# loop, so more would only take more of its turns; and they have tokens of their own, apart
# from the default ones the publishes to Celery wait for.
CHECKS_AT_ONCE = 2

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
    """The checks at the door. Two are grouped over the requests arriving together
    (``grouping``): the tenant's rate, taken before anything slow (reading the body, resolving
    a host name), and the capability's live leases, once the envelope is read. A request
    whose small body had already arrived whole takes both in one call (``live`` with
    ``metering``; ``api.deps.read_metered_body`` says why that is as safe). Then the payload
    against its card (``fit``)."""

    def __init__(self, redis: Redis, bucket: TokenBucket) -> None:
        self.redis = redis
        self.bucket = bucket
        self._checks = anyio.CapacityLimiter(CHECKS_AT_ONCE)
        self._check_turns = OneAtATime()
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

    async def fit(
        self, document: dict[str, Any], payload: Any, cache: TimedCache, *, tenant: str
    ) -> None:
        """BadRequest ``payload_too_large`` or InvalidEnvelope ``payload_invalid`` unless the
        payload fits the card; one of more than ``CHECK_ON_THREAD_VALUES`` values is checked
        on a thread, the tenant's one at a time."""
        checker = _fit_size(document, payload, cache)
        if checker is None:
            return
        if not jsonbody.more_values_than(payload, CHECK_ON_THREAD_VALUES):
            _check_schema(document, checker, payload)
            return
        async with self._check_turns.turn(tenant, "payload check"):
            await anyio.to_thread.run_sync(
                _check_schema, document, checker, payload, limiter=self._checks
            )

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
        waiting = await _unrouted(envelope, known_policy, rules, engine, cache)
        await _fit_waiting(envelope, waiting, known_policy, door, engine, cache, tenant=tenant)
        return waiting
    key = (route.card.agent_id, route.card.version, route.card.capability)
    document = await cards.card(engine, cache, key)
    if document is not None:
        await door.fit(document, envelope.payload, cache, tenant=tenant)
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
    if seen and rules.agent_id is None and rules.tenant is not None:
        pins = known_policy.stable_pins(envelope.capability, rules.tenant)
        detail += "".join(
            f"; the stable channel of {agent_id} routes only to {', '.join(versions) or '-'}"
            for agent_id, versions in pins.items()
        )
    raise Unavailable(
        f"no live agent serves {envelope.capability!r} {detail}",
        code="no_agent_available",
        retry_after_s=NO_AGENT_RETRY_AFTER_S,
    )


async def _fit_waiting(
    envelope: Envelope,
    queue: str,
    known_policy: policy.Policy,
    door: Door,
    engine: AsyncEngine,
    cache: TimedCache,
    *,
    tenant: str,
) -> None:
    """A payload waiting in ``queue`` fits one of the cards whose instances take from it
    (every card of the capability, for the capability's own queue), or is refused as the
    first of them refuses it. A schema and limit that refused it are not checked again."""
    capability = envelope.capability
    refused: list[tuple[Any, Any]] = []
    refusal: BadRequest | None = None
    for known in known_policy.cards:
        own = card_queue(capability, known.agent_id, known.version)
        if known.capability != capability or queue not in (capability, own):
            continue
        document = await cards.card(engine, cache, (known.agent_id, known.version, capability))
        if document is None:
            return  # gone since the policy was read: nothing to check against, as in admit
        rule = (document.get("input_schema"), document.get("constraints"))
        if rule in refused:
            continue
        try:
            await door.fit(document, envelope.payload, cache, tenant=tenant)
        except BadRequest as exc:  # payload_too_large, and InvalidEnvelope payload_invalid
            refused.append(rule)
            refusal = refusal or exc
        else:
            return
    if refusal is not None:
        raise refusal


def _fit_size(
    document: dict[str, Any], payload: Any, cache: TimedCache
) -> Draft202012Validator | None:
    """The validator of the card's input schema (None without one), once the payload is
    within the card's size limit (else BadRequest ``payload_too_large``)."""
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
        return None
    key = ("validator", document["agent_id"], document["version"], document["capability"])
    found, validator = cache.get(key)
    if not found:
        validator = cache.put(key, schemas.validator(schema))
    checker: Draft202012Validator = validator
    return checker


def _check_schema(document: dict[str, Any], validator: Draft202012Validator, payload: Any) -> None:
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
