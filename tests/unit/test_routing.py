"""Which card takes a request: scores, the weighted choice, which leases may serve, and the
key's bound on the prefix chain (the fallback itself, which reads Redis, is tested in
``tests/integration/test_names.py``)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from redis.asyncio import Redis

from broker.registry.model import DRAINING, NOT_READY, READY, CardRef, Lease
from broker.registry.routing import (
    Candidate,
    Route,
    candidates_from,
    choose,
    resolve,
    score,
    serving,
    success_band,
    warmup_factor,
)

NOW = 1_000_000.0
TTL_S = 30.0


def card(
    capability: str = "text.summarize",
    agent_id: str = "a",
    *,
    weight: float = 1.0,
    cost_per_call: float = 0.0,
    ready: bool = True,
) -> CardRef:
    return CardRef(agent_id, "1", capability, weight, cost_per_call, ready)


def lease(
    *cards: CardRef,
    state: str = READY,
    heartbeat_age_s: float = 0.0,
    age_s: float = 3600.0,
    instance: str = "w@h",
) -> Lease:
    return Lease(
        instance=instance,
        state=state,
        heartbeat_at=NOW - heartbeat_age_s,
        started_at=NOW - age_s,
        lease_ttl_s=TTL_S,
        cards=cards,
    )


def candidate(
    served: CardRef, *, heartbeat_age_s: float = 0.0, age_s: float = 3600.0, instance: str = "w@h"
) -> Candidate:
    held = lease(served, heartbeat_age_s=heartbeat_age_s, age_s=age_s, instance=instance)
    return Candidate(card=served, lease=held)


def score_of(
    c: Candidate, requested: str = "text.summarize", success_rate: float | None = None
) -> float:
    rates = {} if success_rate is None else {(c.card.agent_id, c.card.version): success_rate}
    return score(c, requested=requested, now=NOW, success_rates=rates)


# --- success_band and warmup_factor ----------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "band"),
    [(None, 1.0), (1.0, 1.0), (0.99, 1.0), (0.989, 0.7), (0.95, 0.7), (0.949, 0.3), (0.0, 0.3)],
)
def test_the_success_rate_falls_into_its_band(rate: float | None, band: float) -> None:
    assert success_band(rate) == band


@pytest.mark.parametrize(
    ("age_s", "factor"),
    [(0, 0.2), (59.9, 0.2), (60, 0.5), (119.9, 0.5), (120, 1.0), (86_400, 1.0)],
)
def test_a_recovered_instance_warms_up_over_two_minutes(age_s: float, factor: float) -> None:
    assert warmup_factor(age_s) == factor


# --- score -----------------------------------------------------------------------------------


def test_a_healthy_exact_match_at_no_cost_scores_its_weight() -> None:
    assert score_of(candidate(card())) == 1.0
    assert score_of(candidate(card(weight=2.5))) == 2.5


def test_a_broader_capability_scores_less_than_an_exact_one() -> None:
    broader = candidate(card("text"))
    assert score_of(broader, requested="text.summarize") == pytest.approx(0.6)


def test_each_factor_multiplies_the_score() -> None:
    assert score_of(candidate(card()), success_rate=0.96) == pytest.approx(0.7)
    assert score_of(candidate(card(cost_per_call=0.01))) == pytest.approx(0.5)
    assert score_of(candidate(card(), age_s=30)) == pytest.approx(0.2)
    # A renewal late by more than half a TTL: suspect, still routable at a third of the health
    assert score_of(candidate(card(), heartbeat_age_s=TTL_S * 0.6)) == pytest.approx(0.3)
    everything = candidate(card("text", weight=2, cost_per_call=0.01), age_s=90)
    assert score_of(everything, success_rate=0.5) == pytest.approx(0.6 * 0.3 * 0.5 * 2 * 0.5)


# --- choose ----------------------------------------------------------------------------------


def test_choices_follow_the_scores_and_the_lesser_card_still_gets_some() -> None:
    strong = candidate(card(agent_id="strong", weight=3))
    weak = candidate(card(agent_id="weak", weight=1))
    rng = random.Random(42)
    picks = Counter(
        choose(
            [strong, weak], requested="text.summarize", now=NOW, success_rates={}, rng=rng
        ).card.agent_id
        for _ in range(4000)
    )
    assert picks["strong"] / 4000 == pytest.approx(0.75, abs=0.03)
    assert picks["weak"] > 0


def test_the_same_seed_makes_the_same_choices() -> None:
    pool = [candidate(card(agent_id=name)) for name in "abcde"]

    def draw(seed: int) -> list[str]:
        rng = random.Random(seed)
        return [
            choose(
                pool, requested="text.summarize", now=NOW, success_rates={}, rng=rng
            ).card.agent_id
            for _ in range(20)
        ]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_when_every_score_is_zero_each_card_has_an_equal_chance() -> None:
    pool = [candidate(card(agent_id=name, weight=0)) for name in "abc"]
    rng = random.Random(1)
    picks = Counter(
        choose(pool, requested="text.summarize", now=NOW, success_rates={}, rng=rng).card.agent_id
        for _ in range(3000)
    )
    assert set(picks) == {"a", "b", "c"}
    assert all(n / 3000 == pytest.approx(1 / 3, abs=0.04) for n in picks.values())


# --- serving and candidates_from -------------------------------------------------------------


def test_a_ready_or_suspect_lease_serves_its_ready_card() -> None:
    served = card()
    assert serving(lease(served), "text.summarize", NOW) == served
    assert serving(lease(served, heartbeat_age_s=TTL_S * 0.6), "text.summarize", NOW) == served


@pytest.mark.parametrize("state", [NOT_READY, DRAINING])
def test_a_lease_that_may_not_take_work_serves_nothing(state: str) -> None:
    assert serving(lease(card(), state=state), "text.summarize", NOW) is None


def test_a_lease_serves_neither_another_capability_nor_a_card_not_ready() -> None:
    assert serving(lease(card()), "invoice.extract", NOW) is None
    assert serving(lease(card(ready=False)), "text.summarize", NOW) is None
    mixed = lease(card(ready=False), card(agent_id="b"), card("invoice.extract", agent_id="c"))
    assert serving(mixed, "text.summarize", NOW) == card(agent_id="b")


def test_candidates_skip_leases_that_expired_after_the_index_named_them() -> None:
    alive = lease(card(), instance="alive@h")
    draining = lease(card(), instance="draining@h", state=DRAINING)
    raw: list[bytes | None] = [None, alive.to_json().encode(), b"", draining.to_json().encode()]
    found = candidates_from(raw, "text.summarize", NOW)
    assert [(c.lease.instance, c.card) for c in found] == [("alive@h", card())]
    assert candidates_from(None, "text.summarize", NOW) == []
    assert candidates_from([], "text.summarize", NOW) == []


# --- resolve with the candidates already known ------------------------------------------------


def route(
    requested: str, allowed: list[str], known: list[Candidate], rng: random.Random | None = None
) -> Route | None:
    """``resolve`` with the candidates for ``requested`` known, and a Redis that nothing
    answers (port 1): a resolve that reached for Redis would fail with ConnectionError."""

    async def main() -> Route | None:
        no_redis = Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)
        try:
            return await resolve(no_redis, requested, allowed=allowed, known=(NOW, known), rng=rng)
        finally:
            await no_redis.aclose()

    return asyncio.run(main())


def test_one_card_routes_to_the_capabilitys_own_queue() -> None:
    known = [candidate(card(), instance="one@h"), candidate(card(), instance="two@h")]
    found = route("text.summarize", ["*"], known)
    assert found is not None
    assert (found.capability, found.queue) == ("text.summarize", "text.summarize")
    assert found.candidates == tuple(known)


def test_one_private_card_routes_to_its_own_queue_which_no_other_card_takes_from() -> None:
    # Its instances do not take from the capability's queue (CardRef.queues): a public card
    # started later would find the task there, and a private one would run any tenant's
    private = CardRef("a", "1", "text.summarize", tenants=("acme",))
    found = route("text.summarize", ["*"], [candidate(private), candidate(private, instance="b@h")])
    assert found is not None
    assert found.queue == private.queue() != "text.summarize"


def test_several_cards_route_to_the_chosen_cards_queue() -> None:
    known = [candidate(card(agent_id="a")), candidate(card(agent_id="b"))]
    found = route("text.summarize", ["text.*"], known, random.Random(5))
    assert found is not None
    assert found.queue == found.card.queue() != "text.summarize"


def test_a_key_allowed_only_the_exact_name_never_falls_back_to_its_parents() -> None:
    # No live card for the exact name, and the parents not allowed: no route, and Redis is
    # never asked about text.summarize or text
    assert route("text.summarize.fr", ["text.summarize.fr"], []) is None


def test_a_key_not_allowed_the_name_is_not_routed_to_its_live_card() -> None:
    known = [candidate(card("text.summarize.fr"))]
    assert route("text.summarize.fr", ["invoice.*"], known) is None
