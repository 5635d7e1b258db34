"""What an attempt's outcome means, and when the next one is due."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from broker.timestamps import parse_retry_after
from broker.webhooks.policy import (
    DEAD,
    FAILED,
    PENDING,
    SUCCEEDED,
    Outcome,
    next_delay_s,
    status_after,
    verdict,
)

SCHEDULE = [0.0, 5.0, 300.0, 1800.0]


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (Outcome(status_code=200), "delivered"),
        (Outcome(status_code=204), "delivered"),
        (Outcome(status_code=410), "gone"),
        (Outcome(status_code=429), "retry"),
        (Outcome(status_code=408), "retry"),
        (Outcome(status_code=500), "retry"),
        (Outcome(status_code=502), "retry"),
        (Outcome(status_code=504), "retry"),
        (Outcome(status_code=301), "failed"),  # a redirect is a failure, never followed
        (Outcome(status_code=302), "failed"),
        (Outcome(status_code=400), "failed"),
        (Outcome(status_code=404), "failed"),
        (Outcome(error="timeout after 15 s"), "retry"),
        (Outcome(error="connect: refused"), "retry"),
        (Outcome(error="url_not_allowed: 10.0.0.1", transient=False), "failed"),
    ],
)
def test_verdicts(outcome: Outcome, expected: str) -> None:
    assert verdict(outcome) == expected


def test_retries_stay_pending_until_the_final_attempt_then_the_message_is_dead() -> None:
    assert status_after("retry", 1, 4) == PENDING
    assert status_after("retry", 3, 4) == PENDING
    assert status_after("retry", 4, 4) == DEAD
    assert status_after("delivered", 4, 4) == SUCCEEDED
    assert status_after("failed", 1, 4) == FAILED
    assert status_after("gone", 1, 4) == FAILED


def test_the_delay_follows_the_schedule_within_the_jitter() -> None:
    rng = random.Random(7)
    for made, base in enumerate(SCHEDULE):
        delays = [next_delay_s(SCHEDULE, made, jitter=0.2, rng=rng) for _ in range(200)]
        assert all(base * 0.8 <= d <= base * 1.2 for d in delays)
    spread = {round(next_delay_s(SCHEDULE, 2, jitter=0.2, rng=rng), 3) for _ in range(50)}
    assert len(spread) > 40  # jittered, not lockstep


def test_retry_after_pushes_the_next_attempt_later_but_never_past_the_longest_delay() -> None:
    assert next_delay_s(SCHEDULE, 1, jitter=0, retry_after_s=120) == 120
    assert next_delay_s(SCHEDULE, 1, jitter=0, retry_after_s=1) == 5
    assert next_delay_s(SCHEDULE, 1, jitter=0, retry_after_s=10**9) == 1800


def test_retry_after_parses_seconds_and_http_dates() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_retry_after("120") == 120
    assert parse_retry_after(format_datetime(now + timedelta(seconds=90), usegmt=True), now) == 90
    assert parse_retry_after(format_datetime(now - timedelta(seconds=90), usegmt=True), now) == 0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("-5") is None
