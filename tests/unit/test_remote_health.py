"""Remote agents' health, dampened both ways (``broker.remote.health``)."""

from __future__ import annotations

from broker.registry.model import OFFLINE, READY, SUSPECT
from broker.remote.health import NEW, Dampening, Health

POLICY = Dampening(fail_after=5, recover_passes=5, recover_after_s=60)


def run(health: Health, outcomes: str, start: float = 0.0, step: float = 1.0) -> list[str]:
    """Feed checks ('+' pass, '-' fail), one every ``step`` seconds; the states after each."""
    return [
        health.observe(mark == "+", start + i * step, POLICY) for i, mark in enumerate(outcomes)
    ]


def test_a_new_agent_is_ready_at_its_first_pass() -> None:
    assert run(Health(), "+") == [READY]


def test_a_new_agent_is_not_routed_until_its_first_pass_with_no_wait_after_it() -> None:
    health = Health()
    assert run(health, "-------") == [NEW] * 7
    assert not health.routed
    assert health.observe(True, 8, POLICY) == READY


def test_one_failure_makes_a_ready_agent_suspect_and_still_routed() -> None:
    health = Health()
    states = run(health, "+-")
    assert states == [READY, SUSPECT]
    assert health.routed


def test_a_pass_after_a_few_failures_makes_it_ready_again() -> None:
    assert run(Health(), "+---+") == [READY, SUSPECT, SUSPECT, SUSPECT, READY]


def test_five_failures_in_a_row_take_it_offline_and_not_four() -> None:
    assert run(Health(), "+----")[-1] == SUSPECT
    health = Health()
    assert run(health, "+-----")[-1] == OFFLINE
    assert not health.routed


def test_failures_broken_by_a_pass_do_not_add_up() -> None:
    assert run(Health(), "+----+----")[-1] == SUSPECT


def test_offline_comes_back_only_after_the_wait_and_five_passes_in_a_row() -> None:
    health = Health()
    run(health, "+-----", start=0)  # offline at t=5
    # Five passes at once are not enough before 60 s have passed.
    assert run(health, "+++++", start=6)[-1] == OFFLINE
    # Past 60 s, the streak counts: the sixth and later passes in a row bring it back.
    assert health.observe(True, 66, POLICY) == READY


def test_after_the_wait_a_failure_restarts_the_streak() -> None:
    health = Health()
    run(health, "+-----", start=0)  # offline at t=5
    assert run(health, "++++-++++", start=70)[-1] == OFFLINE
    assert health.observe(True, 80, POLICY) == READY


def test_lease_expiry_takes_it_offline_with_the_same_way_back() -> None:
    health = Health()
    run(health, "+")
    health.expired(10)
    assert health.state == OFFLINE
    assert run(health, "+++++", start=11)[-1] == OFFLINE  # before 60 s
    assert run(health, "+++++", start=71)[-1] == READY
