"""The group-commit helper's rules, on a stand-in batch function (no services needed)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

from broker.grouping import Grouped, ThreadGrouped


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


def _threads_group(
    items: list[int], *, retry_alone: bool = True, max_items: int = 100, fail_groups: bool = False
) -> tuple[dict[int, object], list[list[int]]]:
    """``ThreadGrouped`` with item 0 in flight while ``items`` arrive, each on its own thread;
    then item 0's call returns. With ``fail_groups``, every batch of more than one fails and
    item 3 fails even alone."""
    calls: list[list[int]] = []
    first_in_flight, all_waiting = threading.Event(), threading.Event()

    def run_many(batch: list[int]) -> list[int]:
        calls.append(batch)
        if batch == [0]:
            first_in_flight.set()
            assert all_waiting.wait(10)
        if fail_groups and (len(batch) > 1 or batch == [3]):
            raise ValueError(f"refused {batch}")
        return [n * 10 for n in batch]

    grouped: ThreadGrouped[int, int] = ThreadGrouped(
        run_many, max_items=max_items, name="test", retry_alone=retry_alone
    )
    answers: dict[int, object] = {}

    def call(n: int) -> None:
        try:
            answers[n] = grouped(n)
        except ValueError as exc:
            answers[n] = exc

    threads = [threading.Thread(target=call, args=(0,))]
    threads[0].start()
    assert first_in_flight.wait(10)
    for n in items:
        threads.append(threading.Thread(target=call, args=(n,)))
        threads[-1].start()
    while len(grouped._waiting) < len(items):  # every one of them queued behind item 0
        time.sleep(0.001)
    all_waiting.set()
    for thread in threads:
        thread.join(10)
    return answers, calls


def test_threads_arriving_while_a_group_is_in_flight_go_out_together_with_their_own_answers() -> (
    None
):
    answers, calls = _threads_group(list(range(1, 51)))
    assert calls[0] == [0]
    assert len(calls) == 2 and sorted(calls[1]) == list(range(1, 51))
    assert answers == {n: n * 10 for n in range(51)}


def test_threads_groups_hold_at_most_max_items_and_every_caller_is_answered() -> None:
    answers, calls = _threads_group(list(range(1, 251)), max_items=100)
    assert [len(c) for c in calls] == [1, 100, 100, 50]
    assert answers == {n: n * 10 for n in range(251)}


def test_threads_a_failed_group_is_tried_item_by_item_with_retry_alone() -> None:
    answers, calls = _threads_group([1, 2, 3, 4], fail_groups=True)
    assert {n: a for n, a in answers.items() if n != 3} == {0: 0, 1: 10, 2: 20, 4: 40}
    assert isinstance(answers[3], ValueError)
    assert sorted(calls[1]) == [1, 2, 3, 4] and sorted(calls[2:]) == [[1], [2], [3], [4]]


def test_threads_without_retry_alone_every_caller_of_a_failed_group_gets_the_error() -> None:
    answers, calls = _threads_group([1, 2, 3, 4], retry_alone=False, fail_groups=True)
    assert answers[0] == 0
    assert all(isinstance(answers[n], ValueError) for n in (1, 2, 3, 4))
    assert len(calls) == 2


def test_threads_a_caller_alone_runs_at_once_on_its_own_thread() -> None:
    seen: list[tuple[list[int], str]] = []

    def run_many(batch: list[int]) -> list[int]:
        seen.append((batch, threading.current_thread().name))
        return [n + 1 for n in batch]

    grouped: ThreadGrouped[int, int] = ThreadGrouped(
        run_many, max_items=10, name="test", retry_alone=True
    )
    assert [grouped(1), grouped(2)] == [2, 3]
    assert seen == [([1], threading.current_thread().name), ([2], threading.current_thread().name)]


def test_threads_under_contention_every_call_gets_its_own_answer_exactly_once() -> None:
    runs: list[int] = []
    groups: list[int] = []

    def run_many(batch: list[int]) -> list[int]:
        runs.extend(batch)
        groups.append(len(batch))
        time.sleep(0.0005)  # a round trip, during which the next group gathers
        return [n * 2 for n in batch]

    grouped: ThreadGrouped[int, int] = ThreadGrouped(
        run_many, max_items=16, name="test", retry_alone=True
    )
    wrong: list[int] = []

    def caller(base: int) -> None:
        for n in range(base, base + 100):
            if grouped(n) != n * 2:
                wrong.append(n)

    threads = [threading.Thread(target=caller, args=(1000 * t,)) for t in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert wrong == []
    assert sorted(runs) == sorted(1000 * t + n for t in range(32) for n in range(100))
    assert len(groups) < len(runs)  # calls went out together


def test_a_batch_holds_at_most_max_bytes_by_weight_and_always_one_item() -> None:
    """Rows go out as one JSON parameter, which Postgres refuses past 256 MiB: a batch is
    bounded by what its items weigh, and an item heavier than the bound goes alone."""
    calls: list[list[int]] = []

    async def run_many(batch: list[int]) -> list[int]:
        calls.append(batch)
        return batch

    async def main() -> list[int]:
        grouped = Grouped(
            run_many, max_items=100, name="test", retry_alone=True, weigh=lambda n: n, max_bytes=10
        )
        return await asyncio.gather(*(grouped(n) for n in [4, 4, 4, 25, 1, 2, 3]))

    assert asyncio.run(main()) == [4, 4, 4, 25, 1, 2, 3]
    assert calls == [[4, 4], [4], [25], [1, 2, 3]]


def test_threads_a_batch_holds_at_most_max_bytes_by_weight() -> None:
    calls: list[list[int]] = []
    first_in_flight, all_waiting = threading.Event(), threading.Event()

    def run_many(batch: list[int]) -> list[int]:
        calls.append(batch)
        if batch == [0]:
            first_in_flight.set()
            assert all_waiting.wait(10)
        return batch

    grouped: ThreadGrouped[int, int] = ThreadGrouped(
        run_many, max_items=100, name="test", retry_alone=True, weigh=lambda n: n, max_bytes=10
    )
    threads = [threading.Thread(target=grouped, args=(0,))]
    threads[0].start()
    assert first_in_flight.wait(10)
    for n in [6, 6, 30, 2]:
        threads.append(threading.Thread(target=grouped, args=(n,)))
        threads[-1].start()
        while len(grouped._waiting) < len(threads) - 1:  # in this order behind item 0
            time.sleep(0.001)
    all_waiting.set()
    for thread in threads:
        thread.join(10)
    assert calls == [[0], [6], [6], [30], [2]]


REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="none")


def test_a_batch_runs_in_no_callers_context() -> None:
    """The batch that served callers B and C ran in the context of A, the caller that
    started the flusher: its log lines named A's task, tenant and trace."""
    seen: list[str] = []

    async def run_many(batch: list[int]) -> list[int]:
        seen.append(REQUEST.get())
        await asyncio.sleep(0)
        return batch

    async def caller(n: int) -> int:
        REQUEST.set(f"task {n}")
        return await grouped(n)

    grouped = Grouped(run_many, max_items=100, name="test", retry_alone=True)

    async def main() -> list[int]:
        return await asyncio.gather(*(caller(n) for n in range(3)))

    assert asyncio.run(main()) == [0, 1, 2]
    thread_grouped: ThreadGrouped[int, int] = ThreadGrouped(
        lambda batch: [seen.append(REQUEST.get()) or n for n in batch],  # type: ignore[func-returns-value]
        max_items=10,
        name="test",
        retry_alone=True,
    )
    REQUEST.set("the leading thread's task")
    assert thread_grouped(7) == 7
    assert seen == ["none", "none"]
