"""The API's system gauges refresher ends when the app's lifespan cancels it."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

from api import system_gauges


def test_given_a_cancel_swallowed_in_a_refresh_expect_the_refresher_to_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a refresh that swallows the first cancel it gets, as a library call below it might
    refreshes: list[int] = []

    async def cancel_it() -> asyncio.Task[None]:
        entered = asyncio.Event()

        async def swallowing(state: Any) -> None:
            refreshes.append(1)
            entered.set()
            if len(refreshes) == 1:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(30)

        monkeypatch.setattr(system_gauges, "refresh", swallowing)
        task = asyncio.create_task(system_gauges.keep_fresh(SimpleNamespace(), every_s=0.01))
        await entered.wait()
        # When the app's lifespan cancels it in that refresh
        task.cancel()
        await asyncio.wait({task}, timeout=10)
        return task

    task = asyncio.run(cancel_it())
    # Then it ends cancelled. Before, it went on refreshing, and the app's shutdown, which
    # awaits it, never ended (CI saw an API served in a test that did not stop).
    assert task.done() and task.cancelled()
    assert len(refreshes) == 1
