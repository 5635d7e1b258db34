"""What an attempt's outcome means for its delivery, and when the next attempt is due.

2xx                      delivered
410 Gone                 failed for good, and the subscription is disabled
408, 429, 5xx            try again on the schedule (honouring Retry-After)
no response (timeout, refused, reset, DNS)   try again on the schedule
any other status (3xx redirects too), a refused address   failed, not retried
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

PENDING, SENDING = "pending", "sending"
SUCCEEDED, FAILED, DEAD = "succeeded", "failed", "dead"
DELIVERY_STATUSES = (PENDING, SENDING, SUCCEEDED, FAILED, DEAD)
FINISHED = frozenset({SUCCEEDED, FAILED, DEAD})
# Why a delivery ended with no attempt: its body goes with its task.
TASK_EXPIRED = "the task expired before the message was delivered; its body is gone"

Verdict = Literal["delivered", "retry", "failed", "gone"]
_RETRY_STATUSES = frozenset({408, 429})


@dataclass(frozen=True)
class Outcome:
    """One attempt as the sender saw it."""

    status_code: int | None = None
    error: str | None = None
    latency_ms: int = 0
    address: str | None = None
    excerpt: str | None = None
    retry_after_s: float | None = None
    # False for errors that another attempt cannot fix (a refused address).
    transient: bool = True


def verdict(outcome: Outcome) -> Verdict:
    code = outcome.status_code
    if code is None:
        return "retry" if outcome.transient else "failed"
    if 200 <= code < 300:
        return "delivered"
    if code == 410:
        return "gone"
    if code in _RETRY_STATUSES or code >= 500:
        return "retry"
    return "failed"


def next_delay_s(
    schedule: list[float],
    attempts_made: int,
    *,
    jitter: float,
    retry_after_s: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """The wait before attempt ``attempts_made + 1``: its scheduled delay with proportional
    jitter (so endpoints that fail together are not retried in lockstep), and never earlier
    than a Retry-After the receiver asked for, capped at the schedule's longest delay."""
    base = schedule[min(attempts_made, len(schedule) - 1)]
    spread = (rng or random).uniform(-jitter, jitter)
    delay = base * (1 + spread)
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, max(schedule)))
    return max(delay, 0.0)


def status_after(verdict: Verdict, attempt: int, final_attempt: int) -> str:
    """The delivery's status once attempt number ``attempt`` ended with ``verdict``."""
    if verdict == "delivered":
        return SUCCEEDED
    if verdict == "retry":
        return PENDING if attempt < final_attempt else DEAD
    return FAILED
