"""What a handler's exception tells the task's caller: its own words, but never a database
statement's SQL and values."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import psycopg
import sqlalchemy.exc

from workers.runner import HIDDEN, _failure

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
