"""The garbage collector's thresholds as a server process sets them."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

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
