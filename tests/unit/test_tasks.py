"""Unit tests for task ids (UUIDv7), the status state machine and the task rendering."""

import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy.dialects.postgresql import JSONB

from broker.db.models import tasks_table
from broker.tasks.resource import (
    CANCELLED,
    CODE_MAX,
    EXPIRED,
    FAILED,
    FINAL,
    MESSAGE_MAX,
    MOVES,
    NEXT,
    QUEUED,
    RUNNING,
    SHOWN_COLUMNS,
    SHOWN_JSON,
    STATUSES,
    SUCCEEDED,
    TaskRow,
    new_task_id,
    parse_task_id,
    render,
    task_error,
)

# --- new_task_id ---------------------------------------------------------------------------


def test_given_a_new_task_id_expect_version_7_and_the_rfc_4122_variant() -> None:
    for _ in range(100):
        task_id = new_task_id()
        assert task_id.version == 7
        assert task_id.variant == uuid.RFC_4122


def test_given_a_new_task_id_expect_its_first_48_bits_to_be_the_current_unix_ms() -> None:
    before = time.time_ns() // 1_000_000
    task_id = new_task_id()
    after = time.time_ns() // 1_000_000
    assert before <= task_id.int >> 80 <= after


def test_given_ids_made_milliseconds_apart_expect_id_order_to_be_creation_order() -> None:
    made = []
    for _ in range(20):
        made.append(new_task_id())
        time.sleep(0.002)
    assert sorted(made) == made
    assert sorted(made, key=str) == made  # the text form sorts the same way


def test_given_many_ids_in_the_same_millisecond_expect_all_unique() -> None:
    made = [new_task_id() for _ in range(20_000)]
    millis = [i.int >> 80 for i in made]
    assert len(set(millis)) < len(made)  # the loop did produce ids sharing a millisecond
    assert len(set(made)) == len(made)


# --- parse_task_id -------------------------------------------------------------------------


def test_given_the_text_of_a_task_id_expect_the_same_uuid_back() -> None:
    task_id = new_task_id()
    assert parse_task_id(str(task_id)) == task_id
    assert parse_task_id(str(task_id).upper()) == task_id


@pytest.mark.parametrize(
    "raw",
    ["", "not-a-uuid", "1234", "0190f3c8-aaaa-7bbb-8ccc", "0190f3c8-aaaa-7bbb-8ccc-dddddddddddg"],
)
def test_given_text_that_is_not_a_uuid_expect_none(raw: str) -> None:
    assert parse_task_id(raw) is None


# --- the state machine ---------------------------------------------------------------------


def can_move(current: str, target: str) -> bool:
    return target in NEXT.get(current, frozenset())


def test_given_the_machine_expect_the_four_final_statuses_of_the_readme() -> None:
    terminal = {status for status in STATUSES if not NEXT[status]}
    assert terminal == {"succeeded", "failed", "cancelled", "expired"}
    assert terminal == FINAL


@pytest.mark.parametrize("final", sorted(FINAL))
@pytest.mark.parametrize("target", STATUSES)
def test_given_a_final_status_expect_no_move_out_of_it(final: str, target: str) -> None:
    assert not can_move(final, target)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (QUEUED, RUNNING),
        (QUEUED, CANCELLED),
        (QUEUED, EXPIRED),
        (QUEUED, FAILED),
        (RUNNING, QUEUED),  # a retry puts the task back in the queue
        (RUNNING, SUCCEEDED),
        (RUNNING, FAILED),
        (RUNNING, CANCELLED),
        (RUNNING, EXPIRED),
    ],
)
def test_given_an_allowed_transition_expect_can_move(current: str, target: str) -> None:
    assert can_move(current, target)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (SUCCEEDED, RUNNING),
        (FAILED, QUEUED),
        (QUEUED, QUEUED),
        (RUNNING, RUNNING),
        (QUEUED, SUCCEEDED),  # nothing succeeds without running
        ("unknown", RUNNING),
        (QUEUED, "unknown"),
    ],
)
def test_given_a_refused_transition_expect_cannot_move(current: str, target: str) -> None:
    assert not can_move(current, target)


def test_given_every_move_expect_it_to_go_forward() -> None:
    # Forward: out of queued or running only, never to itself, and back to queued only from
    # running (a retry, which is a new attempt).
    for move in MOVES:
        assert move.sources, move
        assert set(move.sources) <= {QUEUED, RUNNING}, move
        assert move.target not in move.sources, move
        assert move.target in STATUSES, move
        if move.target == QUEUED:
            assert move.sources == (RUNNING,), move


