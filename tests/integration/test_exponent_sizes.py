"""A size the broker measures is the size of what it sends back. jsonb keeps a number as
numeric, whose text has no exponent: ``1e+308``, 6 bytes as submitted, comes back as 309
digits, sent whole. Measured on Python's JSON, 16 KB of such metadata passed the 16 KiB limit
and went out as 700 KB in every read of its task, and since the sizes kept with each task fed
``GET /tasks``'s byte budget, a page of 100 such tasks was 45 MB, not 1 MB
(``jsonbody.sent_size``)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, select

from broker import jsonbody
from broker.db.models import tasks_table as tasks
from broker.settings import Settings
from tests.integration.conftest import KeyMaker, client_for, count_tasks
from tests.integration.stack import CeleryProcess, ServedApp, wait_for_task
from tests.integration.test_listing_sizes import pages_of

# Each 1e308 is 6 bytes as Python writes it, 309 digits as the API sends it back.
BIG = 1e308
# A page's budget; what a page shows besides the JSON it counts (ids, times, the agent) is
# under 1 KB a task.
PAGE_BYTES = 40_000
OTHER_FIELDS = 1024


@pytest.fixture
def small_pages(settings: Settings) -> Iterator[ServedApp]:
    yield from pages_of(settings, PAGE_BYTES)


def compact(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def test_numbers_in_exponent_form_count_as_sent_against_the_limits(
    api: ServedApp,
    make_key: KeyMaker,
    engine: Engine,
    settings: Settings,
    worker: CeleryProcess,
) -> None:
    tenant, token = make_key()
    # Given echo served (a submit reaches the size checks), and metadata and a payload of
    # 1e308s: 7% of their limits as submitted (7 bytes a number with its comma), three times
    # their limits as they would be sent back
    metadata = {"n": [BIG] * (settings.max_metadata_bytes // 100)}
    payload = {"n": [BIG] * (settings.max_payload_bytes // 100)}
    assert len(jsonbody.canonical(metadata)) < settings.max_metadata_bytes / 10
    assert len(jsonbody.canonical(payload)) < settings.max_payload_bytes / 10
    with client_for(api, token) as http:
        # When each is submitted, then each is refused at its size as sent
        envelope = {"capability": "echo", "payload": {}, "metadata": metadata}
        answer = http.post("/tasks", json=envelope)
        assert (answer.status_code, answer.json()["code"]) == (413, "metadata_too_large")
        answer = http.post("/tasks", json={"capability": "echo", "payload": payload})
        assert (answer.status_code, answer.json()["code"]) == (413, "payload_too_large")
        # (the message says how large it would be: 1e308 written as the integer it is)
        as_sent = compact({"n": [10**308] * len(payload["n"])})
        assert answer.json()["detail"].startswith(f"payload is {as_sent} bytes")
    assert count_tasks(engine, tenant) == 0


def test_a_listing_of_such_tasks_stays_within_its_byte_budget(
    small_pages: ServedApp, make_key: KeyMaker, engine: Engine, worker: CeleryProcess
) -> None:
    _, token = make_key()
    # Given six tasks run by a real worker, each with metadata and a result (echo's: its
    # payload) of thirty 1e308: 210 bytes each as submitted, 9.3 KB each as sent back
    numbers = {"n": [BIG] * 30}
    envelope = {"capability": "echo", "payload": numbers, "metadata": numbers}
    with client_for(small_pages, token) as http:
        ids = []
        for _ in range(6):
            answer = http.post("/tasks", json=envelope)
            assert answer.status_code == 202, answer.text
            ids.append(answer.json()["task_id"])
        for task_id in ids:
            assert wait_for_task(http, task_id, {"succeeded"})["status"] == "succeeded"
        # Then each keeps the sizes of its metadata and its result as the API sends them
        one = http.get(f"/tasks/{ids[0]}").json()
        sent = compact(one["metadata"])
        assert sent > 30 * 309
        query = select(tasks.c.metadata_size, tasks.c.result_size).where(
            tasks.c.id.in_([uuid.UUID(t) for t in ids])
        )
        with engine.connect() as conn:
            assert {tuple(row) for row in conn.execute(query)} == {(sent, compact(one["result"]))}
        # And when they are listed, each page holds what its budget allows: its JSON within
        # the budget (two tasks of 18.6 KB), the page within it and the other fields
        listed: list[str] = []
        cursor = None
        while True:
            params = {"limit": 100} | ({"cursor": cursor} if cursor else {})
            answer = http.get("/tasks", params=params)
            assert answer.status_code == 200, answer.text
            page = answer.json()["tasks"]
            counted = sum(compact(task[c]) for task in page for c in ("metadata", "result"))
            assert counted <= PAGE_BYTES or len(page) == 1
            assert len(answer.content) <= PAGE_BYTES + OTHER_FIELDS * len(page)
            listed += [task["task_id"] for task in page]
            cursor = answer.json().get("next_cursor")
            if not cursor:
                break
        assert sorted(listed) == sorted(ids)


def test_a_sessions_state_of_such_numbers_counts_as_sent_against_its_bound(
    api: ServedApp, make_key: KeyMaker, settings: Settings
) -> None:
    _, token = make_key()
    # Given a state of 1e308s, 7% of the bound as submitted, three times it as sent back
    state = {"n": [BIG] * (settings.session_max_bytes // 100)}
    assert len(jsonbody.canonical(state)) < settings.session_max_bytes / 10
    with client_for(api, token) as http:
        # When a session is created with it, then it is refused
        answer = http.post("/sessions", json={"state": state})
        assert (answer.status_code, answer.json()["code"]) == (413, "session_too_large")
