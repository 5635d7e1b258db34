"""When a failed attempt runs again: the back-off (200 ms, doubling, capped at 60 s, jittered),
the attempt limit, and the deadline that comes first."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

import pytest

from broker.tasks.retry import REQUESTED_CAP_S, attempt_limit, backoff_s, decide

NOW = datetime(2026, 1, 1, tzinfo=UTC)
SEEDS = range(50)


@pytest.mark.parametrize(
    ("attempt", "step_s"),
    [(0, 0.2), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.6), (9, 51.2), (10, 60.0), (50, 60.0)],
)
def test_the_delay_is_between_half_the_step_and_the_step(attempt: int, step_s: float) -> None:
    delays = [backoff_s(attempt, random.Random(seed)) for seed in SEEDS]
    assert all(step_s / 2 <= d <= step_s for d in delays)


def test_below_the_cap_the_delay_grows_with_each_attempt_whatever_the_jitter() -> None:
    # Half the next step is the whole of this one: the ranges touch and never overlap, up to
    # attempt 9 (51.2 s), whose next step is cut to 60 s.
    for attempt in range(1, 9):
        longest = max(backoff_s(attempt, random.Random(seed)) for seed in SEEDS)
        shortest_next = min(backoff_s(attempt + 1, random.Random(seed)) for seed in SEEDS)
        assert longest <= shortest_next


def test_failures_that_happen_together_do_not_retry_together() -> None:
    delays = {backoff_s(5, random.Random(seed)) for seed in SEEDS}
    assert len(delays) == len(SEEDS)
    assert backoff_s(5, random.Random(7)) == backoff_s(5, random.Random(7))


@pytest.mark.parametrize(
    ("requested", "card", "limit"),
    [(None, None, 3), (None, 5, 5), (2, None, 2), (9, 2, 2), (1, 4, 1)],
)
def test_the_attempt_limit_is_the_smaller_of_envelope_and_card(
    requested: int | None, card: int | None, limit: int
) -> None:
    assert attempt_limit(requested, card) == limit


def test_a_failure_that_is_not_retryable_is_final() -> None:
    decision = decide(retryable=False, attempt=1, limit=5, deadline_at=None, now=NOW)
    assert (decision.retry, decision.reason) == (False, "not retryable")


def test_the_last_allowed_attempt_is_final() -> None:
    decision = decide(retryable=True, attempt=3, limit=3, deadline_at=None, now=NOW)
    assert (decision.retry, decision.reason) == (False, "attempt 3 of 3")


def test_a_retry_waits_the_back_off() -> None:
    decision = decide(
        retryable=True, attempt=2, limit=3, deadline_at=None, now=NOW, rng=random.Random(1)
    )
    assert decision.retry
    assert decision.delay_s == backoff_s(2, random.Random(1))


def test_a_delay_the_agent_asked_for_replaces_the_back_off() -> None:
    decision = decide(
        retryable=True, attempt=1, limit=3, deadline_at=None, now=NOW, requested_delay_s=7.5
    )
    assert (decision.retry, decision.delay_s) == (True, 7.5)


@pytest.mark.parametrize(
    ("asked", "waited"),
    [(math.inf, REQUESTED_CAP_S), (1e300, REQUESTED_CAP_S), (1e8, REQUESTED_CAP_S), (-5.0, 0.0)],
)
def test_a_delay_the_agent_asked_for_is_kept_within_bounds(asked: float, waited: float) -> None:
    """A remote agent's ``Retry-After: inf`` overflowed the deadline's arithmetic (the task
    stayed running); ``1e8`` parked its task for years."""
    with_deadline = decide(
        retryable=True,
        attempt=1,
        limit=3,
        deadline_at=NOW + timedelta(hours=1),
        now=NOW,
        requested_delay_s=asked,
    )
    without = decide(
        retryable=True, attempt=1, limit=3, deadline_at=None, now=NOW, requested_delay_s=asked
    )
    assert (with_deadline.retry, with_deadline.delay_s) == (True, waited)
    assert (without.retry, without.delay_s) == (True, waited)


@pytest.mark.parametrize(
    ("asked", "waited"),
    [
        ("2", 2.0),  # a Retry-After passed on as it came
        (" 2.5 ", 2.5),
        (timedelta(seconds=3), 3.0),
        (2, 2.0),
        (10**400, REQUESTED_CAP_S),  # no float holds it
        (-(10**400), 0.0),
    ],
)
def test_a_delay_asked_for_as_text_a_timedelta_or_any_int_is_read_as_seconds(
    asked: object, waited: float
) -> None:
    """A handler's ``Retryable(delay_s="2")`` raised in the decision, after its run: its task
    was left running, then ended ``worker_lost`` (or, idempotent, ran again at once)."""
    decision = decide(
        retryable=True, attempt=1, limit=3, deadline_at=None, now=NOW, requested_delay_s=asked
    )
    assert (decision.retry, decision.delay_s) == (True, waited)


@pytest.mark.parametrize("asked", [math.nan, "nan", "soon", "", True, [2], object()])
def test_a_delay_that_is_no_number_is_the_back_off(asked: object) -> None:
    decision = decide(
        retryable=True,
        attempt=2,
        limit=3,
        deadline_at=None,
        now=NOW,
        requested_delay_s=asked,
        rng=random.Random(1),
    )
    assert decision.delay_s == backoff_s(2, random.Random(1))


def test_a_retry_never_lands_past_the_deadline() -> None:
    # Attempt 3 waits 0.4 to 0.8 s: a deadline 0.6 s away is met by some draws and not others.
    deadline_at = NOW + timedelta(seconds=0.6)
    decisions = [
        decide(
            retryable=True,
            attempt=3,
            limit=9,
            deadline_at=deadline_at,
            now=NOW,
            rng=random.Random(seed),
        )
        for seed in SEEDS
    ]
    retried = [d for d in decisions if d.retry]
    refused = [d for d in decisions if not d.retry]
    assert retried and refused
    assert all(NOW + timedelta(seconds=d.delay_s) < deadline_at for d in retried)
    assert {d.reason for d in refused} == {"the deadline comes first"}


def test_a_deadline_sooner_than_any_back_off_ends_the_retries() -> None:
    decision = decide(
        retryable=True,
        attempt=1,
        limit=9,
        deadline_at=NOW + timedelta(milliseconds=50),
        now=NOW,
        rng=random.Random(3),
    )
    assert (decision.retry, decision.reason) == (False, "the deadline comes first")
    later = decide(
        retryable=True, attempt=1, limit=9, deadline_at=NOW + timedelta(seconds=1), now=NOW
    )
    assert later.retry
