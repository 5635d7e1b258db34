"""When a failed attempt runs again: only for retryable failures, with exponential back-off
and jitter, within the attempt limit and never past the deadline."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

BASE_S = 0.2
FACTOR = 2.0
CAP_S = 60.0
DEFAULT_MAX_ATTEMPTS = 3


def backoff_s(attempt: int, rng: random.Random | None = None) -> float:
    """Delay before attempt ``attempt + 1``: half the exponential step plus a random half, so
    failures that happened together do not retry together."""
    step = min(CAP_S, BASE_S * FACTOR ** max(0, attempt - 1))
    return step / 2 + (rng or random).uniform(0, step / 2)


def attempt_limit(requested: int | None, card_limit: int | None) -> int:
    """The smaller of what the envelope asked for and what the agent's card allows."""
    card = card_limit or DEFAULT_MAX_ATTEMPTS
    return min(requested, card) if requested is not None else card


@dataclass(frozen=True)
class Decision:
    retry: bool
    delay_s: float = 0.0
    reason: str = ""


def decide(
    *,
    retryable: bool,
    attempt: int,
    limit: int,
    deadline_at: datetime | None,
    now: datetime,
    requested_delay_s: float | None = None,
    rng: random.Random | None = None,
) -> Decision:
    if not retryable:
        return Decision(False, reason="not retryable")
    if attempt >= limit:
        return Decision(False, reason=f"attempt {attempt} of {limit}")
    delay = requested_delay_s if requested_delay_s is not None else backoff_s(attempt, rng)
    if deadline_at is not None and now + timedelta(seconds=delay) >= deadline_at:
        return Decision(False, reason="the deadline comes first")
    return Decision(True, delay_s=delay)
