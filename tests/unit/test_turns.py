"""Which turn a final one releases (``broker.tasks.turns.due_after``)."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

from broker.tasks.turns import Due, due_after, of_row


def head(turn: int, status: str = "queued") -> SimpleNamespace:
    return SimpleNamespace(
        id=uuid.UUID(int=turn),
        status=status,
        session_turn=turn,
        queue="q",
        trace_id="t",
        deadline_at=None,
        tenant="acme",
    )


def test_given_the_next_turn_queued_expect_it_released() -> None:
    assert due_after(3, head(4)) == Due(uuid.UUID(int=4), "q", "t", None, "acme")


def test_given_a_gap_of_final_turns_expect_the_next_unfinished_one_released() -> None:
    assert due_after(3, head(7)) is not None


def test_given_no_unfinished_turn_expect_nothing() -> None:
    assert due_after(3, None) is None


def test_given_an_earlier_turn_unfinished_expect_nothing_its_finish_releases_the_next() -> None:
    # a waiting turn was cancelled while an earlier one still holds the line
    assert due_after(5, head(2)) is None
    assert due_after(5, head(2, "running")) is None


def test_given_the_next_turn_running_already_expect_nothing() -> None:
    assert due_after(3, head(4, "running")) is None


def test_given_a_task_outside_any_order_expect_no_release() -> None:
    assert of_row({"session_id": None, "session_turn": None}) is None
    assert of_row({"session_id": "sess_x", "session_turn": None}) is None
    assert of_row({"session_id": "sess_x", "session_turn": 2}) == ("sess_x", 2)
