"""Which queue a request goes to: the most specific live capability on the name's prefix chain
that the caller's key allows, and, when several cards serve it, one card by weighted random
choice (seed 000 §3.3).

score = match x health x cost x weight, sampled in proportion, never always the top: the
lesser cards keep getting some traffic, so their health figures stay fresh.

``Rules`` narrow the candidates first: a card the caller's tenant may not see, or a revoked
version, never serves; a target keeps one agent (and its version, or its channel's
versions); an agent with a ``stable`` channel serves untargeted requests with that channel's
versions only. Where a channel governs an agent, its weights split the agent's traffic
between versions exactly as set (the instances of a version share its part). A hint sends
the request to the named instance's own queue while that instance may serve it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TypeVar

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from broker.registry.capabilities import any_pattern_allows, prefix_chain
from broker.registry.model import LEASE_PREFIX, READY, SUSPECT, CardRef, Lease, live_key, now_s

T = TypeVar("T")
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
    instance: str | None = None  # the hinted instance, when it took the request


Shares = Mapping[str, float]  # version -> weight


@dataclass(frozen=True)
class Rules:
    """What narrows a request's candidates beyond its capability (see the module docstring).
    ``tenant`` None applies no visibility (the read side's counts for operators)."""

    tenant: str | None = None
    revoked: frozenset[tuple[str, str]] = frozenset()
    stable: Mapping[str, Shares] = field(default_factory=dict)  # agent_id -> its stable channel
    agent_id: str | None = None  # a target's agent
    versions: Shares | None = None  # a target's version ({v: 1}) or channel; None: any
    hint: str | None = None

    def admits(self, card: CardRef) -> bool:
        return (
            (self.tenant is None or card.visible_to(self.tenant))
            and (card.agent_id, card.version) not in self.revoked
            and (self.agent_id is None or card.agent_id == self.agent_id)
        )

    def shares(self, agent_id: str) -> Shares | None:
        """The version weights that govern ``agent_id``'s traffic, if any."""
        return self.versions if self.agent_id is not None else self.stable.get(agent_id)

    def narrow(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        kept = []
        for c in candidates:
            if not self.admits(c.card):
                continue
            shares = self.shares(c.card.agent_id)
            if shares is None or shares.get(c.card.version, 0) > 0:
                kept.append(c)
        return kept

    def hinted(self, candidates: Sequence[Candidate], now: float) -> Candidate | None:
        """The hinted instance's candidate while it is ready (not draining, not late)."""
        if self.hint is None:
            return None
        return next(
            (
                c
                for c in candidates
                if c.lease.instance == self.hint and c.lease.observed_state(now) == READY
            ),
            None,
        )


NO_RULES = Rules()


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
    rules: Rules = NO_RULES,
) -> Candidate:
    """Weighted random choice by score; equal chances when every score is zero.

    In two steps that together are the plain choice by score: the agent, by the sum of its
    candidates' scores; then the candidate within it. An agent a channel governs takes the
    second step by version first, by the channel's weights, so the split between versions is
    the one set, whatever the count, health or warm-up of their instances."""
    pick = rng or random
    scored = [
        (c, score(c, requested=requested, now=now, success_rates=success_rates)) for c in candidates
    ]
    by_agent: dict[str, list[tuple[Candidate, float]]] = {}
    for c, s in scored:
        by_agent.setdefault(c.card.agent_id, []).append((c, s))
    agent_id = _weighted(pick, list(by_agent), [sum(s for _, s in g) for g in by_agent.values()])
    group = by_agent[agent_id]
    shares = rules.shares(agent_id)
    if shares is not None:
        versions = sorted({c.card.version for c, _ in group})
        version = _weighted(pick, versions, [shares.get(v, 0.0) for v in versions])
        group = [(c, s) for c, s in group if c.card.version == version]
    return _weighted(pick, [c for c, _ in group], [s for _, s in group])


def _weighted(pick: random.Random | ModuleType, items: list[T], weights: list[float]) -> T:
    if len(items) == 1:
        return items[0]
    if sum(weights) <= 0:
        weights = [1.0] * len(items)
    chosen: T = pick.choices(items, weights=weights, k=1)[0]
    return chosen


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
    rules: Rules = NO_RULES,
) -> Route | None:
    """The route for ``requested``, or None when no capability on its chain is both live and
    allowed by the key patterns ``allowed`` (a key allowed only ``text.summarize.fr`` must not
    reach the ``text.summarize`` agent by falling back), with a candidate ``rules`` admit.
    ``known``: (when, candidates) for ``requested`` itself, already read by the caller."""
    now = known[0] if known is not None else now_s()
    for capability in prefix_chain(requested):
        if not any_pattern_allows(allowed, capability):
            continue
        if known is not None and capability == requested:
            live = known[1]
        else:
            live = await live_candidates(redis, capability, now)
        candidates = rules.narrow(live)
        if not candidates:
            continue
        hinted = rules.hinted(candidates, now)
        if hinted is not None:
            return Route(
                capability=capability,
                queue=hinted.card.instance_queue(hinted.lease.instance),
                card=hinted.card,
                candidates=tuple(candidates),
                instance=hinted.lease.instance,
            )
        chosen = choose(
            candidates,
            requested=requested,
            now=now,
            success_rates=success_rates or {},
            rng=rng,
            rules=rules,
        )
        return Route(
            capability=capability,
            queue=capability if _one_card(live, rules) else chosen.card.queue(),
            card=chosen.card,
            candidates=tuple(candidates),
        )
    return None


def _one_card(live: Sequence[Candidate], rules: Rules) -> bool:
    """Whether the capability's own queue is the place: every live instance serves the one
    card, that card is every tenant's, and nothing pins the request to a version (a version
    started later would take from the capability's queue too). Otherwise the chosen card's
    queue. A card naming ``tenants`` does not take from the capability's queue
    (``CardRef.queues``): a task waiting there could be run by a private card started
    later, whichever tenant's it is."""
    distinct = {(c.card.agent_id, c.card.version, c.card.tenants) for c in live}
    if len(distinct) != 1 or rules.agent_id is not None:
        return False
    agent_id, _, tenants = next(iter(distinct))
    return tenants is None and agent_id not in rules.stable
