"""What a tenant's tasks hold, counted by Postgres, what their event logs hold, counted by
Redis, and the quotas on them (``broker.tenancy.usage``).

Through the real API and Postgres: the bytes follow every statement that writes or deletes
tasks (grouped inserts, a session's turn, a replay's delete of an expired task, the janitor),
and a tenant at its quota is refused before anything is written, while another tenant is not.
Through the real event script and a real worker: a tenant's bytes in Redis follow every event
stored and let go, and a tenant whose agents' answers fill its event quota is refused too.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from fastapi import FastAPI
from sqlalchemy import Engine, text

from api.app import create_app
from broker import sessions
from broker.settings import Settings
from broker.tasks import events, execution
from broker.tasks.events import EventLog, log_key, parse_entries, tenant_bytes_key
from broker.tenancy import key_store
from broker.tenancy.usage import EVENT_BYTES, ROW_BYTES, RedisHeld, task_bytes
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, advertise_test_cards, client_for, count_tasks
from tests.integration.rows import a_task_row
from tests.integration.stack import CeleryProcess, ServedApp, wait_for_task
from workers.session_store import SessionStore

PAYLOAD = {"text": "x" * 2000}  # 2,011 bytes of canonical JSON
NOBODY = "test.nobody-holds"  # queued and never run: the rows stay as written
# The TTL of a task or session the test still counts on after a few more requests: a loaded
# machine's pauses between them fit in it (with 1 s, a replay found its task expired, and the
# run's janitor deleted a session before the bytes were measured), and it passes soon.
BRIEF_TTL_S = 5


def held(engine: Engine, tenant: str) -> int:
    """The tenant's bytes as the triggers counted them."""
    with engine.connect() as conn:
        query = text("SELECT coalesce(sum(bytes), 0) FROM tenant_usage WHERE tenant = :t")
        return int(conn.execute(query, {"t": tenant}).scalar_one())


def measured(engine: Engine, tenant: str) -> int:
    """The same, measured on the rows the tenant has now: its tasks, its sessions and their
    revisions."""
    with engine.connect() as conn:
        query = text(
            "SELECT (SELECT coalesce(sum(payload_size"
            "   + coalesce(octet_length(metadata::text), 0) + :row), 0)"
            "  FROM tasks WHERE tenant = :t)"
            " + (SELECT coalesce(sum(octet_length(state::text)"
            "   + octet_length(metadata::text) + :row), 0) FROM sessions WHERE tenant = :t)"
            " + (SELECT coalesce(sum(octet_length(state::text) + :row), 0)"
            "  FROM session_revisions WHERE tenant = :t)"
        )
        return int(conn.execute(query, {"t": tenant, "row": ROW_BYTES}).scalar_one())


def tasks_only(engine: Engine, tenant: str) -> int:
    """What the tenant's tasks hold, measured on their rows."""
    with engine.connect() as conn:
        query = text(
            "SELECT coalesce(sum(payload_size + coalesce(octet_length(metadata::text), 0)"
            " + :row), 0) FROM tasks WHERE tenant = :t"
        )
        return int(conn.execute(query, {"t": tenant, "row": ROW_BYTES}).scalar_one())


def quota_app(settings: Settings, **limits: int) -> FastAPI:
    """An API with these limits, whose quotas read the stores on every request."""
    app = create_app(settings.model_copy(update=limits))
    for quota in (app.state.services.intake.quota.rows, app.state.services.intake.quota.events):
        quota.refresh_s = 0
        quota.stale_s = 0
    return app


def envelope(**more: Any) -> dict[str, Any]:
    return {"capability": NOBODY, "payload": PAYLOAD, "queue_if_unavailable": True, **more}


def expired(http: httpx.Client, task_id: str) -> None:
    """Wait until a task submitted with a TTL of 1 s reads as gone."""
    eventually(lambda: http.get(f"/tasks/{task_id}").status_code == 404, f"{task_id} expired")


def expire_and_purge(engine: Engine, http: httpx.Client, task_ids: list[str]) -> None:
    """Wait until the tasks read as gone, then run the janitor as it runs: the ones still
    queued (nobody serves them) end first, kept their TTL more as every ended task is, and
    the rows go once that has passed too."""
    for task_id in task_ids:
        expired(http, task_id)
    while execution.expire_unstarted(engine, within_s=0, batch=1000):
        pass
    for task_id in task_ids:
        expired(http, task_id)
    execution.purge_expired(engine, batch=1000, budget_s=30)


