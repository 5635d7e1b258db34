"""The event loop and the garbage collector's thresholds as a server process sets them."""

from __future__ import annotations

import asyncio
import builtins
import gc
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
