"""What routing needs from Postgres beyond the leases, read at most once per cache period:
the cards (who may see each), the channels and the revoked versions (``Policy``). From it
and an envelope, ``rules`` makes the ``routing.Rules`` of one request, settling its target.

Answers to a target:

- a tenant in ``agent://<tenant>/...`` other than the caller's, an agent that does not exist,
  one whose cards this tenant may not see, or one that serves nothing on the capability's
  prefix chain: 404 ``agent_not_found``, all with the same body (it does not even echo the
  address, so no two of them can be told apart);
- a version it does not have: the same 404; a revoked version: 410 ``version_revoked``;
- a channel it does not have: 404 ``channel_not_found`` (``@stable`` without a ``stable``
  channel is any version);
- nothing live for it: 503 ``no_agent_available`` as for any request (or it waits in the
  card's queue with ``queue_if_unavailable``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sqlalchemy import cast, func, select
from sqlalchemy.dialects.postgresql import JSONPATH
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.cache import TimedCache
from broker.db.models import agent_cards_table as cards_table
from broker.db.models import agent_channels_table as channels
from broker.db.models import agent_revocations_table as revocations
from broker.db.models import remote_agents_table as remote
from broker.errors import Gone, NotFound
from broker.registry import cards
from broker.registry.addresses import STABLE, Target, version_order
from broker.registry.capabilities import prefix_chain
from broker.registry.model import card_queue, visible_to
from broker.registry.routing import Rules, Shares

CACHE_KEY = "routing_policy"


@dataclass(frozen=True)
class KnownCard:
    agent_id: str
    version: str
    capability: str
    tenants: tuple[str, ...] | None = None

    def visible_to(self, tenant: str) -> bool:
        return visible_to(self.tenants, tenant)


@dataclass(frozen=True)
class Policy:
    cards: tuple[KnownCard, ...] = ()
    channels: Mapping[str, Mapping[str, Shares]] = field(default_factory=dict)
    revoked: frozenset[tuple[str, str]] = frozenset()
    # (agent, version, capability) of the cards remote agents left behind: deregistered,
    # registered again at another version, or without that capability. Their cards stay, as
    # a stopped worker's do, but unlike a worker's nothing will ever serve them again.
    retired: frozenset[tuple[str, str, str]] = frozenset()

    def serves(self, capability: str, tenant: str | None) -> bool:
        """Whether a card of ``capability`` the tenant may see exists."""
        return any(
            c.capability == capability and (tenant is None or c.visible_to(tenant))
            for c in self.cards
        )

    def stable_pins(self, capability: str, tenant: str) -> dict[str, list[str]]:
        """The agents of ``capability`` the tenant may see whose ``stable`` channel is all
        an untargeted request reaches, with its versions the tenant may see: what a 503
        names, as a channel left at a version replaced since refuses every request."""
        seen: dict[str, set[str]] = {}
        for c in self.cards:
            if c.capability == capability and c.visible_to(tenant):
                seen.setdefault(c.agent_id, set()).add(c.version)
        return {
            agent_id: sorted(v for v in shares if v in seen[agent_id])
            for agent_id, shares in sorted(self.stable().items())
            if agent_id in seen
        }

    def stable(self) -> dict[str, Shares]:
        return {a: found[STABLE] for a, found in self.channels.items() if STABLE in found}

    def rules(
        self, *, tenant: str, capability: str, target: Target | None, hint: str | None
    ) -> Rules:
        """The rules of one request; NotFound or Gone when its target cannot be used."""
        rules = Rules(tenant=tenant, revoked=self.revoked, stable=self.stable(), hint=hint)
        if target is None:
            return rules
        return Rules(
            tenant=tenant,
            revoked=self.revoked,
            hint=hint,
            agent_id=target.agent_id,
            versions=self._pin(target, tenant, capability),
        )

    def _pin(self, target: Target, tenant: str, capability: str) -> Shares | None:
        chain = set(prefix_chain(capability))
        usable = [
            c
            for c in self.cards
            if c.agent_id == target.agent_id and c.capability in chain and c.visible_to(tenant)
        ]
        if target.tenant not in (None, tenant) or not usable:
            raise _no_agent(capability)
        if target.version is not None:
            if not any(c.version == target.version for c in usable):
                raise _no_agent(capability)
            if (target.agent_id, target.version) in self.revoked:
                raise Gone(
                    f"version {target.version} of {target.agent_id} is revoked",
                    code="version_revoked",
                )
            return {target.version: 1.0}
        assert target.channel is not None
        found = self.channels.get(target.agent_id, {}).get(target.channel)
        # Of a channel, only the versions this tenant may see: one of none of them is, to it,
        # one that does not exist (its name is of those who may use its versions).
        seen = {c.version for c in usable}
        shown = {v: w for v, w in (found or {}).items() if v in seen} or None
        if shown is None and target.channel != STABLE:
            raise NotFound(
                f"{target.agent_id} has no channel {target.channel!r}", code="channel_not_found"
            )
        return shown

    def waiting_queue(self, rules: Rules, capability: str) -> str | None:
        """Where a request nothing live serves waits (``queue_if_unavailable``): the
        capability's queue when every card of it would serve the request (no pin, no
        channel, none hidden, private or revoked), else the queue of the heaviest card that
        would; None when no card would. A private card's instances do not take from the
        capability's queue (``CardRef.queues``)."""
        # A revoked version's instances take from no queue, ever again (``lease_keeper``): it
        # is no reason to wait anywhere but the capability's queue. It was: one revoked
        # version in a capability's history sent every such request to a card's queue, which
        # a version started later does not take from either.
        # Nor is a card a remote agent left behind (``retired``): a request only such cards
        # would serve waited until its row expired.
        of_capability = [
            c
            for c in self.cards
            if c.capability == capability
            and (c.agent_id, c.version) not in rules.revoked
            and (c.agent_id, c.version, c.capability) not in self.retired
        ]
        usable = [
            c
            for c in of_capability
            if (rules.tenant is None or c.visible_to(rules.tenant))
            and (rules.agent_id is None or c.agent_id == rules.agent_id)
            and ((s := rules.shares(c.agent_id)) is None or s.get(c.version, 0) > 0)
        ]
        if not usable:
            return None
        if (
            len(usable) == len(of_capability)
            and all(c.tenants is None for c in usable)
            and rules.agent_id is None
            and not any(c.agent_id in rules.stable for c in usable)
        ):
            return capability
        best = max(
            usable,
            key=lambda c: (
                (rules.shares(c.agent_id) or {}).get(c.version, 0.0),
                version_order(c.version),
            ),
        )
        return card_queue(capability, best.agent_id, best.version)


