"""Trace ids: taken from W3C ``traceparent`` or ``X-Trace-Id``, made when absent, and
passed on in a ``traceparent`` of our own."""

from __future__ import annotations

import re
import secrets

from broker.ids import unique_hex

_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_ZERO = "0" * 32


def new_trace_id() -> str:
    return secrets.token_hex(16)


def traceparent(trace_id: str) -> str:
    """A W3C ``traceparent`` that carries ``trace_id`` on: a new parent span id, sampled."""
    return f"00-{trace_id}-{unique_hex(64)}-01"


def trace_id_from(traceparent: str | None, x_trace_id: str | None) -> str:
    """The caller's trace id when it is well formed, else a new one (never trust junk)."""
    if traceparent:
        match = _TRACEPARENT.fullmatch(traceparent.strip().lower())
        if match and match.group(1) != _ZERO:
            return match.group(1)
    if x_trace_id:
        candidate = x_trace_id.strip().lower().replace("-", "")
        if _TRACE_ID.fullmatch(candidate) and candidate != _ZERO:
            return candidate
    return new_trace_id()
