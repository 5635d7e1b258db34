"""The handler's context: what it refuses before anything is written."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from workers.sdk.context import PROGRESS_MESSAGE_MAX, Context


def context(reports: list[dict[str, Any]]) -> Context:
    return Context(
        task_id=uuid.uuid4(),
        capability="x",
        trace_id="t",
        attempt=1,
        _progress_sink=reports.append,
    )


def test_a_progress_message_past_its_length_is_refused_and_not_reported() -> None:
    reports: list[dict[str, Any]] = []
    ctx = context(reports)
    ctx.progress(10, "m" * PROGRESS_MESSAGE_MAX)
    with pytest.raises(ValueError, match="at most 1000 characters"):
        ctx.progress(20, "m" * (PROGRESS_MESSAGE_MAX + 1))
    assert reports == [{"percent": 10, "message": "m" * PROGRESS_MESSAGE_MAX}]


@pytest.mark.parametrize("percent", [-1, 100.5])
def test_a_percent_outside_0_to_100_is_refused(percent: float) -> None:
    reports: list[dict[str, Any]] = []
    with pytest.raises(ValueError, match="between 0 and 100"):
        context(reports).progress(percent)
    assert reports == []
