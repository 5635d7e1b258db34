"""An async handler's time (``workers.aio``): its own clock, started with it. The direct path
(``Calls.arun``) waits for the ``running`` event's write first; the handler's time was
counted only after that, so a handler got that wait on top of its limit, and a result it
returned past its limit was taken. It is cancelled once at its limit, by the waiting side:
a second cancel of its own cut short the cleanup a cancelled handler runs
(``test_async_agents.py::test_an_async_handler_past_the_tasks_deadline_is_cancelled_and_expires``)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from workers.aio import Calls, CallTimedOut


def a_calls() -> Calls:
    calls = Calls("redis://127.0.0.1:9/0")  # never started: nothing connects
    calls._listening_since = time.monotonic()  # as if subscribed
    return calls


async def _not_cancelled() -> bool:
    return False


def _arun(handler_s: float, limit_s: float, started_s: float, *, holds_on: bool = False) -> str:
    """``arun`` of a handler that takes ``handler_s`` (``holds_on``: and swallows its cancel,
    returning anyway), limited to ``limit_s``, its ``running`` event taking ``started_s``."""

    async def handler() -> str:
        try:
            await asyncio.sleep(handler_s)
        except asyncio.CancelledError:
            if not holds_on:
                raise
            await asyncio.sleep(handler_s)
        return "its result"

    async def started() -> None:
        await asyncio.sleep(started_s)

    async def main() -> str:
        answer: str = await a_calls().arun(
            uuid.uuid4(),
            handler(),
            timeout_s=limit_s,
            claimed_at=time.monotonic(),
            cancelled=_not_cancelled,
            started=started,
        )
        return answer

    return asyncio.run(main())


def test_a_result_that_comes_past_the_limit_while_the_running_event_is_written_times_out() -> None:
    with pytest.raises(CallTimedOut):
        _arun(handler_s=0.25, limit_s=0.1, started_s=0.4)


def test_a_result_within_the_limit_is_taken_however_long_the_running_event_took() -> None:
    assert _arun(handler_s=0.05, limit_s=0.2, started_s=0.4) == "its result"


def test_a_handler_that_swallows_its_cancel_and_returns_late_times_out() -> None:
    with pytest.raises(CallTimedOut):
        _arun(handler_s=0.15, limit_s=0.1, started_s=0.5, holds_on=True)
