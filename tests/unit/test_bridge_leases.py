"""The leases a bridge writes for its remote agents (``workers.bridge.keeper``): renewed once
a health tick, so each outlives three ticks whatever the interval."""

from __future__ import annotations

from broker.registry.model import Card
from broker.remote.registration import RemoteAgent
from broker.settings import Settings
from workers.bridge.keeper import RemoteKeeper, Watched


def _lease_ttl_s(**settings: float) -> tuple[float, float]:
    """The TTL of a remote agent's lease, and of the bridge's own, under ``settings``."""
    keeper = RemoteKeeper.__new__(RemoteKeeper)  # no consumer, no connections
    keeper.settings = Settings(**settings)  # type: ignore[arg-type]
    keeper.started_at, keeper.revoked = 0.0, set()
    agent = RemoteAgent(
        agent_id="far",
        version="1.0.0",
        protocol="http",
        url="http://127.0.0.1:9/far",
        capability_prefix=None,
        cards=(Card.declare("text.upper", agent_id="far", version="1.0.0"),),
        secret="whsec_" + "A" * 32,
    )
    return keeper._lease(Watched(agent)).lease_ttl_s, keeper._lease_ttl_s()


def test_an_agents_lease_outlives_three_health_ticks_however_far_apart() -> None:
    """With the interval raised to 15 s and the TTL left at 30, a healthy agent read as
    suspect (past half its TTL) before every tick; at 30 s its lease expired between two."""
    assert _lease_ttl_s(remote_health_interval_s=15, remote_lease_ttl_s=30) == (45, 45)
    assert _lease_ttl_s(remote_health_interval_s=5, remote_lease_ttl_s=30) == (30, 30)
