"""What a sync submit answers when its wait runs out (``api.replies.waited``), and when an
idle stream sends its ping (``api.sse``)."""

from __future__ import annotations

import pytest

from api.replies import as_it_stands
from api.sse import QUIET_MAX_S, ping_due, quiet_s
from broker.tasks.resource import FINAL, QUEUED, RUNNING
from tests.unit.test_tasks import a_row


@pytest.mark.parametrize("status", sorted(FINAL))
def test_a_task_final_as_the_wait_ran_out_is_answered_final(status: str) -> None:
    """It was answered 202 with its final status in it (a deadline as long as the wait)."""
    task, final = as_it_stands(a_row(status=status))
    assert (task["status"], final) == (status, True)


@pytest.mark.parametrize("status", [QUEUED, RUNNING])
def test_a_task_not_final_as_the_wait_ran_out_is_answered_accepted(status: str) -> None:
    task, final = as_it_stands(a_row(status=status))
    assert (task["status"], final) == (status, False)


@pytest.mark.parametrize("ping_s", [15.0, 10.0, 7.5, 4.0, 3.0, 1.0, 0.3])
def test_an_idle_streams_ping_goes_out_at_the_wake_up_nearest_its_time(ping_s: float) -> None:
    """The reader wakes every ``quiet_s`` when nothing comes, each wake a little late: the
    ping goes out at the wake nearest ``ping_s``. With 2 s wakes it went out at 16 s of 15."""
    quiet = quiet_s(ping_s)
    assert quiet <= QUIET_MAX_S
    for late_s in (0.0, 0.002, 0.02):  # what each wake-up adds
        wakes = [k * (quiet + late_s) for k in range(1, 1000)]
        first = next(t for t in wakes if ping_due(t, ping_s))
        wakes_to_it = round(ping_s / quiet)
        assert first == pytest.approx(wakes_to_it * (quiet + late_s)), (ping_s, late_s, first)
        assert first <= ping_s + wakes_to_it * late_s + 1e-9
