"""Which remote agent's handler a run message reaches (``workers.bridge.registry``): by its
card's queue or an instance's queue under it, else by capability, the first agent served."""

from __future__ import annotations

from broker.registry.model import Card
from broker.remote.registration import RemoteAgent
from broker.webhooks.ssrf import Guard
from workers.bridge.registry import RemoteRegistry


def _agent(
    agent_id: str,
    *capabilities: str,
    tenants: tuple[str, ...] | None = None,
    version: str = "1.0.0",
) -> RemoteAgent:
    return RemoteAgent(
        agent_id=agent_id,
        version=version,
        protocol="http",
        url=f"http://127.0.0.1:9/{agent_id}",
        capability_prefix=None,
        cards=tuple(
            Card.declare(c, agent_id=agent_id, version=version, tenants=tenants)
            for c in capabilities
        ),
        secret="whsec_" + "A" * 32,
    )


def _served_by(registry: RemoteRegistry, queue: str) -> str | None:
    spec = registry.for_queue(queue)
    return None if spec is None else spec.card.agent_id


def test_a_card_queue_and_its_instance_queues_reach_that_agent_even_when_another_came_first() -> (
    None
):
    registry = RemoteRegistry(Guard())
    registry.serve(_agent("first", "text.upper"))
    registry.serve(_agent("second", "text.upper", "text.lower"))

    assert _served_by(registry, "text.upper@second@1.0.0") == "second"
    assert _served_by(registry, "text.upper@second@1.0.0@bridge-1@host") == "second"
    assert _served_by(registry, "text.upper@first@1.0.0@bridge-1@host") == "first"
    assert _served_by(registry, "text.upper") == "first"
    assert _served_by(registry, "text.lower") == "second"
    assert _served_by(registry, "text.title") is None
    assert registry.get("text.lower") is registry.for_queue("text.lower")


def test_the_look_ups_follow_a_registration_replaced_and_forgotten() -> None:
    registry = RemoteRegistry(Guard())
    registry.serve(_agent("first", "text.upper"))
    registry.serve(_agent("second", "text.upper"))

    registry.serve(_agent("first", "text.lower"))  # first no longer serves text.upper
    assert _served_by(registry, "text.upper") == "second"
    assert _served_by(registry, "text.lower") == "first"
    # A card queue of a card the agent dropped reaches no other agent: a target may have
    # pinned its task to this one
    assert registry.for_queue("text.upper@first@1.0.0") is None
    assert registry.for_queue("text.upper@first@1.0.0@bridge-1@host") is None

    registry.forget("second")
    assert registry.for_queue("text.upper") is None
    assert registry.get("text.upper") is None
    assert [spec.name for spec in registry] == ["text.lower"]


def test_a_capabilitys_own_queue_goes_to_an_agent_that_is_up_while_one_is() -> None:
    registry = RemoteRegistry(Guard())
    registry.serve(_agent("first", "text.upper"))
    registry.serve(_agent("second", "text.upper"))
    # Routing sends to the capability's own queue when one agent is live: here the second
    registry.route(["second"])
    assert _served_by(registry, "text.upper") == "second"
    assert registry.get("text.upper") is registry.for_queue("text.upper")
    # A card's queue still names its agent, up or not
    assert _served_by(registry, "text.upper@first@1.0.0") == "first"
    registry.route(["first", "second"])
    assert _served_by(registry, "text.upper") == "first"
    # None up: the first served, so a message already taken still reaches an agent
    registry.route([])
    assert _served_by(registry, "text.upper") == "first"
    registry.route(["second"])
    registry.forget("second")
    assert _served_by(registry, "text.upper") == "first"


def test_a_capabilitys_own_queue_goes_to_an_agent_of_every_tenant_before_a_private_one() -> None:
    """Any tenant's task may wait there: a private card's claim put another tenant's back,
    every half second, while the public agent that was up never got it."""
    registry = RemoteRegistry(Guard())
    registry.serve(_agent("a-private", "text.upper", tenants=("acme",)))
    registry.serve(_agent("b-public", "text.upper"))

    registry.route(["a-private", "b-public"])
    assert _served_by(registry, "text.upper") == "b-public"
    registry.route(["a-private"])  # the public one down: still it, as the first served is
    assert _served_by(registry, "text.upper") == "b-public"
    registry.forget("b-public")  # only the private one: a message taken still reaches it
    assert _served_by(registry, "text.upper") == "a-private"
    assert _served_by(registry, "text.upper@a-private@1.0.0") == "a-private"


def test_a_card_queue_of_a_version_replaced_reaches_the_agent_at_its_new_version() -> None:
    registry = RemoteRegistry(Guard())
    registry.serve(_agent("first", "text.upper"))
    registry.serve(_agent("second", "text.upper"))
    registry.serve(_agent("first", "text.upper", version="2.0.0"))

    spec = registry.for_queue("text.upper@first@1.0.0")
    assert spec is not None and (spec.card.agent_id, spec.card.version) == ("first", "2.0.0")
