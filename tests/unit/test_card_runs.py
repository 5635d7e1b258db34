"""``CardRuns``: a card's ``max_concurrency`` held in the process, for threads and coroutines
alike, the runs past it waiting in the order they came."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from workers.card_runs import CardRuns, LineClosed

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
        threads.append(threading.Thread(target=run, args=(n,), daemon=True))
        threads[-1].start()
        if n >= 2:  # each in line before the next comes
            wait_for(lambda n=n: runs.waiting(CARD) == n - 1)
    assert started == [0, 1] and runs.running(CARD) == 2
    for n in range(5):
        ends[n].set()
        threads[n].join()
        wait_for(lambda n=n: len(started) == min(n + 3, 5))  # one place given on, to the first
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

    thread = threading.Thread(target=in_a_thread, daemon=True)
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
    for _ in range(1000):
        if check():
            return
        threading.Event().wait(0.01)
    raise AssertionError("never")


def test_a_bound_changed_while_runs_wait_holds_from_the_next_run_that_comes() -> None:
    """The line handed each freed place on whatever the bound then was: raised, it let no
    more start; lowered, it kept as many running."""
    runs = CardRuns()
    ends = [threading.Event() for _ in range(6)]

    def run(n: int, bound: int) -> None:
        with runs.held(CARD, bound):
            ends[n].wait()

    threads = [threading.Thread(target=run, args=(n, 1), daemon=True) for n in range(3)]
    for thread in threads:
        thread.start()
    wait_for(lambda: runs.running(CARD) == 1 and runs.waiting(CARD) == 2)
    # When a run comes with the bound raised to 3, the two in line start; it waits behind them
    threads.append(threading.Thread(target=run, args=(3, 3), daemon=True))
    threads[-1].start()
    wait_for(lambda: (runs.running(CARD), runs.waiting(CARD)) == (3, 1))
    # And when one comes with it lowered to 1, none starts until the runs are under 1
    threads.append(threading.Thread(target=run, args=(4, 1), daemon=True))
    threads[-1].start()
    wait_for(lambda: runs.waiting(CARD) == 2)
    for n in range(2):
        ends[n].set()
        threads[n].join()
    assert (runs.running(CARD), runs.waiting(CARD)) == (1, 2)
    ends[2].set()
    threads[2].join()
    wait_for(lambda: (runs.running(CARD), runs.waiting(CARD)) == (1, 1))  # the first in line
    ends[3].set()
    threads[3].join()
    wait_for(lambda: (runs.running(CARD), runs.waiting(CARD)) == (1, 0))
    ends[4].set()
    threads[4].join()
    assert runs.running(CARD) == 0


def test_a_closed_line_lets_its_waiting_runs_go_without_starting() -> None:
    runs = CardRuns()
    first_may_end = threading.Event()
    outcomes: list[str] = []

    def run(n: int) -> None:
        try:
            with runs.held(CARD, 1):
                outcomes.append(f"{n} ran")
                if n == 0:
                    first_may_end.wait()
        except LineClosed:
            outcomes.append(f"{n} gave up")

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(3)]
    threads[0].start()
    wait_for(lambda: runs.running(CARD) == 1)
    for thread in threads[1:]:
        thread.start()
    wait_for(lambda: runs.waiting(CARD) == 2)
    # When the process stops, the two in line give up; a run that comes after does too
    runs.close()
    for thread in threads[1:]:
        thread.join()
    late = threading.Thread(target=run, args=(3,), daemon=True)
    late.start()
    late.join()
    first_may_end.set()
    threads[0].join()
    assert sorted(outcomes) == ["0 ran", "1 gave up", "2 gave up", "3 gave up"]
    assert runs.running(CARD) == 0
