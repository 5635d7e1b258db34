"""Every error the client raises, one tree with one root:

    ReachError                      .code .status .detail .trace_id .problem
    ├── APIConnectionError          no answer: refused, reset, DNS (status None), or one
    │   │                           past the client's cap (``answer_too_large``); ``sent``
    │   │                           False: it failed before the request went out
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
    ├── UnexpectedAnswerError       an answer the client cannot read: not JSON, or not the
    │   │                           shape the API gives (``unexpected_answer``)
    │   └── RedirectError           a 3xx, which the API never answers (``redirected``,
    │                               ``location``)
    ├── WaitTimeoutError            the task was not final within the caller's wait (``task``
    │                               as last seen; None: ``idempotency_key`` finds it)
    ├── TaskFailedError             ``Task.raise_for_status()`` on a task that did not succeed
    └── WebhookVerificationError    a webhook call that is not signed by the secret

Problems are mapped by their stable ``code`` first, then by HTTP status. An error out of a
submit carries the ``idempotency_key`` it was sent with, the caller's or one made for the
call: a submit again with it reaches the task the first one made, if it made one (an API that
died after accepting it, say), and never makes a second.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reach_client.models import Task


class ReachError(Exception):
    """The root: ``code`` is stable (the API's problem code, or the client's own)."""

    # Out of a submit: the key it was sent with (see the module's docstring).
    idempotency_key: str | None = None

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
    """No answer. ``sent`` is False when the connection failed before the request went out
    (refused, unreachable, no connection in time), so the server cannot have acted on it."""

    def __init__(self, detail: str, *, code: str = "connection_error", sent: bool = True) -> None:
        super().__init__(detail, code=code)
        self.sent = sent


class APITimeoutError(APIConnectionError):
    def __init__(self, detail: str = "the request timed out", *, sent: bool = True) -> None:
        super().__init__(detail, code="timeout", sent=sent)


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


class UnexpectedAnswerError(ReachError):
    """An answer the client cannot read: a body that is not JSON, or not the shape the API
    gives, or an event stream that is none. Asking again would bring the same."""

    def __init__(
        self, detail: str, *, code: str = "unexpected_answer", status: int | None = None
    ) -> None:
        super().__init__(detail, code=code, status=status)


class RedirectError(UnexpectedAnswerError):
    """A 3xx: the API never redirects, so the URL names something in front of it (http to
    https, a moved host); ``location`` is where it pointed, None when it named nothing."""

    def __init__(self, status: int, location: str | None) -> None:
        where = f"redirected to {location}" if location else f"answered {status} with no Location"
        super().__init__(
            f"the server {where}; set REACH_URL (or base_url) to the API's own address",
            code="redirected",
            status=status,
        )
        self.location = location


class WaitTimeoutError(ReachError):
    """The wait ran out; ``task`` is the task as last seen (still queued or running), None
    when no answer named it in time: the submit's ``idempotency_key`` then finds it (the
    same envelope submitted again with that key answers with that task, or makes it)."""

    def __init__(
        self, task: Task | None, *, task_id: str | None = None, idempotency_key: str | None = None
    ) -> None:
        if task is not None:
            detail = f"task {task.task_id} is still {task.status}"
        elif task_id is not None:
            detail = f"no answer about task {task_id} within the wait"
        else:
            detail = f"no answer named the task within the wait (key {idempotency_key})"
        super().__init__(
            detail, code="wait_timeout", trace_id=task.trace_id if task is not None else None
        )
        self.task = task
        self.idempotency_key = idempotency_key


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
