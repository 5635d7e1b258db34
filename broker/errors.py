"""The error tree of Agent-Reach. Every error carries a stable ``code``.

    ReachError
    ├── BadRequest            the request itself is malformed or violates a limit
    │   ├── BodyTooLarge      the body exceeds the configured size
    │   ├── BodyTimeout       the body did not arrive in time
    │   └── InvalidEnvelope   the envelope or payload fails validation
    ├── Unauthenticated       missing, unknown or revoked API key
    ├── Forbidden             the key may not do this (capability outside its patterns,
    │                         a tenant-wide setting, an operator action)
    ├── NotFound              no such resource for this tenant (also: another tenant's, or
    │                         one outside the key's patterns)
    ├── Gone                  it existed and never will again (a revoked version)
    ├── Conflict              the resource is in a state that does not allow this
    ├── Unavailable           a dependency (Postgres, Redis, the queue) cannot be reached
    └── AgentFailure          raised by agent code: the task fails with ``code``
        └── Retryable         ... unless attempts remain: then it runs again later

HTTP statuses for each code live in one table in ``api/errors.py``.

Which exceptions from outside the tree mean an outage, ours or an agent's network's:
``broker/outages.py``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


class ReachError(Exception):
    code: str = "reach_error"

    def __init__(self, message: str, *, code: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details = details


class BadRequest(ReachError):
    code = "bad_request"


class BodyTooLarge(BadRequest):
    code = "body_too_large"


class BodyTimeout(BadRequest):
    code = "body_timeout"


class InvalidEnvelope(BadRequest):
    code = "envelope_invalid"


class Unauthenticated(ReachError):
    code = "unauthenticated"


class Forbidden(ReachError):
    code = "forbidden"


class NotFound(ReachError):
    code = "not_found"


class Gone(ReachError):
    code = "gone"


class Conflict(ReachError):
    code = "conflict"


class Unavailable(ReachError):
    code = "service_unavailable"


class AgentFailure(ReachError):
    """Raised by an agent to fail its task with a chosen code.

    ``retryable`` tells the caller whether submitting again may succeed.
    """

    code = "agent_error"

    def __init__(self, message: str, *, code: str | None = None, retryable: bool = False) -> None:
        super().__init__(message, code=code)
        self.retryable = retryable


class Retryable(AgentFailure):
    """Raised by an agent when trying again later may succeed (a rate limit, a flaky
    dependency). ``delay_s`` overrides the back-off before the next attempt: seconds, as a
    number, a ``timedelta`` or text (a ``Retry-After`` passed on); what is not read as
    seconds leaves the back-off as it is."""

    code = "retryable_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        delay_s: float | timedelta | str | None = None,
    ) -> None:
        super().__init__(message, code=code, retryable=True)
        self.delay_s = delay_s


class EventsTooLarge(AgentFailure):
    """Raised by ``ctx.emit`` and ``ctx.progress`` when the task's progress and outputs would
    pass their budget (``REACH_EVENT_LOG_MAX_BYTES``): the event is not sent, and the task
    fails with it unless the handler catches it and goes on without sending more."""

    code = "events_too_large"

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the agent's events passed the task's budget of {max_bytes} bytes")
