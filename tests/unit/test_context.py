"""The handler's context: what it refuses before anything is written."""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
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


@pytest.mark.parametrize("percent", [Decimal("50"), "50", True, None])
def test_a_percent_that_is_no_number_is_refused(percent: Any) -> None:
    """A ``Decimal`` passed the range check, then failed its task when Postgres could not
    store it; a bool is no percentage."""
    reports: list[dict[str, Any]] = []
    with pytest.raises(TypeError, match="percent must be a number"):
        context(reports).progress(percent)
    assert reports == []


def test_a_progress_message_that_is_no_text_is_refused() -> None:
    """``b"bytes"`` was stored as the text ``b'bytes'``."""
    reports: list[dict[str, Any]] = []
    with pytest.raises(TypeError, match="must be text, not bytes"):
        context(reports).progress(10, b"bytes")  # type: ignore[arg-type]
    context(reports).progress(10.5, "half")
    assert reports == [{"percent": 10.5, "message": "half"}]


def test_an_async_report_past_the_tasks_rate_is_dropped_without_a_thread() -> None:
    """A remote agent's stream of reports each took one of the threads every task's writes
    share, to be dropped there by the rate."""
    reports: list[dict[str, Any]] = []
    allowed = iter([False, False, False, True])  # three past the rate, then one let through
    ctx = context(reports)
    ctx._progress_gate = lambda: next(allowed)

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        busy = threading.Event()
        held = loop.run_in_executor(None, busy.wait)  # the one thread, taken
        reporting = asyncio.gather(*(ctx.progress_async(n) for n in (20, 30, 40)))
        for _ in range(10):
            await asyncio.sleep(0)
        dropped_at_once = reporting.done()
        busy.set()
        await held
        await reporting
        await ctx.progress_async(50)  # let through: written from a thread
        return dropped_at_once

    assert asyncio.run(main()), "a dropped report waited for a thread"
    assert reports == [{"percent": 50, "message": None}]
