"""``CardRuns``: a card's ``max_concurrency`` held in the process, for threads and coroutines
alike, the runs past it waiting in the order they came."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from workers.card_runs import CardRuns

CARD = ("test.bounded", "bounded-agent")


def test_threads_past_the_bound_wait_and_start_in_the_order_they_came() -> None:
    runs = CardRuns()
    started: list[int] = []
    ends = [threading.Event() for _ in range(5)]

    def run(n: int) -> None:
        with runs.held(CARD, 2):
            started.append(n)
            ends[n].wait()

    threads = []
    for n in range(5):
        threads.append(threading.Thread(target=run, args=(n,)))
        threads[-1].start()
        if n >= 2:  # each in line before the next comes
            wait_for(lambda n=n: runs.waiting(CARD) == n - 1)
    assert started == [0, 1] and runs.running(CARD) == 2
    for n in range(5):
        ends[n].set()
        threads[n].join()
    assert started == [0, 1, 2, 3, 4]
    assert runs.running(CARD) == 0 and runs.waiting(CARD) == 0


def test_coroutines_past_the_bound_wait_without_the_loops_thread() -> None:
    async def scenario() -> list[int]:
        runs = CardRuns()
        started: list[int] = []
        release = asyncio.Event()

        async def run(n: int) -> None:
            async with runs.held_async(CARD, 1):
                started.append(n)
                await release.wait()
                release.clear()

        tasks = [asyncio.create_task(run(n)) for n in range(3)]
        await asyncio.sleep(0.01)
        assert started == [0] and runs.waiting(CARD) == 2  # the loop runs on meanwhile
        for _ in range(3):
            release.set()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        return started

    assert asyncio.run(scenario()) == [0, 1, 2]


def test_a_coroutine_cancelled_while_it_waits_gives_its_place_on() -> None:
    async def scenario() -> tuple[list[int], int]:
        runs = CardRuns()
        started: list[int] = []
        first_may_end = asyncio.Event()

        async def run(n: int) -> None:
            async with runs.held_async(CARD, 1):
                started.append(n)
                if n == 0:
                    await first_may_end.wait()

        first = asyncio.create_task(run(0))
        cancelled = asyncio.create_task(run(1))
        last = asyncio.create_task(run(2))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        first_may_end.set()  # its place goes on as the cancel lands
        await asyncio.gather(first, last)
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return started, runs.running(CARD)

    assert asyncio.run(scenario()) == ([0, 2], 0)


def test_threads_and_coroutines_share_one_bound() -> None:
    runs = CardRuns()
    thread_in, thread_may_end = threading.Event(), threading.Event()

    def in_a_thread() -> None:
        with runs.held(CARD, 1):
            thread_in.set()
            thread_may_end.wait()

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread_in.wait()

    async def on_the_loop() -> int:
        waiting = asyncio.create_task(_held(runs))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        thread_may_end.set()  # the thread ends, and wakes the coroutine on its loop
        return await waiting

    assert asyncio.run(on_the_loop()) == 1
    thread.join()
    assert runs.running(CARD) == 0


def test_no_bound_holds_nothing() -> None:
    runs = CardRuns()
    with runs.held(CARD, None), runs.held(CARD, None):
        assert runs.running(CARD) == 0


async def _held(runs: CardRuns) -> int:
    async with runs.held_async(CARD, 1):
        return runs.running(CARD)


def wait_for(check: Callable[[], bool]) -> None:
    """Until ``check`` holds; the bound only ends a hang."""
    for _ in range(3000):
        if check():
            return
        threading.Event().wait(0.01)
    raise AssertionError("never")
