"""What a handler receives besides its payload: who it is working for and how to report."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from broker.observability.tracing import traceparent
from broker.tasks.resource import storable
from workers.sdk.session import Session

ProgressSink = Callable[[dict[str, Any]], object]
ReadinessSink = Callable[[bool, float], object]
OutputSink = Callable[[Any], object]
AsyncOutputSink = Callable[[Any], Awaitable[object]]
# A progress report's message, in characters: it is written to the task's row and its event.
PROGRESS_MESSAGE_MAX = 1000


@dataclass
class Context:
    task_id: uuid.UUID
    capability: str
    trace_id: str
    attempt: int
    deadline_at: datetime | None = None
    session_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # The task's session as its claim read it (``workers.sdk.session``); None without one.
    session: Session | None = None
    _progress_sink: ProgressSink | None = field(default=None, repr=False)
    # Whether the task's rate of reports lets one more through (and takes it).
    _progress_gate: Callable[[], bool] | None = field(default=None, repr=False)
    _readiness_sink: ReadinessSink | None = field(default=None, repr=False)
    _output_sink: OutputSink | None = field(default=None, repr=False)
    _cancel_probe: Callable[[], bool] | None = field(default=None, repr=False)
    # Set when the task runs on the event loop itself (the threads pool's direct path): its
    # outputs are appended from the loop, with no thread per chunk.
    _async_output_sink: AsyncOutputSink | None = field(default=None, repr=False)

    def time_left_s(self) -> float | None:
        """Seconds until the task's deadline, or None when it has none."""
        if self.deadline_at is None:
            return None
        return max(0.0, (self.deadline_at - datetime.now(UTC)).total_seconds())

    def progress(self, percent: float, message: str | None = None) -> None:
        """Report how far along the task is: pollers see it on the task, streams as an event.
        What no Postgres text holds (NUL, a lone surrogate) becomes U+FFFD in the message.
        Reports past the task's rate are dropped."""
        report = self._report(percent, message)
        if report is not None and self._progress_sink is not None:
            self._progress_sink(report)

    def _report(self, percent: float, message: str | None) -> dict[str, Any] | None:
        """The report to write, checked; None when the task's rate of reports drops it."""
        if isinstance(percent, bool) or not isinstance(percent, int | float):
            raise TypeError(f"percent must be a number, not {type(percent).__name__}")
        if message is not None and not isinstance(message, str):
            raise TypeError(f"a progress message must be text, not {type(message).__name__}")
        if not 0 <= percent <= 100:
            raise ValueError("percent must be between 0 and 100")
        if message is not None and len(message) > PROGRESS_MESSAGE_MAX:
            raise ValueError(f"a progress message has at most {PROGRESS_MESSAGE_MAX} characters")
        if message is not None:  # a NUL or a lone surrogate failed the task's row's write
            message = storable(message, PROGRESS_MESSAGE_MAX)
        if self._progress_gate is not None and not self._progress_gate():
            return None
        return {"percent": percent, "message": message}

    def trace_headers(self) -> dict[str, str]:
        """Headers that carry this task's trace id into the HTTP calls the agent makes."""
        return {
            "traceparent": traceparent(self.trace_id),
            "X-Trace-Id": self.trace_id,
        }

    @property
    def cancelled(self) -> bool:
        """The caller cancelled this task: stop as soon as it is safe. Whatever the handler
        returns afterwards is discarded; the task stays ``cancelled``."""
        return self._cancel_probe is not None and self._cancel_probe()

    def emit(self, chunk: Any) -> None:
        """Send a partial output (any JSON value) to whoever streams this task."""
        if self._output_sink is not None:
            self._output_sink(chunk)

    async def progress_async(self, percent: float, message: str | None = None) -> None:
        """``progress`` for an async handler: the write runs off the event loop. A report past
        the task's rate is dropped on the loop, taking no thread (a remote agent streaming
        reports had each wait for one of the threads that every task's writes share)."""
        report = self._report(percent, message)
        if report is not None and self._progress_sink is not None:
            await asyncio.to_thread(self._progress_sink, report)

    async def emit_async(self, chunk: Any) -> None:
        """``emit`` for an async handler: the write does not block the event loop. Chunks
        awaited one after another arrive in that order."""
        if self._async_output_sink is not None:
            await self._async_output_sink(chunk)
        else:
            await asyncio.to_thread(self.emit, chunk)

    def not_ready(self, for_s: float = 30.0) -> None:
        """This agent cannot take more work for a while (say its model is rate-limited): its
        worker stops taking this capability's tasks for ``for_s`` seconds, or until
        ``ready()``, while it stays alive. Applied at the next lease renewal."""
        if for_s <= 0:
            raise ValueError("for_s must be positive")
        if self._readiness_sink is not None:
            self._readiness_sink(False, for_s)

    def ready(self) -> None:
        """Take this capability's tasks again."""
        if self._readiness_sink is not None:
            self._readiness_sink(True, 0.0)
