"""Trace ids: taken from W3C ``traceparent`` or ``X-Trace-Id``, made when absent, and
passed on in a ``traceparent`` of our own."""

from __future__ import annotations

import re
import secrets

from broker.ids import unique_hex

# W3C Trace Context, as OpenTelemetry's propagator reads it: lowercase hex only; version ff
# is invalid; version 00 has exactly four fields, a later one may add more after a dash.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?")
_ZERO_PARENT = "0" * 16
_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_ZERO = "0" * 32


def new_trace_id() -> str:
    return secrets.token_hex(16)


def traceparent(trace_id: str) -> str:
    """A W3C ``traceparent`` that carries ``trace_id`` on: a new parent span id, sampled."""
    return f"00-{trace_id}-{unique_hex(64)}-01"


def traceparent_trace_id(traceparent: str | None) -> str | None:
    """The trace id of a valid W3C ``traceparent``; None for any other. Read as
    OpenTelemetry reads it, so that with it on our trace id and the spans' agree."""
    match = _TRACEPARENT.fullmatch(traceparent.strip()) if traceparent else None
    if match is None:
        return None
    version, trace_id, parent_id, more = match.groups()
    if version == "ff" or (version == "00" and more is not None):
        return None
    if trace_id == _ZERO or parent_id == _ZERO_PARENT:
        return None
    return trace_id


def trace_id_from(traceparent: str | None, x_trace_id: str | None) -> str:
    """The caller's trace id when it is well formed, else a new one (never trust junk): a
    valid ``traceparent``'s, else ``X-Trace-Id``'s (32 hex digits, any case, dashes allowed
    as in a UUID)."""
    from_traceparent = traceparent_trace_id(traceparent)
    if from_traceparent is not None:
        return from_traceparent
    if x_trace_id:
        candidate = x_trace_id.strip().lower().replace("-", "")
        if _TRACE_ID.fullmatch(candidate) and candidate != _ZERO:
            return candidate
    return new_trace_id()
