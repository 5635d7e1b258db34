"""What a handler receives besides its payload: who it is working for and how to report."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

ProgressSink = Callable[[dict[str, Any]], object]


@dataclass
class Context:
    task_id: uuid.UUID
    capability: str
    trace_id: str
    attempt: int
    deadline_at: datetime | None = None
    session_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    _progress_sink: ProgressSink | None = field(default=None, repr=False)

    def time_left_s(self) -> float | None:
        """Seconds until the task's deadline, or None when it has none."""
        if self.deadline_at is None:
            return None
        return max(0.0, (self.deadline_at - datetime.now(UTC)).total_seconds())

    def progress(self, percent: float, message: str | None = None) -> None:
        """Report how far along the task is; pollers see it on the task resource."""
        if not 0 <= percent <= 100:
            raise ValueError("percent must be between 0 and 100")
        if self._progress_sink is not None:
            self._progress_sink({"percent": percent, "message": message})
