"""Agent addresses: the target grammar, what a target pins, channel weights, the choice
between versions a channel governs, hints, visibility and revocation in routing."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from broker.errors import Gone, NotFound
from broker.registry.addresses import AddressInvalid, Target, parse_target, version_order
from broker.registry.channels import ChannelInvalid, parse_weights
from broker.registry.model import (
    DRAINING,
    READY,
    CardRef,
    Lease,
    card_queue,
    home_queue,
    instance_of,
    instance_queue,
)
from broker.registry.policy import KnownCard, Policy
from broker.registry.routing import Candidate, Rules, choose
from broker.tasks.envelope import parse_envelope

NOW = 1_000_000.0


# --- the grammar ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("invoice-extractor@2.3.1", Target("invoice-extractor", version="2.3.1")),
        ("invoice-extractor@canary", Target("invoice-extractor", channel="canary")),
        ("a@1", Target("a", version="1")),
        ("a@2.0.0-rc.1+build_7", Target("a", version="2.0.0-rc.1+build_7")),
        ("agent://acme/bot@stable", Target("bot", channel="stable", tenant="acme")),
        ("agent://t-1.x/bot@1.0.0", Target("bot", version="1.0.0", tenant="t-1.x")),
        # a tenant may hold a '/' (any printable characters): its name ends at the last one
        ("agent://acme/eu/bot@1.0.0", Target("bot", version="1.0.0", tenant="acme/eu")),
    ],
)
def test_a_target_names_an_agent_and_a_version_or_a_channel(text: str, expected: Target) -> None:
    assert parse_target(text) == expected
    assert str(parse_target(text)) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "bot",  # no selector
        "bot@",  # empty selector
        "@1.0",  # no agent
        "Bot@1.0",  # upper case agent id
        "bot@Canary",  # neither a version (digit first) nor a channel (lowercase)
        "bot@-x",
        "bot@1.0@2",  # '@' inside the selector
        "bot@1 0",
        "agent://acme/bot",  # long form without selector
        "agent://bot@1.0",  # long form without tenant
        "agent:///bot@1.0",  # empty tenant
        "agent://acme/bot@1.0/x",  # a '/' after the agent id
        "agent://a\x01/bot@1.0",  # a tenant no key can have
        "http://acme/bot@1.0",
        "bot@" + "1" * 300,
    ],
)
def test_a_malformed_target_is_refused(text: str) -> None:
    with pytest.raises(AddressInvalid):
        parse_target(text)


def test_the_envelope_refuses_a_malformed_target_with_its_own_code() -> None:
    with pytest.raises(Exception) as caught:
        parse_envelope({"capability": "echo", "payload": {}, "target": "bot@Nope"})
    assert getattr(caught.value, "code", None) == "target_invalid"
    assert caught.value.details["errors"][0]["field"] == "target"  # type: ignore[attr-defined]
    ok = parse_envelope({"capability": "echo", "payload": {}, "target": "bot@1.0", "hint": "a@h"})
    assert ok.address == Target("bot", version="1.0")
    assert ok.hint == "a@h"


# --- queues -----------------------------------------------------------------------------------


def test_an_instance_queue_goes_home_to_its_card_queue() -> None:
    card = card_queue("text.upper", "bot", "1.0.0")
    own = instance_queue(card, "worker-1@host.example")
    assert instance_of(own) == "worker-1@host.example"
    assert home_queue(own) == card
    assert home_queue(card) == card
    assert home_queue("text.upper") == "text.upper"
    assert instance_of(card) is None


# --- channel weights --------------------------------------------------------------------------


def test_channel_weights_are_versions_with_weights_not_all_zero() -> None:
    assert parse_weights({"versions": {"2.3.1": 90, "2.4.0": 10.5}}) == {
        "2.3.1": 90.0,
        "2.4.0": 10.5,
    }


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {},
        {"versions": {}},
        {"versions": []},
        {"versions": {"2.3.1": 90}, "extra": 1},
        {"versions": {"v2": 1}},
        {"versions": {"2.3.1": -1}},
        {"versions": {"2.3.1": True}},
        {"versions": {"2.3.1": "90"}},
        {"versions": {"2.3.1": math.inf}},
        {"versions": {"2.3.1": math.nan}},
        {"versions": {"2.3.1": 10**400}},  # no float holds it: once a 500
        {"versions": {"2.3.1": 0, "2.4.0": 0}},
        {"versions": {str(i): 1 for i in range(17)}},
    ],
)
def test_bad_channel_weights_are_refused(body: Any) -> None:
    with pytest.raises(ChannelInvalid):
        parse_weights(body)


# --- what a target pins -----------------------------------------------------------------------

POLICY = Policy(
    cards=(
        KnownCard("bot", "1.0.0", "text.upper"),
        KnownCard("bot", "2.0.0", "text.upper"),
        KnownCard("bot", "0.9.0", "text.upper"),
        KnownCard("secret", "1.0.0", "text.upper", tenants=("acme",)),
    ),
    channels={"bot": {"canary": {"1.0.0": 90.0, "2.0.0": 10.0}}},
    revoked=frozenset({("bot", "0.9.0")}),
)


def rules_for(target: str | None, tenant: str = "t1", capability: str = "text.upper") -> Rules:
    parsed = parse_target(target) if target is not None else None
    return POLICY.rules(tenant=tenant, capability=capability, target=parsed, hint=None)


def test_a_target_pins_its_agent_and_version_or_channel() -> None:
    assert rules_for("bot@2.0.0").versions == {"2.0.0": 1.0}
    assert rules_for("bot@canary").versions == {"1.0.0": 90.0, "2.0.0": 10.0}
    assert rules_for("bot@stable").versions is None  # no stable channel: any version
    assert rules_for("agent://t1/bot@2.0.0").agent_id == "bot"
    # a prefix request may be served by the agent's broader capability
    assert rules_for("bot@1.0.0", capability="text.upper.fr").versions == {"1.0.0": 1.0}


def test_hidden_missing_foreign_and_unserving_targets_are_one_and_the_same_404() -> None:
    answers = []
    for target, capability in [
        ("secret@1.0.0", "text.upper"),  # hidden from t1
        ("nobody@1.0.0", "text.upper"),  # does not exist
        ("agent://acme/bot@1.0.0", "text.upper"),  # another tenant's address
        ("bot@3.0.0", "text.upper"),  # a version it does not have
        ("bot@1.0.0", "text.lower"),  # serves no such capability
    ]:
        with pytest.raises(NotFound) as caught:
            rules_for(target, capability=capability)
        answers.append(caught.value.code)
    assert set(answers) == {"agent_not_found"}
    # the tenant it is shown to may use it
    assert rules_for("secret@1.0.0", tenant="acme").agent_id == "secret"


def test_a_revoked_version_is_gone_and_an_unknown_channel_is_404() -> None:
    with pytest.raises(Gone) as gone:
        rules_for("bot@0.9.0")
    assert gone.value.code == "version_revoked"
    with pytest.raises(NotFound) as missing:
        rules_for("bot@beta")
    assert missing.value.code == "channel_not_found"


def test_a_channel_of_versions_hidden_from_the_tenant_is_one_it_does_not_have() -> None:
    # Given bot 3.0.0 only acme may use, in a channel of its own and in one with 1.0.0
    policy = Policy(
        cards=(
            KnownCard("bot", "1.0.0", "text.upper"),
            KnownCard("bot", "3.0.0", "text.upper", tenants=("acme",)),
        ),
        channels={"bot": {"acme-canary": {"3.0.0": 1.0}, "mixed": {"1.0.0": 1.0, "3.0.0": 3.0}}},
    )

    def pinned(target: str, tenant: str) -> dict[str, float] | None:
        parsed = parse_target(target)
        return policy.rules(
            tenant=tenant, capability="text.upper", target=parsed, hint=None
        ).versions

    # Then to another tenant the private channel answers as a missing one, word for word
    answers = []
    for channel in ("acme-canary", "no-such"):
        with pytest.raises(NotFound) as missing:
            pinned(f"bot@{channel}", "t1")
        answers.append((missing.value.code, str(missing.value).replace(channel, "?")))
    assert answers[0] == answers[1] == ("channel_not_found", "bot has no channel '?'")
    # and a mixed one weighs only the versions it may see, as GET /agents shows it
    assert pinned("bot@mixed", "t1") == {"1.0.0": 1.0}
    assert pinned("bot@mixed", "acme") == {"1.0.0": 1.0, "3.0.0": 3.0}
    assert pinned("bot@acme-canary", "acme") == {"3.0.0": 1.0}


# --- choosing ---------------------------------------------------------------------------------


def candidate(
    agent_id: str,
    version: str,
    instance: str,
    *,
    tenants: tuple[str, ...] | None = None,
    state: str = READY,
    age_s: float = 3600.0,
) -> Candidate:
    card = CardRef(agent_id, version, "text.upper", tenants=tenants)
    lease = Lease(
        instance=instance,
        state=state,
        heartbeat_at=NOW,
        started_at=NOW - age_s,
        lease_ttl_s=30.0,
        cards=(card,),
    )
    return Candidate(card=card, lease=lease)


def test_a_channel_splits_an_agents_traffic_by_version_whatever_its_instances() -> None:
    # Given v1 on three instances (one warming up) and v2 on one, and a 90/10 channel
    pool = [
        candidate("bot", "1.0.0", "a@h"),
        candidate("bot", "1.0.0", "b@h", age_s=5),
        candidate("bot", "1.0.0", "c@h"),
        candidate("bot", "2.0.0", "d@h"),
    ]
    rules = Rules(stable={"bot": {"1.0.0": 90.0, "2.0.0": 10.0}})
    rng = random.Random(7)
    n = 20_000
    picks = Counter(
        choose(
            pool, requested="text.upper", now=NOW, success_rates={}, rng=rng, rules=rules
        ).card.version
        for _ in range(n)
    )
    # Then v2 gets 10 % within 5 standard deviations of the binomial
    sd = math.sqrt(n * 0.1 * 0.9)
    assert abs(picks["2.0.0"] - n * 0.1) < 5 * sd


def test_rules_drop_hidden_and_revoked_cards_and_keep_a_pins_versions() -> None:
    pool = [
        candidate("bot", "1.0.0", "a@h"),
        candidate("bot", "2.0.0", "b@h"),
        candidate("secret", "1.0.0", "c@h", tenants=("acme",)),
    ]
    as_t1 = Rules(tenant="t1", revoked=frozenset({("bot", "2.0.0")}))
    assert [c.lease.instance for c in as_t1.narrow(pool)] == ["a@h"]
    as_acme = Rules(tenant="acme")
    assert len(as_acme.narrow(pool)) == 3
    pinned = Rules(tenant="t1", agent_id="bot", versions={"2.0.0": 1.0})
    assert [c.lease.instance for c in pinned.narrow(pool)] == ["b@h"]
    stable = Rules(tenant="t1", stable={"bot": {"1.0.0": 1.0, "2.0.0": 0.0}})
    assert [c.lease.instance for c in stable.narrow(pool)] == ["a@h"]


def test_a_hint_picks_its_instance_only_while_it_is_ready() -> None:
    ready = candidate("bot", "1.0.0", "a@h")
    other = candidate("bot", "1.0.0", "b@h")
    rules = Rules(hint="a@h")
    assert rules.hinted([ready, other], NOW) is ready
    draining = candidate("bot", "1.0.0", "a@h", state=DRAINING)
    assert rules.hinted([draining, other], NOW) is None
    assert Rules(hint="zz@h").hinted([ready, other], NOW) is None


# --- where a request nothing live serves waits (queue_if_unavailable) -------------------------


def test_a_request_waits_in_the_queue_of_a_card_that_would_serve_it() -> None:
    def waits(target: str | None, tenant: str = "t1", policy: Policy = POLICY) -> str | None:
        parsed = parse_target(target) if target is not None else None
        rules = policy.rules(tenant=tenant, capability="text.upper", target=parsed, hint=None)
        return policy.waiting_queue(rules, "text.upper")

    # pinned: that version's card queue, never the capability's (another version takes it)
    assert waits("bot@2.0.0") == card_queue("text.upper", "bot", "2.0.0")
    # a channel: its heaviest version
    assert waits("bot@canary") == card_queue("text.upper", "bot", "1.0.0")
    # untargeted, with a card hidden from the tenant and one revoked: a card it may use
    assert waits(None) in {card_queue("text.upper", "bot", v) for v in ("1.0.0", "2.0.0")}
    # every card of the capability would serve it: the capability's own queue
    open_policy = Policy(cards=(KnownCard("bot", "1.0.0", "text.upper"),))
    assert waits(None, policy=open_policy) == "text.upper"
    # every card would serve it, but one is private (even to this tenant): that card's
    # instances do not take from the capability's queue, so a card's queue it may use
    with_private = Policy(
        cards=(
            KnownCard("bot", "1.0.0", "text.upper"),
            KnownCard("bot", "2.0.0", "text.upper", tenants=("t1",)),
        )
    )
    assert waits(None, policy=with_private) in {
        card_queue("text.upper", "bot", v) for v in ("1.0.0", "2.0.0")
    }
    # only a card the tenant may not use: nowhere
    only_hidden = Policy(cards=(KnownCard("secret", "1.0.0", "text.upper", tenants=("acme",)),))
    assert waits(None, policy=only_hidden) is None


def test_a_revoked_version_does_not_send_a_waiting_request_to_an_old_versions_queue() -> None:
    """Revoked 1.2.0 stays among the cards, as every card does: it sent the request to 1.1.0's
    queue, which 1.2.1, started later, does not take from. It takes from the capability's."""
    cards = tuple(KnownCard("bot", v, "text.upper") for v in ("1.1.0", "1.2.0"))
    policy = Policy(cards=cards, revoked=frozenset({("bot", "1.2.0")}))
    rules = policy.rules(tenant="t1", capability="text.upper", target=None, hint=None)
    assert policy.waiting_queue(rules, "text.upper") == "text.upper"


def test_a_card_queue_for_a_waiting_request_is_the_newest_version_read_as_numbers() -> None:
    cards = (
        KnownCard("bot", "9.1.0", "text.upper"),
        KnownCard("bot", "10.0.0", "text.upper"),
        KnownCard("secret", "1.0.0", "text.upper", tenants=("acme",)),  # a card's queue, then
    )
    policy = Policy(cards=cards)
    rules = policy.rules(tenant="t1", capability="text.upper", target=None, hint=None)
    assert policy.waiting_queue(rules, "text.upper") == card_queue("text.upper", "bot", "10.0.0")
    assert sorted(["10.0.0", "9.1.0", "9.10.0", "9.2.0"], key=version_order) == [
        "9.1.0",
        "9.2.0",
        "9.10.0",
        "10.0.0",
    ]
