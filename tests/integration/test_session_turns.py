"""Turns through the real API, Postgres, Redis and Celery workers: a task's ``session_id``
must name a live session of its tenant, and the tasks of one session run one at a time, in
the order they were accepted, each seeing what the one before it wrote."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select

from broker.db.models import sessions_table, tasks_table
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for, count_tasks
from tests.integration.stack import ServedApp


def new_session(client: httpx.Client, **body: Any) -> str:
    answer = client.post("/sessions", json=body)
    assert answer.status_code == 201, answer.text
    session_id: str = answer.json()["session_id"]
    return session_id


def turns_taken(engine: Engine, session_id: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                select(sessions_table.c.turns).where(sessions_table.c.id == session_id)
            ).scalar_one()
        )


def assert_session_not_found(answer: httpx.Response) -> None:
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.json()["code"] == "session_not_found"


# -- session_id must name a live session of the caller's tenant ------------------------------


def test_an_unknown_session_is_422_and_nothing_is_written(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str]
) -> None:
    answer = client.post(
        "/tasks", json={"capability": "echo", "payload": {}, "session_id": "sess_nobody"}
    )
    assert_session_not_found(answer)
    assert count_tasks(engine, tenant[0]) == 0


def test_another_tenants_session_is_422_and_takes_no_turn(
    api: ServedApp, client: httpx.Client, engine: Engine, make_key: KeyMaker
) -> None:
    session_id = new_session(client)
    stranger_tenant, token = make_key()
    with client_for(api, token) as stranger:
        answer = stranger.post(
            "/tasks", json={"capability": "echo", "payload": {}, "session_id": session_id}
        )
    assert_session_not_found(answer)
    assert count_tasks(engine, stranger_tenant) == 0
    assert turns_taken(engine, session_id) == 0


def test_an_expired_session_is_422(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str]
) -> None:
    session_id = new_session(client, ttl_s=1)
    eventually(
        lambda: client.get(f"/sessions/{session_id}").status_code,
        "the session to expire",
        10,
        0.1,
        (404).__eq__,
    )
    answer = client.post(
        "/tasks", json={"capability": "echo", "payload": {}, "session_id": session_id}
    )
    assert_session_not_found(answer)
    assert count_tasks(engine, tenant[0]) == 0


def test_an_idempotent_replay_takes_no_second_turn(client: httpx.Client, engine: Engine) -> None:
    session_id = new_session(client)
    envelope = {
        "capability": "test.nobody",
        "payload": {},
        "queue_if_unavailable": True,
        "session_id": session_id,
        "idempotency_key": "turn-once",
    }
    first = client.post("/tasks", json=envelope)
    again = client.post("/tasks", json=envelope)
    assert first.status_code == again.status_code == 202, again.text
    assert first.json()["task_id"] == again.json()["task_id"]
    assert turns_taken(engine, session_id) == 1
    with engine.connect() as conn:
        turn = conn.execute(
            select(tasks_table.c.session_turn).where(tasks_table.c.id == first.json()["task_id"])
        ).scalar_one()
    assert turn == 1


@pytest.mark.parametrize("session_id", ["", "x" * 129, "with space"])
def test_a_malformed_session_id_is_envelope_invalid(client: httpx.Client, session_id: str) -> None:
    answer = client.post(
        "/tasks", json={"capability": "echo", "payload": {}, "session_id": session_id}
    )
    assert answer.status_code == 422
    assert answer.json()["code"] == "envelope_invalid"
