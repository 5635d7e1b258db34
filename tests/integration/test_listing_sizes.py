"""A listing's byte budget adds the sizes kept with each task (its metadata's, measured at
submit; its result's, measured by the worker that finished it) instead of turning every
candidate's JSON into text: with results of 1 MB, each page of ``GET /tasks`` converted up to
101 of them, 0.42 s a page at limit=100. Rows written before the sizes were kept are
measured as text, as before."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import Engine, select, update

from api.app import create_app
from broker import jsonbody
from broker.db.models import tasks_table as tasks
from broker.settings import Settings
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.rows import a_task_row
from tests.integration.stack import CeleryProcess, ServedApp, wait_for_task

BLOB = "x" * 10_000
# Two tasks of a 10 KB result fit, three do not.
PAGE_BYTES = 25_000


@pytest.fixture
def small_pages(settings: Settings) -> Iterator[ServedApp]:
    yield from pages_of(settings, PAGE_BYTES)


def pages_of(settings: Settings, max_bytes: int) -> Iterator[ServedApp]:
    """An API whose listings hold at most ``max_bytes`` of JSON a page."""
    with ServedApp(
        create_app(settings.model_copy(update={"list_page_max_bytes": max_bytes}))
    ) as api:
        yield api


def sizes_of(engine: Engine, task_id: str) -> tuple[int | None, int | None]:
    query = select(tasks.c.metadata_size, tasks.c.result_size).where(
        tasks.c.id == uuid.UUID(task_id)
    )
    with engine.connect() as conn:
        metadata_size, result_size = conn.execute(query).one()
    return metadata_size, result_size


def pages(http: httpx.Client) -> list[list[str]]:
    found, cursor = [], None
    while True:
        params = {"limit": 100} | ({"cursor": cursor} if cursor else {})
        answer = http.get("/tasks", params=params)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        found.append([t["task_id"] for t in body["tasks"]])
        cursor = body.get("next_cursor")
        if not cursor:
            return found


def test_a_listing_pages_by_the_sizes_kept_with_each_task(
    small_pages: ServedApp, make_key: KeyMaker, engine: Engine, worker: CeleryProcess
) -> None:
    tenant, token = make_key()
    # Given a task written before the sizes were kept (NULL), with a 10 KB result, listed
    # first (the newest id), so its page holds it and one more task
    written = a_task_row(engine, tenant=tenant, status="succeeded")
    old = uuid.UUID("ffffffff" + uuid.uuid4().hex[8:])
    with engine.begin() as conn:
        row = update(tasks).where(tasks.c.id == written)
        conn.execute(row.values(id=old, result={"blob": BLOB}))
    with client_for(small_pages, token) as http:
        # When four tasks with 10 KB results and metadata run through a real worker
        envelope = {"capability": "echo", "payload": {"blob": BLOB}, "metadata": {"order": 7}}
        ids = [http.post("/tasks", json=envelope).json()["task_id"] for _ in range(4)]
        for task_id in ids:
            assert wait_for_task(http, task_id, {"succeeded"})["status"] == "succeeded"
        # Then each keeps its metadata's and its result's bytes as canonical JSON
        expected = (len(jsonbody.canonical({"order": 7})), len(jsonbody.canonical({"blob": BLOB})))
        assert {sizes_of(engine, t) for t in ids} == {expected}
        assert sizes_of(engine, str(old)) == (None, None)
        # And a page holds the tasks whose sizes fit its budget: two of 10 KB each, the old
        # row measured as text as before, never as nothing
        listed = pages(http)
        assert listed[0][0] == str(old)
        assert [len(page) for page in listed] == [2, 2, 1]
