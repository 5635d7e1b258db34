"""The event loop and the garbage collector's thresholds as a server process sets them."""

from __future__ import annotations

import asyncio
import builtins
import gc
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop

from broker import runtime
from broker.settings import Settings


@pytest.fixture(autouse=True)
def thresholds_restored() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_the_youngest_generation_is_collected_less_often_and_the_others_are_kept() -> None:
    gc.set_threshold(700, 11, 12)
    runtime.tune_collector(4321)
    assert gc.get_threshold() == (4321, 11, 12)


def test_zero_leaves_the_interpreters_thresholds() -> None:
    gc.set_threshold(700, 10, 10)
    runtime.tune_collector(0)
    assert gc.get_threshold() == (runtime.PYTHON_GEN0_THRESHOLD, 10, 10)


def test_the_default_collects_it_every_ten_thousand_net_allocations() -> None:
    assert Settings().gc_gen0_threshold == 10_000


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="gc_gen0_threshold"):
        Settings(gc_gen0_threshold=-1)


def test_uvloop_is_the_default_loop_for_async_handlers() -> None:
    assert Settings().event_loop == "uvloop"
    loop = runtime.new_event_loop("uvloop")
    try:
        assert isinstance(loop, uvloop.Loop)
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
    finally:
        loop.close()


def test_asyncios_own_loop_when_asked() -> None:
    loop = runtime.new_event_loop("asyncio")
    try:
        assert not isinstance(loop, uvloop.Loop)
        assert isinstance(loop, asyncio.BaseEventLoop)
    finally:
        loop.close()


def test_asyncios_loop_where_uvloop_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def without_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_uvloop)
    loop = runtime.new_event_loop("uvloop")
    try:
        assert not isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_an_unknown_loop_is_refused() -> None:
    with pytest.raises(ValueError, match="event_loop"):
        Settings(event_loop="trio")


@pytest.fixture
def stock_wait_for() -> Iterator[Any]:
    """The interpreter's own ``asyncio.wait_for``; what was installed is put back after the
    test (the API's tests in this process may have installed 3.12's already)."""
    installed = asyncio.wait_for
    yield runtime.STOCK_WAIT_FOR
    asyncio.wait_for = asyncio.tasks.wait_for = installed


async def _cancelled_as_the_result_lands(wait_for: Any) -> Any:
    """A task waiting in ``wait_for`` is cancelled in the same turn of the loop as the result
    it waits for arrives: what the task then comes to."""
    result: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(wait_for(result, 10))
    await asyncio.sleep(0)  # it waits
    result.set_result("the result")
    waiting.cancel()
    try:
        return await waiting
    except asyncio.CancelledError:
        return "cancelled"


def test_a_cancel_landing_with_wait_fors_result_is_kept(stock_wait_for: Any) -> None:
    runtime.keep_cancels()

    assert asyncio.run(_cancelled_as_the_result_lands(asyncio.wait_for)) == "cancelled"
    # What the interpreter's own did (3.11: the cancel was lost; 3.12 keeps it)
    stock = asyncio.run(_cancelled_as_the_result_lands(stock_wait_for))
    assert stock == ("the result" if sys.version_info < (3, 12) else "cancelled")


def test_wait_for_still_times_out_and_answers(stock_wait_for: Any) -> None:
    runtime.keep_cancels()

    async def scenario() -> None:
        assert await asyncio.wait_for(asyncio.sleep(0, "done"), 1) == "done"
        assert await asyncio.wait_for(asyncio.sleep(0, "done"), None) == "done"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), 0.01)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), 0)

    asyncio.run(scenario())
