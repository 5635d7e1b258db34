"""The spine: submit over HTTP, a real worker runs the agent, poll the result from Postgres."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine

from tests.integration.conftest import count_tasks
from tests.integration.stack import wait_for_task

INVOICE = """ACME Trading Co., Ltd.
INVOICE
Invoice No: INV-2024-0042
Date: 2024-03-15
Widget 2 500.00
Subtotal: 1,000.00
Total: CNY 1,024.00
"""
FINAL = {"succeeded", "failed", "cancelled", "expired"}


def test_invoice_is_extracted_by_a_worker_and_polled(client: httpx.Client) -> None:
    # Given an invoice submitted in async mode
    response = client.post(
        "/tasks",
        json={
            "capability": "invoice.extract",
            "payload": {"text": INVOICE},
            "metadata": {"order": "7731"},
        },
    )
    # Then it is accepted at once, queued, with a Location to poll
    assert response.status_code == 202
    task = response.json()
    assert task["status"] == "queued"
    assert response.headers["location"] == f"/tasks/{task['task_id']}"
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-trace-id"])
    assert task["trace_id"] == response.headers["x-trace-id"]

    # When the worker has run it, polling shows the fields parsed from the text
    done = wait_for_task(client, task["task_id"], FINAL)
    assert done["status"] == "succeeded", done
    assert done["result"] == {
        "number": "INV-2024-0042",
        "date": "2024-03-15",
        "total": "1024.00",
        "currency": "CNY",
        "seller": "ACME Trading Co., Ltd.",
    }
    assert done["progress"] == {"percent": 100, "message": "parsed parties"}
    assert done["attempts"] == 1
    assert done["agent"]["agent_id"] == "invoice-extractor"
    assert done["agent"]["instance"].startswith("agents@")
    assert done["metadata"] == {"order": "7731"}
    assert done["started_at"] and done["finished_at"] and done["expires_at"]
    assert done["finished_at"] < done["expires_at"]


def test_summarize_returns_the_informative_sentences(client: httpx.Client) -> None:
    text = (
        "Queues decouple callers from agents. Agents advertise capabilities. "
        "The weather was nice. Capabilities route queues to agents."
    )
    task = client.post(
        "/tasks",
        json={"capability": "text.summarize", "payload": {"text": text, "max_sentences": 2}},
    ).json()
    done = wait_for_task(client, task["task_id"], FINAL)
    assert done["status"] == "succeeded", done
    assert done["result"]["sentence_count"] == 4
    assert len(done["result"]["sentences"]) == 2
    assert "The weather was nice." not in done["result"]["sentences"]


def test_an_agent_failure_fails_the_task_with_its_code(client: httpx.Client) -> None:
    task = client.post(
        "/tasks",
        json={
            "capability": "echo",
            "payload": {"fail": "invoice_unreadable", "message": "page 2 is blank"},
        },
    ).json()
    done = wait_for_task(client, task["task_id"], FINAL)
    assert done["status"] == "failed"
    assert done["error"] == {
        "code": "invoice_unreadable",
        "message": "page 2 is blank",
        "retryable": False,
    }
    assert done["result"] is None


def test_an_unexpected_exception_fails_the_task_and_the_worker_keeps_serving(
    client: httpx.Client,
) -> None:
    broken = client.post("/tasks", json={"capability": "test.boom", "payload": {}}).json()
    done = wait_for_task(client, broken["task_id"], FINAL)
    assert done["status"] == "failed"
    assert done["error"]["code"] == "agent_error"
    assert "RuntimeError: the agent broke" in done["error"]["message"]
    # The worker survived: the next task runs
    after = client.post("/tasks", json={"capability": "echo", "payload": {"n": 1}}).json()
    assert wait_for_task(client, after["task_id"], FINAL)["result"] == {"n": 1}


@pytest.mark.parametrize(
    "payload", [{}, {"nan": True}, {"nul_in_tuple": True}], ids=["a set", "NaN", "NUL in a tuple"]
)
def test_a_result_that_is_not_json_fails_as_result_invalid(
    client: httpx.Client, payload: dict[str, Any]
) -> None:
    task = client.post("/tasks", json={"capability": "test.not-json", "payload": payload}).json()
    done = wait_for_task(client, task["task_id"], FINAL)
    assert done["status"] == "failed"
    assert done["error"]["code"] == "result_invalid"


def test_a_payload_failing_the_agents_schema_is_refused_at_the_door(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str]
) -> None:
    for payload, field in (({"pdf": "x"}, "payload"), ({"text": 7}, "payload/text")):
        response = client.post("/tasks", json={"capability": "invoice.extract", "payload": payload})
        assert response.status_code == 422
        problem = response.json()
        assert problem["code"] == "payload_invalid"
        assert [e["field"] for e in problem["errors"]] == [field]
    assert count_tasks(engine, tenant[0]) == 0


def test_the_handler_sees_its_task_trace_attempt_and_deadline(client: httpx.Client) -> None:
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    session_id = client.post("/sessions").json()["session_id"]
    response = client.post(
        "/tasks",
        json={
            "capability": "test.context",
            "payload": {},
            "deadline_ms": 60_000,
            "session_id": session_id,
            "metadata": {"k": "v"},
        },
        headers={"traceparent": f"00-{trace}-00f067aa0ba902b7-01"},
    )
    assert response.headers["x-trace-id"] == trace
    done = wait_for_task(client, response.json()["task_id"], FINAL)
    seen = done["result"]
    assert seen["task_id"] == done["task_id"]
    assert seen["trace_id"] == trace
    assert seen["attempt"] == 1
    assert 0 < seen["time_left_s"] <= 60
    assert seen["session_id"] == session_id
    assert seen["metadata"] == {"k": "v"}


def test_the_accepted_task_is_the_row_postgres_holds(client: httpx.Client) -> None:
    """The 202 body is built from what was inserted, not read back: it must match the row."""
    envelope = {
        "capability": "test.nobody-serves-this",
        "payload": {"n": 1},
        "queue_if_unavailable": True,
        "session_id": client.post("/sessions").json()["session_id"],
        "metadata": {"team": "billing"},
        "deadline_ms": 60_000,
        "result_ttl_s": 600,
    }
    for extra in ({}, {"idempotency_key": "same-row"}):
        accepted = client.post("/tasks", json={**envelope, **extra})
        assert accepted.status_code == 202, accepted.text
        polled = client.get(accepted.headers["location"])
        assert polled.status_code == 200
        assert polled.json() == accepted.json()
        assert accepted.json()["attempts"] == 0 and accepted.json()["status"] == "queued"


def test_the_payload_is_shown_only_when_asked_for(client: httpx.Client) -> None:
    # Given a task
    task_id = client.post("/tasks", json={"capability": "echo", "payload": {"n": 1}}).json()[
        "task_id"
    ]
    # Then the resource leaves the payload out, unless include=payload asks for it
    assert "payload" not in client.get(f"/tasks/{task_id}").json()
    assert client.get(f"/tasks/{task_id}", params={"include": "payload"}).json()["payload"] == {
        "n": 1
    }
    # And nothing else may be included
    assert client.get(f"/tasks/{task_id}", params={"include": "secret"}).status_code == 422