def test_given_every_status_expect_a_final_one_reachable_from_it() -> None:
    for status in STATUSES:
        seen, frontier = {status}, {status}
        while frontier:
            frontier = {n for s in frontier for n in NEXT[s]} - seen
            seen |= frontier
        assert seen & FINAL, status


# --- task_error --------------------------------------------------------------------------


def test_given_a_code_and_message_expect_the_error_of_the_contract() -> None:
    assert task_error("worker_lost", "it stopped") == {
        "code": "worker_lost",
        "message": "it stopped",
        "retryable": False,
    }
    assert task_error("transient_error", "try again", retryable=True)["retryable"] is True


def test_given_a_long_message_expect_it_cut_to_the_limit() -> None:
    error = task_error("agent_error", "x" * (MESSAGE_MAX + 500))
    assert error["message"] == "x" * MESSAGE_MAX


def test_given_what_postgres_cannot_store_expect_it_replaced_and_a_long_code_cut() -> None:
    # NUL and a lone surrogate: no Postgres text or JSON holds them, and the final write failed
    error = task_error("bad\x00code" + "x" * 100, "m\ud800 \U0001f600 é\x00")
    assert error["code"] == ("bad\ufffdcode" + "x" * 100)[:CODE_MAX]
    assert error["message"] == "m\ufffd \U0001f600 é\ufffd"
    error["message"].encode("utf-8")  # encodes


# --- render --------------------------------------------------------------------------------


def a_row(**overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": uuid.UUID("0190f3c8-1111-7222-8333-444455556666"),
        "capability": "invoice.extract",
        "status": RUNNING,
        "progress": {"percent": 50, "message": None},
        "result": None,
        "error": None,
        "attempts": 1,
        "agent_id": "invoice-bot",
        "agent_version": "1.2.0",
        "instance": "worker-3",
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "session_id": "sess_7f3d92",
        "metadata": {"order": "7731"},
        "created_at": datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC),
        "started_at": datetime(2024, 5, 1, 12, 0, 1, 250000, tzinfo=UTC),
        "finished_at": None,
        "expires_at": datetime(2024, 5, 2, 12, 0, 0, tzinfo=UTC),
        "tenant": "acme",  # a column the resource does not show
    }
    row.update(overrides)
    return row


def test_given_a_row_expect_the_task_resource_of_the_contract() -> None:
    assert render(a_row()) == {
        "task_id": "0190f3c8-1111-7222-8333-444455556666",
        "capability": "invoice.extract",
        "status": RUNNING,
        "progress": {"percent": 50, "message": None},
        "result": None,
        "error": None,
        "attempts": 1,
        "agent": {"agent_id": "invoice-bot", "version": "1.2.0", "instance": "worker-3"},
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "session_id": "sess_7f3d92",
        "metadata": {"order": "7731"},
        "created_at": "2024-05-01T12:00:00Z",
        "started_at": "2024-05-01T12:00:01.250000Z",
        "finished_at": None,
        "expires_at": "2024-05-02T12:00:00Z",
    }


def test_given_a_row_without_agent_id_expect_agent_null() -> None:
    row = a_row(agent_id=None, agent_version=None, instance=None, status=QUEUED)
    assert render(row)["agent"] is None


def test_given_utc_timestamps_expect_iso_text_ending_in_z() -> None:
    task = render(a_row(finished_at=datetime(2024, 5, 1, 12, 0, 9, tzinfo=UTC)))
    for name in ("created_at", "started_at", "finished_at", "expires_at"):
        assert task[name].endswith("Z")
        assert "+00:00" not in task[name]
        assert datetime.fromisoformat(task[name]).tzinfo is not None


def test_given_missing_timestamps_expect_null() -> None:
    task = render(a_row(started_at=None, finished_at=None))
    assert task["started_at"] is None
    assert task["finished_at"] is None


def test_given_the_tasks_table_expect_the_row_type_to_name_exactly_its_columns() -> None:
    returned_with_final_writes = {"tenant_subscribes"}
    assert set(TaskRow.__annotations__) - returned_with_final_writes == {
        column.name for column in tasks_table.columns
    }


def test_given_only_the_shown_columns_expect_the_same_resource() -> None:
    # A listing reads these columns only (not the payload): render must need no other.
    row = a_row(payload={"large": "x" * 100}, callback=None)
    shown = {name: row[name] for name in SHOWN_COLUMNS}
    assert render(shown) == render(row)


def test_given_the_shown_columns_expect_the_byte_budget_to_count_each_json_one() -> None:
    json_columns = {n for n in SHOWN_COLUMNS if isinstance(tasks_table.c[n].type, JSONB)}
    assert json_columns == set(SHOWN_JSON)
    assert "payload" not in SHOWN_COLUMNS
