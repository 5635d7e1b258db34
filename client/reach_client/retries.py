"""When a request is tried again, and after how long: pure, so it is tested without a clock.

Retried: no answer at all (connection refused or reset, timeout), 408, 429, 502, 503 and 504,
and a 409 ``conflict_retry`` (a submit whose idempotency key was being released as it came:
the API asks for the same request again).
A GET changes nothing, and a request with ``Idempotency-Key`` is answered on a repeat with
the first outcome: those are retried for any of these. Any other request (a session's PUT or
PATCH, a compare-and-set on ``If-Match``; a DELETE; a POST without a key) is retried only when
it was surely not applied: the connection failed before it went out, or the server refused it
with 429 or 503. Once it may have been applied, a repeat would report a change that took as a
412 ``revision_conflict`` or a 404, or make it twice.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})
RETRY_CODES = frozenset({"conflict_retry"})  # a problem's code, whatever its status
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Refusals before the request was acted on (rate limits, overload): safe to send again.
NOT_APPLIED_STATUSES = frozenset({429, 503})
# A gateway that gave up on the API (or found none): the request may still be running.
GATEWAY_STATUSES = frozenset({502, 504})


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 2
    initial_delay_s: float = 0.5
    max_delay_s: float = 8.0
    # A Retry-After past this is not waited for: the error goes to the caller instead.
    max_retry_after_s: float = 60.0
    # A stream gives up after ``max_retries`` reconnects in a row that brought nothing, and
    # not before this long without an event: an API restarting (a deploy) is away 5-15 s.
    stream_reconnect_s: float = 30.0

    def backoff_s(self, retry: int, rng: random.Random | None = None) -> float:
        """The wait before retry number ``retry`` (1, 2, ...): doubling from the initial
        delay, capped, less up to a quarter at random so that many clients spread out."""
        base = min(self.initial_delay_s * 2.0 ** (retry - 1), self.max_delay_s)
        return base * (1 - 0.25 * (rng or random).random())

    def delay_s(self, retry: int, retry_after: str | None) -> float | None:
        """How long to wait before retry ``retry``: the server's ``Retry-After`` when it gives
        one, else the backoff. None when the server asks for longer than we would wait."""
        asked = parse_retry_after(retry_after)
        if asked is None:
            return self.backoff_s(retry)
        return asked if asked <= self.max_retry_after_s else None


def is_retried(status: int, code: str | None) -> bool:
    """Whether an answer of ``status`` with the problem ``code`` is worth the same request
    again."""
    return status in RETRY_STATUSES or code in RETRY_CODES


def may_retry(method: str, has_idempotency_key: bool) -> bool:
    """Whether a request may be sent again whatever became of the last try."""
    return method.upper() in SAFE_METHODS or has_idempotency_key


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds from ``Retry-After``: delta-seconds or an HTTP date (RFC 9110 10.2.3); None
    when absent or unreadable. Any text a server sends is read without raising: ``float``
    refuses ``²`` (which ``str.isdigit`` takes), reads ``nan`` and ``inf``, and a date's year
    may be past what ``datetime`` holds (OverflowError)."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
