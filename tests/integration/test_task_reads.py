"""``GET /tasks/{id}`` passes a task's stored JSON on as its text: a result or a payload of a
million small values is neither decoded into Python objects nor encoded again.

Decoded, 1.3 MiB of empty lists took the API's event loop a tenth of a second (0.65 s at
4 MiB) at a read any tenant may send many times a second. The API runs in this process
(``ServedApp``), so what a read allocates is measured here (``tracemalloc``)."""

from __future__ import annotations

import json
import tracemalloc
import uuid

from sqlalchemy import Engine, update

from broker.db.models import tasks_table
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.rows import a_task_row
from tests.integration.stack import ServedApp

LISTS = 300_000  # 1.1 MiB of JSON; decoded, some 17 MiB of lists and more for their list


def test_reading_a_task_with_a_large_payload_and_result_decodes_neither(
    api: ServedApp, engine: Engine, make_key: KeyMaker
) -> None:
    tenant, token = make_key()
    big = {"pad": [[] for _ in range(LISTS)]}
    task_id = a_task_row(engine, tenant=tenant, payload=big)
    with engine.begin() as conn:
        conn.execute(update(tasks_table).where(tasks_table.c.id == task_id).values(result=big))
    del big
    with client_for(api, token) as http:
        http.get(f"/tasks/{uuid.uuid4()}")  # the connection and the key's look-up, warm
        # When the task is read with its payload
        tracemalloc.start()
        try:
            answer = http.get(f"/tasks/{task_id}", params={"include": "payload"})
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    # Then both came back whole, and the read allocated a few copies of their text at most
    assert answer.status_code == 200, answer.text
    task = answer.json()
    assert len(task["payload"]["pad"]) == len(task["result"]["pad"]) == LISTS
    text = len(answer.content)
    assert peak < 8 * text, f"a read of {text} bytes allocated {peak} at its peak"


def test_a_task_read_as_text_shows_its_values_as_stored(
    api: ServedApp, engine: Engine, make_key: KeyMaker
) -> None:
    tenant, token = make_key()
    value = {
        "big": 2**70,  # past 64 bits: kept exact
        "float": 1.5,
        "text": 'é "quoted" \\ \u2028 😀',
        "nested": {"b": [1, None, True, {"c": []}], "a": {}},
    }
    task_id = a_task_row(engine, tenant=tenant, payload=value)
    with engine.begin() as conn:
        conn.execute(
            update(tasks_table)
            .where(tasks_table.c.id == task_id)
            .values(
                result=value,
                metadata={"m": 2**70},
                progress={"percent": 50, "message": "half"},
                error={"code": "x", "message": "y", "retryable": False},
            )
        )
    with client_for(api, token) as http:
        answer = http.get(f"/tasks/{task_id}", params={"include": "payload"})
        plain = http.get(f"/tasks/{task_id}")
    assert answer.status_code == plain.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    task = json.loads(answer.content)
    assert task["payload"] == task["result"] == value
    assert task["metadata"] == {"m": 2**70}
    assert task["progress"] == {"percent": 50, "message": "half"}
    assert task["error"] == {"code": "x", "message": "y", "retryable": False}
    assert "payload" not in json.loads(plain.content)
    assert json.loads(plain.content)["result"] == value
