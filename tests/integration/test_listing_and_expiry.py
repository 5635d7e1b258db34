"""Listing a tenant's tasks, idempotent submits, and results that expire."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select, text

from api.app import create_app
from broker.db.engines import sync_engine
from broker.db.models import tasks_table
from broker.settings import Settings
from broker.tasks import execution
from broker.tenancy import key_store
from reach import localservices, migrate
from tests.eventually import eventually
from tests.integration.conftest import advertise_test_cards, client_for
from tests.integration.stack import CeleryProcess, ServedApp, start_beat, wait_for_task
from tests.integration.test_a2a_facade import rpc, send_message_body

FINAL = {"succeeded", "failed", "cancelled", "expired"}


def test_listing_pages_newest_first_and_filters(client: httpx.Client) -> None:
    ids = [
        client.post("/tasks", json={"capability": "echo", "payload": {"i": i}}).json()["task_id"]
        for i in range(5)
    ]
    failing = client.post("/tasks", json={"capability": "echo", "payload": {"fail": "nope"}})
    failing_id = failing.json()["task_id"]
    for task_id in [*ids, failing_id]:
        wait_for_task(client, task_id, FINAL)

    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2, "capability": "echo", **({"cursor": cursor} if cursor else {})}
        page = client.get("/tasks", params=params).json()
        assert len(page["tasks"]) <= 2
        seen += [t["task_id"] for t in page["tasks"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [failing_id, *reversed(ids)]

    failed = client.get("/tasks", params={"status": "failed"}).json()["tasks"]
    assert [t["task_id"] for t in failed] == [failing_id]
    assert client.get("/tasks", params={"capability": "invoice.extract"}).json()["tasks"] == []


def test_the_page_size_is_bounded(
    settings: Settings, tenant: tuple[str, str], client: httpx.Client
) -> None:
    # Given an API whose pages hold at most 3, and five tasks of the tenant
    capped = settings.model_copy(update={"list_page_max": 3})
    with ServedApp(create_app(capped)) as api, client_for(api, tenant[1]) as small:
        made = [
            small.post("/tasks", json={"capability": "echo", "payload": {"i": i}}).json()["task_id"]
            for i in range(5)
        ]
        # When a client asks for 50
        response = small.get("/tasks", params={"limit": 50})
        assert response.status_code == 200, response.text
        page = response.json()
        # Then exactly 3 come back, the newest, with a cursor to the other two
        assert [t["task_id"] for t in page["tasks"]] == made[:1:-1]
        assert page["next_cursor"] is not None
        rest = small.get("/tasks", params={"limit": 50, "cursor": page["next_cursor"]}).json()
        assert [t["task_id"] for t in rest["tasks"]] == made[1::-1]


def test_tasks_whose_results_pass_the_byte_budget_come_in_shorter_pages(
    settings: Settings, tenant: tuple[str, str], client: httpx.Client
) -> None:
    # Given echo tasks whose results are 3 KB of JSON, but for one of 10 KB
    sizes = [3000, 3000, 10_000, 3000, 3000]
    made = [
        client.post("/tasks", json={"capability": "echo", "payload": {"blob": "x" * n}}).json()[
            "task_id"
        ]
        for n in sizes
    ]
    for task_id in made:
        wait_for_task(client, task_id, {"succeeded"})
    newest_first = made[::-1]
    # When an API whose pages hold 7.5 KB lists them
    budgeted = settings.model_copy(update={"list_page_max_bytes": 7_500})
    with ServedApp(create_app(budgeted)) as api, client_for(api, tenant[1]) as small:
        pages = every_task_page(small)
    # Then two a page, the large one alone (it passes the budget by itself), each once
    assert pages == [newest_first[:2], newest_first[2:3], newest_first[3:]]
    # And with the default budget, one page as before
    assert every_task_page(client) == [newest_first]


def every_task_page(client: httpx.Client) -> list[list[str]]:
    pages: list[list[str]] = []
    cursor = None
    while True:
        answer = client.get("/tasks", params={"cursor": cursor} if cursor else {})
        assert answer.status_code == 200, answer.text
        pages.append([t["task_id"] for t in answer.json()["tasks"]])
        if (cursor := answer.json()["next_cursor"]) is None:
            return pages


def test_the_same_idempotency_key_and_payload_returns_the_first_task(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str]
) -> None:
    envelope = {"capability": "echo", "payload": {"order": 7731}, "idempotency_key": "o-7731"}
    first = client.post("/tasks", json=envelope)
    again = client.post(
        "/tasks",
        json={"capability": "echo", "payload": {"order": 7731}},
        headers={"Idempotency-Key": "o-7731"},
    )
    assert first.status_code == again.status_code == 202
    assert again.json()["task_id"] == first.json()["task_id"]
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers

    reused = client.post("/tasks", json={**envelope, "payload": {"order": 1}})
    assert reused.status_code == 422
    assert reused.json()["code"] == "idempotency_key_reused"
    with engine.connect() as conn:
        rows = conn.execute(select(tasks_table.c.id).where(tasks_table.c.tenant == tenant[0])).all()
    assert len(rows) == 1


@pytest.fixture
def beat(settings: Settings, log_dir: Path, worker: CeleryProcess) -> Iterator[CeleryProcess]:
    process = start_beat(settings, log_dir)
    yield process
    process.stop()


def test_an_expired_task_reads_as_404_and_the_janitor_deletes_it(
    client: httpx.Client, engine: Engine, beat: CeleryProcess
) -> None:
    # Given a task kept for three seconds after it finished (a loaded machine's pause between
    # its end and the read below fits in them)
    task = client.post(
        "/tasks", json={"capability": "echo", "payload": {}, "result_ttl_s": 3}
    ).json()
    done = wait_for_task(client, task["task_id"], FINAL)
    assert done["status"] == "succeeded"
    task_id = uuid.UUID(task["task_id"])

    # When its time is up, it is gone for readers, and beat's janitor removes the row
    gone = eventually(
        lambda: client.get(f"/tasks/{task_id}"),
        "the task expired for readers",
        until=lambda response: response.status_code == 404,
    )
    assert gone.json()["code"] == "task_not_found"
    assert task["task_id"] not in [t["task_id"] for t in client.get("/tasks").json()["tasks"]]

    def row_exists() -> bool:
        with engine.connect() as conn:
            query = select(tasks_table.c.id).where(tasks_table.c.id == task_id)
            return conn.execute(query).first() is not None

    eventually(lambda: not row_exists(), "the janitor to remove the row", interval_s=0.2)


@pytest.fixture
def janitorless(
    services: localservices.Services, settings: Settings, own_redis: str
) -> Iterator[tuple[ServedApp, str, Engine]]:
    """An API on a database of its own that no janitor purges: expired rows stay there."""
    name = f"reach_janitorless_{secrets.token_hex(3)}"
    url = localservices.create_database(services.database_url, name)
    migrate.upgrade(url)
    local = settings.model_copy(update={"database_url": url, "redis_url": own_redis})
    engine = sync_engine(local)
    advertise_test_cards(engine)
    _, token = key_store.create_key(engine, "t-expiry", ["*"])
    try:
        with ServedApp(create_app(local)) as served:
            yield served, token, engine
    finally:
        engine.dispose()
        localservices.drop_database(services.database_url, name)


def _expired_task(http: httpx.Client, envelope: dict[str, Any]) -> str:
    """Submits ``envelope`` (with a short ``result_ttl_s``), ends the task (a cancel: nobody
    serves it) and waits until it reads 404."""
    first: str = http.post("/tasks", json=envelope).json()["task_id"]
    assert http.post(f"/tasks/{first}/cancel").json()["status"] == "cancelled"
    eventually(
        lambda: http.get(f"/tasks/{first}").status_code == 404, "the task expired for readers"
    )
    return first


def test_a_replay_of_an_expired_task_makes_a_new_task_and_frees_the_key(
    janitorless: tuple[ServedApp, str, Engine],
) -> None:
    api, token, engine = janitorless
    envelope = {
        "capability": "test.nobody-serves",
        "payload": {"order": 1},
        "idempotency_key": "o-1",
        "result_ttl_s": 1,
        "queue_if_unavailable": True,
    }
    with client_for(api, token) as http:
        # Given a task that has expired (404) but is not purged yet
        first = _expired_task(http, envelope)
        # When the same key comes again, with the same payload
        again = http.post("/tasks", json={**envelope, "result_ttl_s": 600})
        # Then it is a new task, as if the first never existed, and the old row is gone
        assert again.status_code == 202
        assert again.json()["task_id"] != first
        assert "idempotent-replayed" not in again.headers
        assert http.get(f"/tasks/{again.json()['task_id']}").status_code == 200
        # And the key now belongs to the new task: replayed with its payload, refused with another
        replay = http.post("/tasks", json={**envelope, "result_ttl_s": 600})
        other = http.post("/tasks", json={**envelope, "payload": {"order": 2}})
    assert (replay.json()["task_id"], replay.headers["idempotent-replayed"]) == (
        again.json()["task_id"],
        "true",
    )
    assert (other.status_code, other.json()["code"]) == (422, "idempotency_key_reused")
    with engine.connect() as conn:
        ids = conn.execute(select(tasks_table.c.id)).scalars().all()
    assert [str(i) for i in ids] == [again.json()["task_id"]]


def test_50_concurrent_replays_of_an_expired_task_make_one_new_task(
    janitorless: tuple[ServedApp, str, Engine],
) -> None:
    api, token, engine = janitorless
    envelope = {
        "capability": "test.nobody-serves",
        "payload": {"order": 2},
        "idempotency_key": "o-2",
        "result_ttl_s": 1,
        "queue_if_unavailable": True,
    }
    with client_for(api, token) as http:
        first = _expired_task(http, envelope)

    async def replay_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=api.url, timeout=60, headers={"Authorization": f"Bearer {token}"}
        ) as http:
            again = {**envelope, "result_ttl_s": 600}
            return await asyncio.gather(*(http.post("/tasks", json=again) for _ in range(50)))

    responses = asyncio.run(replay_all())
    assert {r.status_code for r in responses} == {202}
    [new] = {r.json()["task_id"] for r in responses}
    assert new != first
    assert sum("idempotent-replayed" not in r.headers for r in responses) == 1
    with engine.connect() as conn:
        ids = conn.execute(select(tasks_table.c.id)).scalars().all()
    assert [str(i) for i in ids] == [new]


def test_a_replay_of_a_task_expired_while_still_queued_waits_for_it_to_end(
    janitorless: tuple[ServedApp, str, Engine],
) -> None:
    """The janitor ends a queued task before its expiry; one behind leaves it queued past it.
    The replay deleted it then, as it does an ended one: gone with no final state."""
    api, token, engine = janitorless
    envelope = {
        "capability": "test.nobody-serves",
        "payload": {"order": 3},
        "idempotency_key": "o-3",
        "result_ttl_s": 3,  # ended, kept that long: a loaded machine's pause fits in it
        "queue_if_unavailable": True,
    }
    with client_for(api, token) as http:
        # Given a task that expired while queued, which no janitor has ended
        first = http.post("/tasks", json=envelope).json()["task_id"]
        eventually(lambda: http.get(f"/tasks/{first}").status_code == 404, "the task expired")
        # When the same key comes again
        again = http.post("/tasks", json=envelope)
        # Then the key is being released, and the task is still there, queued
        assert (again.status_code, again.json()["code"]) == (409, "conflict_retry")
        with engine.connect() as conn:
            rows = conn.execute(select(tasks_table.c.id, tasks_table.c.status)).all()
        assert [(str(i), s) for i, s in rows] == [(first, "queued")]
        # And once the janitor has ended it, the same request returns it, ended
        [ended] = execution.expire_unstarted(engine, within_s=0, batch=10)
        assert str(ended["id"]) == first
        replay = http.post("/tasks", json=envelope)
    assert (replay.status_code, replay.headers.get("idempotent-replayed")) == (202, "true")
    assert (replay.json()["task_id"], replay.json()["status"]) == (first, "expired")
    assert replay.json()["error"]["code"] == "ttl_exceeded"


def test_an_a2a_message_sent_again_while_its_key_is_released_is_told_to_retry(
    janitorless: tuple[ServedApp, str, Engine],
) -> None:
    """The same moment through A2A: it answered -32602, invalid params, which tells a client
    its request is wrong and not to send it again. It is answered as ``POST /tasks`` is."""
    api, token, _ = janitorless
    options = {"result_ttl_s": 3, "queue_if_unavailable": True}
    body = send_message_body(
        [{"data": {"order": 4}}], metadata={"capability": "test.nobody-serves", **options}
    )
    body["params"]["configuration"] = {"returnImmediately": True}
    # Given an A2A task that expired while queued, which no janitor has ended
    first = rpc(api, token, body).json()["result"]["task"]["id"]
    with client_for(api, token) as http:
        eventually(lambda: http.get(f"/tasks/{first}").status_code == 404, "the task expired")
    # When the same message comes again
    again = rpc(api, token, body)
    # Then it is told to retry, as the HTTP API tells it
    assert again.headers["content-type"] == "application/problem+json"
    assert (again.status_code, again.json()["code"]) == (409, "conflict_retry")


def _expired_rows(engine: Engine, count: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tasks (id, tenant, capability, queue, status, payload,"
                " payload_digest, payload_size, trace_id, result_ttl_s, expires_at)"
                " SELECT gen_random_uuid(), 't-expiry', 'echo', 'echo', 'succeeded', '{}',"
                " 'd', 2, md5(g::text), 60, now() - interval '1 minute'"
                " FROM generate_series(1, :count) AS g"
            ),
            {"count": count},
        )


def _expired_left(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(text("SELECT count(*) FROM tasks WHERE expires_at <= now()")).scalar_one()
        )


def test_one_janitor_run_deletes_every_expired_row_within_its_budget(
    janitorless: tuple[ServedApp, str, Engine],
) -> None:
    # given more expired rows than 100 batches hold (the old cap of one run)
    _, _, engine = janitorless
    _expired_rows(engine, 1500)
    # when one run deletes in batches of 10 with time to spare
    removed = execution.purge_expired(engine, batch=10, budget_s=60)
    # expect all of them gone in that one run
    assert removed == 1500
    assert _expired_left(engine) == 0


def test_a_janitor_run_stops_when_its_budget_is_spent(
    janitorless: tuple[ServedApp, str, Engine],
) -> None:
    # given expired rows, and a run with no time at all
    _, _, engine = janitorless
    _expired_rows(engine, 50)
    # when it runs: one batch, then the budget is found spent
    removed = execution.purge_expired(engine, batch=10, budget_s=0)
    # expect that one batch deleted, the rest left for the next run
    assert removed == 10
    assert _expired_left(engine) == 40