@pytest.fixture
def janitorless(settings: Settings, own_engine: Engine, own_redis: str) -> Settings:
    """Settings of an API on a database of its own, with the test cards: no janitor of the
    run deletes its tasks of a second, which stay counted until the test runs the janitor.
    On the run's database, once another test had started the run's janitor (every 0.5 s),
    it deleted some of them between their submits and the count that expects them all."""
    advertise_test_cards(own_engine)
    url = own_engine.url.render_as_string(hide_password=False)
    return settings.model_copy(update={"database_url": url, "redis_url": own_redis})


def own_key(engine: Engine) -> tuple[str, str]:
    """A key of a fresh tenant allowed everything, in ``engine``'s database: (tenant, token)."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    _, token = key_store.create_key(engine, tenant, ["*"])
    return tenant, token


def test_the_bytes_a_tenant_holds_follow_every_insert_and_delete(
    janitorless: Settings, own_engine: Engine
) -> None:
    engine = own_engine
    tenant, key = own_key(engine)
    other, other_key = own_key(engine)
    with ServedApp(create_app(janitorless)) as served, client_for(served, key) as http:
        # grouped inserts: 24 submits at once, some with metadata
        def submit(n: int) -> httpx.Response:
            with client_for(served, key) as own:
                extra = {"metadata": {"n": n, "note": "y" * n}} if n % 2 else {}
                return own.post("/tasks", json=envelope(result_ttl_s=1, **extra))

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(submit, range(24)))
        assert [a.status_code for a in answers] == [202] * 24, answers[0].text
        # a replay adds nothing; a session's turn goes in by its own statement
        first = http.post("/tasks", json=envelope(idempotency_key="k-1"))
        again = http.post("/tasks", json=envelope(idempotency_key="k-1"))
        assert again.json()["task_id"] == first.json()["task_id"]
        session = http.post("/sessions").json()["session_id"]
        turn = http.post("/tasks", json=envelope(session_id=session))
        assert turn.status_code == 202, turn.text
        with client_for(served, other_key) as other_http:
            assert other_http.post("/tasks", json=envelope()).status_code == 202
        # expect the count to be the rows' bytes, each tenant its own
        assert count_tasks(engine, tenant) == 26
        assert held(engine, tenant) == measured(engine, tenant)
        assert tasks_only(engine, tenant) > 26 * (2011 + ROW_BYTES)
        assert held(engine, other) == measured(engine, other) == task_bytes(2011, 2)

        # the janitor's deletes give back what the 24 short-lived tasks held
        expire_and_purge(engine, http, [a.json()["task_id"] for a in answers])
        assert count_tasks(engine, tenant) == 2
        assert held(engine, tenant) == measured(engine, tenant)
        assert tasks_only(engine, tenant) == 2 * (2011 + 2 + ROW_BYTES)

        # so does a replay that finds its task expired and deletes it before inserting anew
        short = http.post("/tasks", json=envelope(idempotency_key="k-2", result_ttl_s=1))
        assert http.post(f"/tasks/{short.json()['task_id']}/cancel").status_code == 200
        expired(http, short.json()["task_id"])
        renewed = http.post("/tasks", json=envelope(idempotency_key="k-2"))
        assert renewed.status_code == 202
        assert renewed.json()["task_id"] != short.json()["task_id"]
        assert count_tasks(engine, tenant) == 3
        assert held(engine, tenant) == measured(engine, tenant)


def test_a_tenant_at_its_quota_gets_429_with_nothing_written_and_another_still_gets_in(
    janitorless: Settings, own_engine: Engine
) -> None:
    # a quota of two tasks of this size (each 2,011 + 2 + 1,024 bytes)
    engine = own_engine
    app = quota_app(janitorless, tenant_max_held_bytes=7000)
    hog, hog_key = own_key(engine)
    _, other_key = own_key(engine)
    with ServedApp(app) as served, client_for(served, hog_key) as http:
        first = http.post("/tasks", json=envelope(idempotency_key="a", result_ttl_s=BRIEF_TTL_S))
        second = http.post("/tasks", json=envelope(result_ttl_s=1))
        third = http.post("/tasks", json=envelope(idempotency_key="c"))
        assert [first.status_code, second.status_code, third.status_code] == [202, 202, 429]
        problem = third.json()
        assert problem["code"] == "quota_exceeded"
        assert problem["held_bytes"] == held(engine, hog) == 2 * 3037
        assert problem["limit_bytes"] == 7000
        assert int(third.headers["retry-after"]) >= 1
        assert count_tasks(engine, hog) == 2  # nothing written for the refused one
        # a replay of a task already accepted still gets it
        replay = http.post("/tasks", json=envelope(idempotency_key="a", result_ttl_s=1))
        assert replay.status_code == 202
        assert replay.json()["task_id"] == first.json()["task_id"]
        # another tenant is not held back by the hog's bytes
        with client_for(served, other_key) as other:
            assert other.post("/tasks", json=envelope()).status_code == 202

        # once the hog's tasks expire and the janitor deletes them, it gets in again
        expire_and_purge(engine, http, [first.json()["task_id"], second.json()["task_id"]])
        assert held(engine, hog) == 0
        after = http.post("/tasks", json=envelope(idempotency_key="c"))
        assert after.status_code == 202, after.text


def test_the_bytes_a_tenants_sessions_hold_follow_every_write_and_delete(
    api: ServedApp, make_key: KeyMaker, engine: Engine
) -> None:
    tenant, key = make_key()
    with client_for(api, key) as http:
        first = http.post("/sessions", json={"state": {"a": "x" * 500}, "metadata": {"m": 1}})
        sid = first.json()["session_id"]
        second = http.post("/sessions", json={"state": {"b": "y" * 900}, "ttl_s": BRIEF_TTL_S})
        assert held(engine, tenant) == measured(engine, tenant) > 1400 + 4 * ROW_BYTES
        # a replacement and a patch: the state's new size, and a revision each
        put = http.put(f"/sessions/{sid}", json={"state": {"a": "z" * 50}}, headers=IF_1)
        assert put.status_code == 200, put.text
        patch = http.patch(
            f"/sessions/{sid}",
            json={"state": {"c": "w" * 3000}},
            headers={"If-Match": '"2"', "Content-Type": "application/merge-patch+json"},
        )
        assert patch.status_code == 200, patch.text
        assert held(engine, tenant) == measured(engine, tenant)
        # a task's writes, keeping two revisions: the ones let go are taken back
        task_id = a_task_row(engine, tenant=tenant, status="running")
        store = SessionStore(engine, tenant, sid, task_id, 1 << 20, 2)
        for revision in range(3, 7):
            store.write(revision, {"n": "v" * (100 * revision)})
        assert held(engine, tenant) == measured(engine, tenant)
        # a delete cascades to the revisions; the janitor deletes an expired session
        assert http.delete(f"/sessions/{sid}").status_code == 204
        assert held(engine, tenant) == measured(engine, tenant)
        eventually(
            lambda: http.get(f"/sessions/{second.json()['session_id']}").status_code == 404,
            "the short session expired",
        )
        sessions.purge_expired(engine, batch=100)  # unless the test run's janitor did
        with engine.connect() as conn:
            left = text("SELECT count(*) FROM sessions WHERE tenant = :t")
            assert conn.execute(left, {"t": tenant}).scalar_one() == 0
        assert held(engine, tenant) == measured(engine, tenant) == tasks_only(engine, tenant)


IF_1 = {"If-Match": '"1"'}


def test_a_tenant_at_its_quota_cannot_create_or_grow_sessions_but_may_delete_them(
    settings: Settings, make_key: KeyMaker, engine: Engine
) -> None:
    # room for a session of 3,000 bytes and two more of its revisions, not three
    app = quota_app(settings, tenant_max_held_bytes=20_000)
    hog, hog_key = make_key()
    _, other_key = make_key()
    body = {"state": {"blob": "x" * 3000}}
    with ServedApp(app) as served, client_for(served, hog_key) as http:
        sid = http.post("/sessions", json=body).json()["session_id"]
        path = f"/sessions/{sid}"
        for revision in (1, 2):
            answer = http.put(path, json=body, headers={"If-Match": f'"{revision}"'})
            assert answer.status_code == 200, answer.text
        refused = http.put(path, json=body, headers={"If-Match": '"3"'})
        assert refused.status_code == 429, refused.text
        assert refused.json()["code"] == "quota_exceeded"
        assert "sessions hold" in refused.json()["detail"]
        assert "REACH_TENANT_MAX_HELD_BYTES" in refused.json()["detail"]
        assert refused.json()["held_bytes"] == held(engine, hog) == measured(engine, hog)
        assert http.get(path).json()["revision"] == 3  # the refused write changed nothing
        assert http.post("/sessions", json=body).status_code == 429
        with client_for(served, other_key) as other:
            assert other.post("/sessions", json=body).status_code == 201
        # deleting is always allowed, and makes room again
        assert http.delete(path).status_code == 204
        assert held(engine, hog) == 0
        assert http.post("/sessions", json=body).status_code == 201


def in_redis(url: str, tenant: str) -> int:
    """The tenant's bytes in Redis, as the API reads them."""

    async def read() -> int:
        client = aioredis.Redis.from_url(url)
        try:
            return await RedisHeld(client)(tenant)
        finally:
            await client.aclose()

    return asyncio.run(read())


