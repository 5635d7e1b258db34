"""The group-commit helper's rules, on a stand-in batch function (no services needed)."""

from __future__ import annotations

import asyncio

import pytest

from broker.grouping import Grouped


def _run(retry_alone: bool, items: list[int]) -> tuple[list[object], list[list[int]]]:
    """Every batch of more than one item fails; item 3 fails even alone."""
    calls: list[list[int]] = []

    async def run_many(batch: list[int]) -> list[int]:
        calls.append(batch)
        if len(batch) > 1 or batch == [3]:
            raise ValueError(f"refused {batch}")
        return [n * 10 for n in batch]

    async def main() -> list[object]:
        grouped = Grouped(run_many, max_items=100, name="test", retry_alone=retry_alone)
        return await asyncio.gather(*(grouped(n) for n in items), return_exceptions=True)

    return asyncio.run(main()), calls


def test_with_retry_alone_a_failed_batch_is_tried_item_by_item() -> None:
    answers, calls = _run(True, [1, 2, 3, 4])
    assert answers[:2] == [10, 20] and answers[3] == 40
    assert isinstance(answers[2], ValueError)
    assert calls == [[1, 2, 3, 4], [1], [2], [3], [4]]


def test_without_retry_alone_every_caller_gets_the_error_and_nothing_runs_twice() -> None:
    answers, calls = _run(False, [1, 2, 3, 4])
    assert all(isinstance(a, ValueError) for a in answers)
    assert calls == [[1, 2, 3, 4]]


@pytest.mark.parametrize("retry_alone", [True, False])
def test_a_caller_alone_is_one_call_with_its_own_answer(retry_alone: bool) -> None:
    answers, calls = _run(retry_alone, [7])
    assert answers == [70] and calls == [[7]]