def _no_agent(capability: str) -> NotFound:
    return NotFound(
        f"no agent this key may use matches the target for {capability!r}",
        code="agent_not_found",
    )


async def current(engine: AsyncEngine, cache: TimedCache) -> Policy:
    """The policy, read from Postgres at most once per cache period."""
    found, value = cache.get(CACHE_KEY)
    if found:
        return value  # type: ignore[no-any-return]
    card_query = select(
        cards_table.c.agent_id,
        cards_table.c.version,
        cards_table.c.capability,
        cards_table.c.card["tenants"],
        cards_table.c.card.has_key("endpoint"),
    )
    # The capabilities alone, not the cards' schemas: read every cache period
    registered_query = select(
        remote.c.agent_id,
        remote.c.version,
        func.jsonb_path_query_array(remote.c.cards, cast("$[*].capability", JSONPATH)).label(
            "capabilities"
        ),
    )
    async with engine.connect() as conn:
        card_rows = (await conn.execute(card_query)).all()
        channel_rows = (await conn.execute(select(channels))).all()
        revoked_rows = (await conn.execute(select(revocations))).all()
        registered_rows = (await conn.execute(registered_query)).all()
    by_agent: dict[str, dict[str, Shares]] = {}
    for r in channel_rows:
        by_agent.setdefault(r.agent_id, {})[r.channel] = dict(r.versions)
    served_now = {
        (r.agent_id, r.version, capability)
        for r in registered_rows
        for capability in r.capabilities
    }
    policy = Policy(
        cards=tuple(
            KnownCard(a, v, c, tuple(t) if isinstance(t, list) else None)
            for a, v, c, t, _ in card_rows
        ),
        channels=by_agent,
        revoked=frozenset((r.agent_id, r.version) for r in revoked_rows),
        retired=frozenset((a, v, c) for a, v, c, _, remote_card in card_rows if remote_card)
        - served_now,
    )
    return cache.put(CACHE_KEY, policy)  # type: ignore[no-any-return]


def forget(cache: TimedCache) -> None:
    """After this process changed a channel, revoked a version or (de)registered a remote
    agent: read again at once, and the capabilities cards serve with it (a capability first
    registered was refused as one no agent ever served, until the cache period passed)."""
    cache.forget(CACHE_KEY)
    cache.forget(cards.SERVED_KEY)
