"""Times as HTTP carries them: our timestamps (ISO 8601 in UTC, ending in ``Z``), and the
wait a ``Retry-After`` header asks for (a webhook receiver's, a remote agent's)."""

from __future__ import annotations

from datetime import UTC, datetime
from email.utils import parsedate_to_datetime


def iso(ts: datetime | None) -> str | None:
    """``2024-05-01T12:00:01.250000Z``; None stays None (a time that has not come)."""
    return None if ts is None else ts.astimezone(UTC).isoformat().replace("+00:00", "Z")


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent or
    unreadable. Any text the server sends is read without raising: ``str.isdigit`` holds
    for other scripts' digits and ``²`` (which ``float`` refuses), and a date's year may be
    past what ``datetime`` holds."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return max((when - (now or datetime.now(UTC))).total_seconds(), 0.0)
    except (TypeError, ValueError, OverflowError):
        return None


def agent_retry_after(value: str | None) -> float | None:
    """The wait a remote agent's ``Retry-After`` asks for: seconds (a fraction too, which a
    receiver's header is not allowed), or an HTTP date (RFC 9110 10.2.3); None for none, or
    for what is no wait (NaN, a negative number, text)."""
    try:
        seconds = float(value) if value else None
    except ValueError:
        return parse_retry_after(value)
    # NaN and a negative wait are no wait asked for: the usual back-off, not none at all
    return seconds if seconds is not None and seconds >= 0 else None
