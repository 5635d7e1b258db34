"""Which queue a request goes to: the most specific live capability on the name's prefix chain
that the caller's key allows, and, when several cards serve it, one card by weighted random
choice (seed 000 §3.3).

score = match x health x cost x weight, sampled in proportion, never always the top: the
lesser cards keep getting some traffic, so their health figures stay fresh.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from broker.registry.capabilities import any_pattern_allows, prefix_chain
from broker.registry.model import LEASE_PREFIX, READY, SUSPECT, CardRef, Lease, live_key, now_s

EXACT_MATCH, PREFIX_MATCH = 1.0, 0.6
SUSPECT_FACTOR = 0.3
# A recovered instance takes traffic gradually: 0.2 for its first minute, 0.5 for the second.
WARMUP = ((60.0, 0.2), (120.0, 0.5))


@dataclass(frozen=True)
class Candidate:
    card: CardRef
    lease: Lease


@dataclass(frozen=True)
class Route:
    capability: str  # the capability that serves the request (may be a prefix of it)
    queue: str
    card: CardRef
    candidates: tuple[Candidate, ...]


def success_band(success_rate: float | None) -> float:
    """Health from the measured success rate: >= 99 % 1.0, >= 95 % 0.7, else 0.3."""
    if success_rate is None or success_rate >= 0.99:
        return 1.0
    return 0.7 if success_rate >= 0.95 else 0.3


def warmup_factor(age_s: float) -> float:
    return next((factor for limit, factor in WARMUP if age_s < limit), 1.0)


def score(
    candidate: Candidate,
    *,
    requested: str,
    now: float,
    success_rates: Mapping[tuple[str, str], float],
) -> float:
    card, lease = candidate.card, candidate.lease
    match = EXACT_MATCH if card.capability == requested else PREFIX_MATCH
    health = success_band(success_rates.get((card.agent_id, card.version)))
    if lease.observed_state(now) == SUSPECT:
        health *= SUSPECT_FACTOR
    cost = 1 / (1 + card.cost_per_call * 100)
    weight = card.weight * warmup_factor(now - lease.started_at)
    return match * health * cost * weight


def choose(
    candidates: Sequence[Candidate],
    *,
    requested: str,
    now: float,
    success_rates: Mapping[tuple[str, str], float],
    rng: random.Random | None = None,
) -> Candidate:
    """Weighted random choice by score; equal chances when every score is zero."""
    scores = [
        score(c, requested=requested, now=now, success_rates=success_rates) for c in candidates
    ]
    if sum(scores) <= 0:
        scores = [1.0] * len(candidates)
    return (rng or random).choices(list(candidates), weights=scores, k=1)[0]


def serving(lease: Lease, capability: str, now: float) -> CardRef | None:
    """The card this lease serves ``capability`` with, when it may take work now."""
    if lease.observed_state(now) not in (READY, SUSPECT):
        return None
    return next((c for c in lease.cards if c.capability == capability and c.ready), None)


# The live index and the leases it names, in one round trip (ZRANGEBYSCORE, then MGET). A Lua
# function, so that admission can run it in the same script as the rate limit.
LIVE_LEASES_LUA = """
local function live_leases(key, now, prefix)
  local names = redis.call('ZRANGEBYSCORE', key, now, '+inf')
  if #names == 0 then return {} end
  local keys = {}
  for i, name in ipairs(names) do keys[i] = prefix .. name end
  return redis.call('MGET', unpack(keys))
end
"""
_LIVE_LEASES = AsyncScript(
    None,  # type: ignore[arg-type]  # called with the client below; bytes need no encoder
    (LIVE_LEASES_LUA + "return live_leases(KEYS[1], ARGV[1], ARGV[2])").encode(),
)
_parsed: dict[bytes, Lease] = {}
PARSED_MAX = 4096


def _lease(raw: bytes) -> Lease:
    lease = _parsed.get(raw)
    if lease is None:
        if len(_parsed) >= PARSED_MAX:
            _parsed.clear()
        lease = _parsed[raw] = Lease.from_json(raw)
    return lease


async def live_candidates(redis: Redis, capability: str, now: float) -> list[Candidate]:
    raw = await _LIVE_LEASES(keys=[live_key(capability)], args=[now, LEASE_PREFIX], client=redis)
    return candidates_from(raw, capability, now)


def candidates_from(raw: list[bytes | None] | None, capability: str, now: float) -> list[Candidate]:
    """The candidates among the leases ``live_leases`` answered."""
    found: list[Candidate] = []
    for data in raw or ():
        if not data:  # a lease that expired after the index named it
            continue
        lease = _lease(data if isinstance(data, bytes) else str(data).encode())
        card = serving(lease, capability, now)
        if card is not None:
            found.append(Candidate(card=card, lease=lease))
    return found


async def resolve(
    redis: Redis,
    requested: str,
    *,
    allowed: Sequence[str],
    success_rates: Mapping[tuple[str, str], float] | None = None,
    rng: random.Random | None = None,
    known: tuple[float, list[Candidate]] | None = None,
) -> Route | None:
    """The route for ``requested``, or None when no capability on its chain is both live and
    allowed by the key patterns ``allowed`` (a key allowed only ``text.summarize.fr`` must not
    reach the ``text.summarize`` agent by falling back).
    ``known``: (when, candidates) for ``requested`` itself, already read by the caller."""
    now = known[0] if known is not None else now_s()
    for capability in prefix_chain(requested):
        if not any_pattern_allows(allowed, capability):
            continue
        if known is not None and capability == requested:
            candidates = known[1]
        else:
            candidates = await live_candidates(redis, capability, now)
        if not candidates:
            continue
        chosen = choose(
            candidates, requested=requested, now=now, success_rates=success_rates or {}, rng=rng
        )
        distinct_cards = {(c.card.agent_id, c.card.version) for c in candidates}
        # One card: the capability's own queue. Several: the chosen card's queue.
        queue = capability if len(distinct_cards) == 1 else chosen.card.queue()
        return Route(
            capability=capability, queue=queue, card=chosen.card, candidates=tuple(candidates)
        )
    return None
