"""The per-call soft time limit (``workers.timelimit``): None is no limit, and a limit already
spent is one, not the absence of one."""

from __future__ import annotations

import threading
import time

import pytest

from workers.timelimit import SoftTimeLimit, soft_limit


@pytest.mark.parametrize("seconds", [0.0, -1.0])
def test_a_limit_already_spent_stops_the_body_before_it_runs(seconds: float) -> None:
    """``Context.time_left_s`` is 0.0 once the deadline has passed: read as no limit, it let
    the handler run to Celery's hard limit, the longest timeout of any agent plus 30 s."""
    ran = []
    with pytest.raises(SoftTimeLimit), soft_limit(seconds):
        ran.append("body")
        time.sleep(2)
    assert ran == []


def test_a_limit_already_spent_stops_the_body_off_the_main_thread_too() -> None:
    """Off the main thread SIGALRM cannot interrupt the body, but one never started needs no
    signal."""
    outcome: list[str] = []

    def run() -> None:
        try:
            with soft_limit(0.0):
                outcome.append("body")
        except SoftTimeLimit:
            outcome.append("stopped")

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert outcome == ["stopped"]


def test_no_limit_lets_the_body_run_to_its_end() -> None:
    with soft_limit(None):
        time.sleep(0.01)
        finished = True
    assert finished


def test_a_limit_interrupts_a_body_that_runs_past_it() -> None:
    with pytest.raises(SoftTimeLimit), soft_limit(0.05):
        time.sleep(5)