def stored(client: redis.Redis, task_ids: list[uuid.UUID]) -> int:
    """The bytes of every event these tasks' logs hold now, the final ones too, and each
    log's stream and keys."""
    kept = sum(len(fields[b"e"]) for t in task_ids for _, fields in client.xrange(log_key(t)))
    return kept + events.LOG_OVERHEAD_BYTES * sum(client.exists(log_key(t)) for t in task_ids)


def test_the_bytes_a_tenants_event_logs_hold_follow_every_event_stored_and_let_go(
    own_redis: str,
) -> None:
    client = redis.Redis.from_url(own_redis)
    log = EventLog(client, 60, max_bytes=1000)
    first, second, others = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    log.append(first, "status", {"status": "running"}, tenant="a", trace_id="t", attempt=1)
    for i in range(6):  # past 1,000 bytes the oldest outputs give way
        log.append(first, "output", {"i": i, "x": "x" * 300}, tenant="a", trace_id="t", attempt=1)
        assert in_redis(own_redis, "a") == stored(client, [first])
    kept = parse_entries(client.xrange(log_key(first)))
    assert [e.data["i"] for e in kept] == [4, 5]  # and the bytes they held were taken back
    # the final event counts whatever its size; one refused after it adds nothing
    log.append(first, "succeeded", {"result": "r" * 5000}, tenant="a", trace_id="t")
    assert log.append(first, "output", "late", tenant="a", trace_id="t", attempt=1) == 0
    log.append(second, "output", "y" * 200, tenant="a", trace_id="t", attempt=1)
    log.append(others, "output", "z" * 100, tenant="b", trace_id="t", attempt=1)
    assert in_redis(own_redis, "a") == stored(client, [first, second]) > 5000
    assert in_redis(own_redis, "b") == stored(client, [others])
    # the hash goes an hour after the last log it counts
    assert 3600 + 60 - 5 < client.ttl(tenant_bytes_key("a")) <= 3600 + 60

    # bytes counted for an hour that has begun are gone with their logs: not counted, and
    # their field is deleted as it is read
    now = int(time.time() // 3600)
    client.hset(tenant_bytes_key("a"), mapping={str(now): 10**9, str(now - 5): 10**9})
    assert in_redis(own_redis, "a") == stored(client, [first, second])
    kept = {int(hour) for hour in client.hkeys(tenant_bytes_key("a"))}
    assert kept and min(kept) > now  # the logs' own hours (one, or two across an hour's end)


def test_a_tenant_whose_event_logs_hold_its_quota_gets_429_and_another_still_gets_in(
    settings: Settings, make_key: KeyMaker, engine: Engine, worker: CeleryProcess
) -> None:
    # room for about two tasks that each stream 20 outputs of 2,000 characters
    app = quota_app(settings, tenant_max_event_bytes=60_000)
    hog, hog_key = make_key()
    _, other_key = make_key()
    flood = {"capability": "test.flood", "payload": {"n": 20, "size": 2000}}
    with ServedApp(app) as served, client_for(served, hog_key) as http:
        for _ in range(2):
            answer = http.post("/tasks", json=flood)
            assert answer.status_code == 202, answer.text
            done = wait_for_task(http, answer.json()["task_id"], {"succeeded", "failed"})
            assert done["status"] == "succeeded", done
        held = in_redis(settings.redis_url, hog)
        assert held > 2 * 20 * 2000
        refused = http.post("/tasks", json=flood)
        assert refused.status_code == 429, refused.text
        problem = refused.json()
        assert problem["code"] == "quota_exceeded"
        assert "REACH_TENANT_MAX_EVENT_BYTES" in problem["detail"]
        assert problem["held_bytes"] == held
        assert problem["limit_bytes"] == 60_000
        assert held + EVENT_BYTES > 60_000
        assert count_tasks(engine, hog) == 2  # nothing written for the refused one
        with client_for(served, other_key) as other:
            assert other.post("/tasks", json=flood).status_code == 202
