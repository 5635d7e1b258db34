"""A task's event stream: SSE frames decoded, and the bookkeeping that lets a dropped
connection resume with ``Last-Event-ID`` so that no event is missed and none comes twice.
Pure: the clients own the sockets."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping

from reach_client.errors import (
    APIConnectionError,
    APIStatusError,
    ReachError,
    UnexpectedAnswerError,
)
from reach_client.limits import MAX_ANSWER_BYTES, TOO_LARGE, Buffer, bound
from reach_client.models import Event
from reach_client.operations.tasks import events_request
from reach_client.plans import Request
from reach_client.retries import RETRY_STATUSES, RetryPolicy

LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def expect_event_stream(status: int, headers: Mapping[str, str]) -> None:
    """``UnexpectedAnswerError`` unless a 2xx answer is an event stream: a page or a JSON
    body would read as a stream without events, opened again until the retries ran out."""
    kind = headers.get("content-type", "")
    if kind.partition(";")[0].strip().lower() != "text/event-stream":
        raise UnexpectedAnswerError(
            f"the task's events came as {kind or 'no content type'}, not text/event-stream",
            status=status,
        )


class SSEDecoder:
    """``text/event-stream`` (WHATWG HTML 9.2) in, as bytes or as lines, events out. Comments
    (``: ping``) and frames without data are skipped. A line or an event past the cap of
    ``reach_client.limits`` raises ``APIConnectionError``; an event whose data is not the
    API's JSON, ``UnexpectedAnswerError``."""

    def __init__(self, cap: int = MAX_ANSWER_BYTES) -> None:
        self._cap = cap
        self._id = ""
        self._type = ""
        self._data: list[str] = []
        self._size = 0
        self._line = Buffer("a line of the event stream", cap)
        self._after_cr = False

    def decode(self, piece: bytes) -> list[Event]:
        """The events that ``piece``, the next bytes of the stream, completes."""
        if not piece:
            return []
        if self._after_cr and piece.startswith(b"\n"):
            piece = piece[1:]  # the rest of a CRLF that the last piece cut in two
        self._after_cr = piece.endswith(b"\r")
        *ended, rest = LINE_BREAK.split(piece)
        events = []
        for part in ended:
            self._line.add(part)
            event = self.feed(self._line.take().decode("utf-8", "replace"))
            if event is not None:
                events.append(event)
        self._line.add(rest)
        return events

    def feed(self, line: str) -> Event | None:
        """The event a blank line completes, else None."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id" and "\0" not in value:
            self._id = value
        elif name == "event":
            self._type = value
        elif name == "data":
            # Bytes as the stream carried them (UTF-8), not characters: the cap is in bytes.
            self._size += len(value.encode("utf-8", "surrogatepass")) + 1
            bound(self._size, "an event of the event stream", self._cap)
            self._data.append(value)
        return None

    def _dispatch(self) -> Event | None:
        data, event_type = "\n".join(self._data), self._type or "message"
        self._data, self._type, self._size = [], "", 0
        if not data:
            return None
        try:
            return Event.from_sse(self._id, event_type, data)
        except (ValueError, TypeError, AttributeError) as exc:
            raise UnexpectedAnswerError(
                f"an event of the stream the client cannot read: {type(exc).__name__}: {exc}"
            ) from exc


class Resume:
    """What one stream of a task has delivered. ``request()`` opens (or reopens) it after the
    last event seen; ``accept`` drops anything already delivered; the stream is ``done`` after
    the final event. ``dropped`` says how long to wait before reconnecting, or raises once
    ``policy.max_retries`` reconnects in a row brought nothing new and the first of them is
    ``policy.stream_reconnect_s`` ago: a stream outlives an API's restart, which its retries
    alone (1.5 s) did not. ``clock``: seconds, for the tests."""

    def __init__(
        self,
        task_id: str,
        policy: RetryPolicy,
        after: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.task_id = task_id
        self.policy = policy
        self.last_id = after
        self.done = False
        self.failures = 0
        self.failing_since: float | None = None
        self.clock = clock

    def request(self) -> Request:
        return events_request(self.task_id, self.last_id)

    def accept(self, event: Event) -> bool:
        if self.last_id is not None and event.id <= self.last_id:
            return False
        self.last_id = event.id
        self.failures = 0
        self.failing_since = None
        self.done = event.final
        return True

    def dropped(self, error: ReachError | None) -> float:
        """The pause before reconnecting after ``error`` (None: the server ended the stream
        before the final event)."""
        if isinstance(error, APIStatusError) and error.status not in RETRY_STATUSES:
            raise error
        if error is not None and error.code == TOO_LARGE:
            raise error
        self.failures += 1
        now = self.clock()
        if self.failing_since is None:
            self.failing_since = now
        away_s = now - self.failing_since
        if self.failures > self.policy.max_retries and away_s >= self.policy.stream_reconnect_s:
            raise error or APIConnectionError(
                f"the event stream of task {self.task_id} kept ending before its final event"
            )
        if not isinstance(error, APIStatusError) or error.retry_after_s is None:
            return self.policy.backoff_s(self.failures)
        if error.retry_after_s > self.policy.max_retry_after_s:
            raise error  # as a request's retry: a wait that long is the caller's to choose
        return error.retry_after_s
