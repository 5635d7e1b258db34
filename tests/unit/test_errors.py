"""Unit tests for the two groups of outside exceptions that decide what is tried again."""

import pytest

from broker.outages import AGENT_TRANSIENT_ERRORS, INFRASTRUCTURE_ERRORS


@pytest.mark.parametrize("ours", INFRASTRUCTURE_ERRORS)
@pytest.mark.parametrize("agents", AGENT_TRANSIENT_ERRORS)
def test_given_both_groups_expect_no_class_in_both(ours: type, agents: type) -> None:
    # Our Postgres or Redis being away must never use up a task's attempt, and an agent's
    # failed call must never be mistaken for it.
    assert not issubclass(ours, agents)
    assert not issubclass(agents, ours)
