"""A token bucket per name, in one process (``api.callers.Budget``): the per-address budget
of key lookups that find nothing, and the per-tenant request rate."""

from __future__ import annotations

import pytest

from api import callers
from broker.tasks.backpressure import RateLimited


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(callers.time, "monotonic", clock)
    return clock


def budget(rate_per_s: float = 4) -> callers.Budget:
    return callers.Budget(rate_per_s, reason="request_rate", refusal="too many")


def test_a_name_gets_its_burst_then_is_refused_with_a_retry_after(clock: Clock) -> None:
    rate = budget(4)
    for _ in range(8):
        rate.take("a")
    with pytest.raises(RateLimited) as refused:
        rate.take("a")
    assert refused.value.details["retry_after_s"] == 1
    assert str(refused.value) == "too many"


def test_another_name_has_its_own_bucket(clock: Clock) -> None:
    rate = budget(4)
    for _ in range(8):
        rate.take("a")
    rate.take("b")
    with pytest.raises(RateLimited):
        rate.take("a")


def test_tokens_come_back_at_the_rate_up_to_the_burst(clock: Clock) -> None:
    rate = budget(4)
    for _ in range(8):
        rate.take("a")
    clock.now += 0.5  # two tokens
    rate.take("a")
    rate.take("a")
    with pytest.raises(RateLimited):
        rate.take("a")
    clock.now += 3600
    for _ in range(8):
        rate.take("a")
    with pytest.raises(RateLimited):
        rate.take("a")


def test_a_slow_rate_asks_for_a_longer_wait(clock: Clock) -> None:
    rate = budget(0.1)  # a burst of 0.2: not even one token
    with pytest.raises(RateLimited) as refused:
        rate.take("a")
    assert refused.value.details["retry_after_s"] == 8  # (1 - 0.2) / 0.1 s


def test_check_alone_takes_nothing(clock: Clock) -> None:
    rate = budget(1)
    for _ in range(5):
        rate.check("a")
    rate.spend("a")
    rate.spend("a")
    with pytest.raises(RateLimited):
        rate.check("a")
