"""What a handler's exception tells the task's caller (its own words, never a database
statement's SQL and values), and how many progress reports of a task are written."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import psycopg
import sqlalchemy.exc

from workers.runner import HIDDEN, Bucket, _failure

SPEC: Any = SimpleNamespace(card=SimpleNamespace(agent_id="test-agent"))
CTX: Any = SimpleNamespace(task_id=uuid.uuid4())


def test_an_agents_own_exception_is_told_in_its_own_words() -> None:
    failed = _failure(ValueError("the invoice has no total"), SPEC, CTX)

    assert failed.error["code"] == "agent_error"
    assert failed.error["message"] == "ValueError: the invoice has no total"


def test_a_database_statements_error_names_its_class_but_not_its_sql_or_values() -> None:
    refused = sqlalchemy.exc.DataError(
        "UPDATE sessions SET state=%(state)s WHERE id = %(id)s",
        {"state": "the tenant's secret", "id": "sess_1"},
        psycopg.DataError("invalid byte sequence: 0x00"),
    )

    failed = _failure(refused, SPEC, CTX)

    assert failed.error["code"] == "agent_error"
    assert failed.error["message"] == f"DataError: {HIDDEN}"


def test_a_tasks_reports_pass_a_burst_at_once_then_at_their_rate() -> None:
    now = [100.0]
    bucket = Bucket(5, 2.0, clock=lambda: now[0])

    assert [bucket.take() for _ in range(7)] == [True] * 5 + [False] * 2
    now[0] += 1.0  # two tokens back
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    now[0] += 60.0  # never more than the burst
    assert sum(bucket.take() for _ in range(10)) == 5
