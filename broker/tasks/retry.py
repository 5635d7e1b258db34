"""When a failed attempt runs again: only for retryable failures, with exponential back-off
and jitter, within the attempt limit and never past the deadline."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import datetime, timedelta

BASE_S = 0.2
FACTOR = 2.0
CAP_S = 60.0
DEFAULT_MAX_ATTEMPTS = 3
# The longest wait an agent may ask for (``Retryable.delay_s``, a remote agent's
# ``Retry-After``): the retry is a countdown message a worker holds in memory until it is due.
REQUESTED_CAP_S = 300.0


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
    requested_delay_s: object = None,
    rng: random.Random | None = None,
) -> Decision:
    if not retryable:
        return Decision(False, reason="not retryable")
    if attempt >= limit:
        return Decision(False, reason=f"attempt {attempt} of {limit}")
    delay = _requested(requested_delay_s)
    if delay is None:
        delay = backoff_s(attempt, rng)
    if deadline_at is not None and now + timedelta(seconds=delay) >= deadline_at:
        return Decision(False, reason="the deadline comes first")
    return Decision(True, delay_s=delay)


def _requested(delay_s: object) -> float | None:
    """The wait an agent asked for, within 0 and ``REQUESTED_CAP_S``: seconds, as a number,
    its text (a ``Retry-After`` passed on) or a ``timedelta``. None (the back-off) when it
    asked for none, or for nothing read as seconds (NaN, ``"soon"``). ``Retry-After: inf``
    from a remote agent overflowed the deadline's arithmetic and left its task running; a
    handler's ``delay_s="2"`` raised here, after its run, and its task ended ``worker_lost``."""
    if delay_s is None or isinstance(delay_s, bool):
        return None
    try:
        seconds = (
            delay_s.total_seconds() if isinstance(delay_s, timedelta) else float(delay_s)  # type: ignore[arg-type]
        )
    except OverflowError:  # an int past a float's range
        seconds = math.inf if delay_s > 0 else 0.0  # type: ignore[operator]
    except (TypeError, ValueError):
        return None
    if math.isnan(seconds):
        return None
    return min(max(seconds, 0.0), REQUESTED_CAP_S)
