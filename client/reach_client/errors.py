"""Every error the client raises, one tree with one root:

    ReachError                      .code .status .detail .trace_id .problem
    ├── APIConnectionError          no answer: refused, reset, DNS (status None), or one
    │   │                           past the client's cap (``answer_too_large``)
    │   └── APITimeoutError         no answer in time
    ├── APIStatusError              the API answered with a problem (RFC 9457)
    │   ├── InvalidRequestError     400, 408, 413, 415, 422 and any other 4xx
    │   │   └── PreconditionRequiredError  428: a session write without a revision
    │   ├── AuthenticationError     401
    │   ├── PermissionDeniedError   403
    │   ├── NotFoundError           404
    │   ├── ConflictError           409 (e.g. ``task_final``)
    │   ├── RevisionConflictError   412 ``revision_conflict``, with ``current_revision``
    │   ├── RateLimitError          429, with ``retry_after_s``
    │   ├── UnavailableError        503, with ``retry_after_s``
    │   └── InternalServerError     any other 5xx
    ├── WaitTimeoutError            the task was not final within the caller's wait
    ├── TaskFailedError             ``Task.raise_for_status()`` on a task that did not succeed
    └── WebhookVerificationError    a webhook call that is not signed by the secret

Problems are mapped by their stable ``code`` first, then by HTTP status.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reach_client.models import Task


class ReachError(Exception):
    """The root: ``code`` is stable (the API's problem code, or the client's own)."""

    def __init__(
        self,
        detail: str,
        *,
        code: str = "error",
        status: int | None = None,
        trace_id: str | None = None,
        problem: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.code = code
        self.status = status
        self.trace_id = trace_id
        self.problem: Mapping[str, Any] = problem or {}

    def __str__(self) -> str:
        where = f" (HTTP {self.status})" if self.status is not None else ""
        trace = f" [trace {self.trace_id}]" if self.trace_id else ""
        return f"{self.code}{where}: {self.detail}{trace}"


class APIConnectionError(ReachError):
    def __init__(self, detail: str, *, code: str = "connection_error") -> None:
        super().__init__(detail, code=code)


class APITimeoutError(APIConnectionError):
    def __init__(self, detail: str = "the request timed out") -> None:
        super().__init__(detail, code="timeout")


class APIStatusError(ReachError):
    """The API answered with an error status; ``problem`` is its whole problem+json body,
    ``retry_after_s`` its ``Retry-After`` header (429 and 503 carry one)."""

    retry_after_s: float | None = None


class InvalidRequestError(APIStatusError):
    @property
    def errors(self) -> list[Any]:
        """The problem's ``errors`` list (field and rule), when it has one."""
        found = self.problem.get("errors")
        return list(found) if isinstance(found, list) else []


class PreconditionRequiredError(InvalidRequestError):
    pass


class AuthenticationError(APIStatusError):
    pass


class PermissionDeniedError(APIStatusError):
    pass


class NotFoundError(APIStatusError):
    pass


class ConflictError(APIStatusError):
    pass


class RevisionConflictError(APIStatusError):
    @property
    def current_revision(self) -> int | None:
        value = self.problem.get("current_revision")
        return value if isinstance(value, int) else None


class RateLimitError(APIStatusError):
    pass


class UnavailableError(APIStatusError):
    pass


class InternalServerError(APIStatusError):
    pass


class WaitTimeoutError(ReachError):
    """The wait ran out; ``task`` is the task as last seen (still queued or running)."""

    def __init__(self, task: Task) -> None:
        super().__init__(
            f"task {task.task_id} is still {task.status}",
            code="wait_timeout",
            trace_id=task.trace_id,
        )
        self.task = task


class TaskFailedError(ReachError):
    """A task that ended ``failed``, ``expired`` or ``cancelled``; ``code`` is its error's."""

    def __init__(self, task: Task) -> None:
        error = task.error
        super().__init__(
            error.message if error else f"task {task.task_id} ended {task.status}",
            code=error.code if error else task.status,
            trace_id=task.trace_id,
        )
        self.task = task


class WebhookVerificationError(ReachError):
    def __init__(self, detail: str) -> None:
        super().__init__(detail, code="webhook_invalid_signature")


BY_CODE: dict[str, type[APIStatusError]] = {
    "revision_conflict": RevisionConflictError,
    "precondition_required": PreconditionRequiredError,
}
BY_STATUS: dict[int, type[APIStatusError]] = {
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    412: RevisionConflictError,
    428: PreconditionRequiredError,
    429: RateLimitError,
    503: UnavailableError,
}


def error_class(status: int, code: str | None) -> type[APIStatusError]:
    if code in BY_CODE:
        return BY_CODE[code]
    if status in BY_STATUS:
        return BY_STATUS[status]
    return InternalServerError if status >= 500 else InvalidRequestError


def from_problem(
    status: int, body: Any, *, trace_id: str | None = None, retry_after_s: float | None = None
) -> APIStatusError:
    """The error for an answer of ``status`` whose body is ``body`` (parsed JSON, or not)."""
    problem: Mapping[str, Any] = body if isinstance(body, Mapping) else {}
    code = problem.get("code")
    code = code if isinstance(code, str) else f"http_{status}"
    detail = problem.get("detail")
    detail = detail if isinstance(detail, str) else f"HTTP {status}"
    found_trace = problem.get("trace_id")
    error = error_class(status, code)(
        detail,
        code=code,
        status=status,
        trace_id=found_trace if isinstance(found_trace, str) else trace_id,
        problem=problem,
    )
    error.retry_after_s = retry_after_s
    return error
