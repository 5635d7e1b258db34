"""Sessions through the real API and Postgres: revisions that only grow, If-Match, merge
patches, size and TTL limits, and tenants that never see each other's."""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, func, select, text, update

from api.app import create_app
from broker import sessions
from broker.db.models import session_revisions_table, sessions_table, tasks_table
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.rows import a_task_row
from tests.integration.stack import CeleryProcess, ServedApp
from workers.sdk import AgentFailure
from workers.session_store import SessionStore


@pytest.fixture
def session(client: httpx.Client) -> dict[str, Any]:
    answer = client.post("/sessions", json={"state": {"cart": ["tea"], "user": "ana"}})
    assert answer.status_code == 201, answer.text
    created: dict[str, Any] = answer.json()
    return created


def test_a_new_session_is_at_revision_1_with_its_etag(
    client: httpx.Client, session: dict[str, Any]
) -> None:
    assert session["revision"] == 1
    assert session["session_id"].startswith("sess_")
    answer = client.get(f"/sessions/{session['session_id']}")
    assert answer.status_code == 200
    assert answer.headers["etag"] == '"1"'
    assert answer.json()["state"] == {"cart": ["tea"], "user": "ana"}


def test_a_put_at_the_current_revision_moves_it_on_and_a_stale_one_is_412(
    client: httpx.Client, session: dict[str, Any]
) -> None:
    path = f"/sessions/{session['session_id']}"
    put = client.put(path, json={"state": {"step": 2}}, headers={"If-Match": '"1"'})
    assert put.status_code == 200, put.text
    assert put.headers["etag"] == '"2"'
    assert put.json()["state"] == {"step": 2}
    stale = client.put(path, json={"state": {"step": 3}}, headers={"If-Match": '"1"'})
    assert stale.status_code == 412
    assert stale.json()["code"] == "revision_conflict"
    assert stale.json()["current_revision"] == 2
    assert client.get(path).json()["state"] == {"step": 2}


def test_a_write_without_if_match_is_428(client: httpx.Client, session: dict[str, Any]) -> None:
    path = f"/sessions/{session['session_id']}"
    answer = client.put(path, json={"state": {}})
    assert answer.status_code == 428
    assert answer.json()["code"] == "precondition_required"
    patched = client.patch(path, json={"state": {}})
    assert patched.status_code == 428


def test_concurrent_puts_with_the_same_if_match_give_exactly_one_200(
    client: httpx.Client, session: dict[str, Any]
) -> None:
    path = f"/sessions/{session['session_id']}"

    def put(i: int) -> int:
        answer = client.put(path, json={"state": {"writer": i}}, headers={"If-Match": '"1"'})
        return answer.status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(put, range(16)))
    assert statuses.count(200) == 1, statuses
    assert statuses.count(412) == 15, statuses
    final = client.get(path).json()
    assert final["revision"] == 2
    assert final["state"]["writer"] == statuses.index(200)


def test_a_merge_patch_sets_replaces_and_removes_members(
    client: httpx.Client, session: dict[str, Any]
) -> None:
    path = f"/sessions/{session['session_id']}"
    patch = {"state": {"cart": None, "user": "bo", "prefs": {"lang": "zh"}}, "metadata": {"a": 1}}
    answer = client.patch(
        path,
        content=json.dumps(patch),
        headers={"If-Match": '"1"', "Content-Type": "application/merge-patch+json"},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["state"] == {"user": "bo", "prefs": {"lang": "zh"}}
    assert answer.json()["metadata"] == {"a": 1}
    again = client.patch(
        path, json={"state": {"prefs": {"theme": "dark"}}}, headers={"If-Match": '"2"'}
    )
    assert again.json()["state"]["prefs"] == {"lang": "zh", "theme": "dark"}
    assert again.json()["revision"] == 3


def test_a_patch_removing_state_or_metadata_leaves_them_empty(
    client: httpx.Client, session: dict[str, Any]
) -> None:
    path = f"/sessions/{session['session_id']}"
    answer = client.patch(path, json={"state": None, "metadata": None}, headers={"If-Match": '"1"'})
    assert answer.status_code == 200, answer.text
    assert (answer.json()["state"], answer.json()["metadata"]) == ({}, {})
    wrong = client.patch(path, json={"state": [1]}, headers={"If-Match": '"2"'})
    assert wrong.status_code == 422
    assert wrong.json()["code"] == "session_invalid"


def test_revisions_are_kept_newest_first(client: httpx.Client, session: dict[str, Any]) -> None:
    path = f"/sessions/{session['session_id']}"
    for revision in (1, 2, 3):
        client.put(path, json={"state": {"n": revision + 1}}, headers={"If-Match": f'"{revision}"'})
    listed = client.get(f"{path}/revisions", params={"limit": 3}).json()["revisions"]
    assert [r["revision"] for r in listed] == [4, 3, 2]
    assert [r["state"] for r in listed] == [{"n": 4}, {"n": 3}, {"n": 2}]
    assert all(r["task_id"] is None for r in listed)


def test_only_the_last_revisions_are_kept_and_older_ones_are_deleted_by_the_write(
    settings: Settings, tenant: tuple[str, str], engine: Engine
) -> None:
    # given an API that keeps 5 revisions of a session
    kept = 5
    keeping = settings.model_copy(update={"session_revisions_kept": kept})
    with ServedApp(create_app(keeping)) as api, client_for(api, tenant[1]) as client:
        session_id = client.post("/sessions", json={"state": {"n": 1}}).json()["session_id"]
        path = f"/sessions/{session_id}"
        # when it is written 7 times by PUT and 5 by PATCH (revisions 2 to 13)
        for revision in range(1, 13):
            if revision <= 7:
                answer = client.put(
                    path, json={"state": {"n": revision + 1}}, headers={"If-Match": f'"{revision}"'}
                )
            else:
                answer = client.patch(
                    path,
                    json={"state": {"n": revision + 1}},
                    headers={
                        "If-Match": f'"{revision}"',
                        "Content-Type": "application/merge-patch+json",
                    },
                )
            assert answer.status_code == 200, answer.text
        # expect the last 5 listed, newest first, and no older one, however many are asked for
        listed = client.get(f"{path}/revisions", params={"limit": 100}).json()["revisions"]
    assert [r["revision"] for r in listed] == [13, 12, 11, 10, 9]
    assert [r["state"] for r in listed] == [{"n": n} for n in (13, 12, 11, 10, 9)]
    # and only those left in the table
    with engine.connect() as conn:
        stored = conn.scalars(
            select(session_revisions_table.c.revision)
            .where(session_revisions_table.c.session_id == session_id)
            .order_by(session_revisions_table.c.revision)
        ).all()
    assert stored == [9, 10, 11, 12, 13]


def test_a_tasks_session_write_deletes_the_revisions_past_the_last_kept(
    api: ServedApp, make_key: KeyMaker, engine: Engine
) -> None:
    """The worker's store (``ctx.session``) prunes as the API does, in its write."""
    tenant, token = make_key()
    with client_for(api, token) as http:
        session_id = http.post("/sessions", json={"state": {"n": 0}}).json()["session_id"]
    task_id = a_task_row(engine, tenant=tenant, status="running")
    store = SessionStore(engine, tenant, session_id, task_id, 1 << 20, 2)
    for revision in range(1, 5):
        store.write(revision, {"n": revision})
    with engine.connect() as conn:
        stored = conn.execute(
            select(session_revisions_table.c.revision, session_revisions_table.c.task_id)
            .where(session_revisions_table.c.session_id == session_id)
            .order_by(session_revisions_table.c.revision)
        ).all()
    assert [tuple(r) for r in stored] == [(4, task_id), (5, task_id)]


def test_a_session_over_the_size_limit_is_413_and_unchanged(
    client: httpx.Client, session: dict[str, Any]
) -> None:
    path = f"/sessions/{session['session_id']}"
    big = {"blob": "x" * (300 * 1024)}
    answer = client.put(path, json={"state": big}, headers={"If-Match": '"1"'})
    assert answer.status_code == 413
    assert answer.json()["code"] == "session_too_large"
    assert client.get(path).json()["revision"] == 1
    assert client.post("/sessions", json={"state": big}).status_code == 413


# A session's TTL when the test reads it before it expires: long enough for a loaded machine's
# pause between two requests (with 1 s, a read right after the create found it gone), short
# enough to wait for.
BRIEF_TTL_S = 5


def test_an_expired_session_is_404(client: httpx.Client) -> None:
    created = client.post("/sessions", json={"ttl_s": BRIEF_TTL_S}).json()
    path = f"/sessions/{created['session_id']}"
    assert client.get(path).status_code == 200
    gone = eventually(
        lambda: client.get(path), "the session to expire", 30, 0.1, lambda a: a.status_code == 404
    )
    assert gone.json()["code"] == "session_not_found"
    assert client.put(path, json={"state": {}}, headers={"If-Match": '"1"'}).status_code == 404


def test_another_tenants_session_is_404_for_reads_and_writes(
    api: ServedApp, client: httpx.Client, session: dict[str, Any], make_key: KeyMaker
) -> None:
    path = f"/sessions/{session['session_id']}"
    _, other = make_key()
    with client_for(api, other) as stranger:
        assert stranger.get(path).status_code == 404
        assert (
            stranger.put(path, json={"state": {}}, headers={"If-Match": '"1"'}).status_code == 404
        )
        assert (
            stranger.patch(path, json={"state": {}}, headers={"If-Match": '"1"'}).status_code == 404
        )
        assert stranger.delete(path).status_code == 404
        assert stranger.get(f"{path}/revisions").status_code == 404
    assert client.get(path).json()["revision"] == 1


def test_delete_removes_it(client: httpx.Client, session: dict[str, Any]) -> None:
    path = f"/sessions/{session['session_id']}"
    assert client.delete(path).status_code == 204
    assert client.get(path).status_code == 404
    assert client.delete(path).status_code == 404


@pytest.mark.parametrize(
    "body",
    [{"state": []}, {"state": {}, "extra": 1}, {"ttl_s": 0}, {"metadata": "x"}],
)
def test_a_bad_session_body_is_422(client: httpx.Client, body: dict[str, Any]) -> None:
    answer = client.post("/sessions", json=body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["code"] == "session_invalid"


def test_the_janitor_deletes_expired_sessions_with_their_revisions(
    client: httpx.Client, engine: Engine, system_beat: CeleryProcess
) -> None:
    session_id = client.post("/sessions", json={"ttl_s": BRIEF_TTL_S}).json()["session_id"]

    def rows() -> tuple[int, int]:
        with engine.connect() as conn:
            kept = conn.execute(
                select(func.count()).where(sessions_table.c.id == session_id)
            ).scalar_one()
            revised = conn.execute(
                select(func.count()).where(session_revisions_table.c.session_id == session_id)
            ).scalar_one()
        return int(kept), int(revised)

    assert rows() == (1, 1)
    eventually(rows, "the janitor to delete the expired session", 30, 0.2, (0, 0).__eq__)


def test_a_tenant_may_hold_only_so_many_live_sessions(
    settings: Settings, tenant: tuple[str, str], worker: CeleryProcess
) -> None:
    # given an API that lets a tenant hold 3 live sessions
    capped = settings.model_copy(update={"session_max_per_tenant": 3})
    with ServedApp(create_app(capped)) as api, client_for(api, tenant[1]) as client:
        made = [client.post("/sessions").json()["session_id"] for _ in range(3)]
        # when it asks for a fourth, expect 409 session_limit_reached and no session made
        refused = client.post("/sessions")
        assert refused.status_code == 409, refused.text
        assert refused.json()["code"] == "session_limit_reached"
        assert refused.headers["content-type"].startswith("application/problem+json")
        # and once one is deleted, expect room for one more
        assert client.delete(f"/sessions/{made[0]}").status_code == 204
        assert client.post("/sessions").status_code == 201
        assert client.post("/sessions").status_code == 409


def test_a_task_writes_its_session_only_while_running_at_the_attempt_that_writes(
    api: ServedApp, make_key: KeyMaker, engine: Engine
) -> None:
    """The worker's store (``ctx.session``) names the task and its attempt: an attempt the
    reaper took for lost and gave to another worker writes nothing when it wakes."""
    tenant, token = make_key()
    with client_for(api, token) as http:
        session_id = http.post("/sessions", json={"state": {"n": 0}}).json()["session_id"]
    task_id = a_task_row(engine, tenant=tenant, status="running")
    with engine.begin() as conn:  # its second attempt runs
        conn.execute(update(tasks_table).where(tasks_table.c.id == task_id).values(attempts=2))

    def store(attempt: int) -> SessionStore:
        return SessionStore(engine, tenant, session_id, task_id, 1 << 20, 20, attempt)

    with pytest.raises(AgentFailure) as stale:
        store(1).write(1, {"n": "from the first attempt"})
    assert stale.value.code == "task_not_running"
    assert store(2).write(1, {"n": 2}) == (2, {"n": 2})
    with engine.connect() as conn:
        state = conn.scalar(select(sessions_table.c.state).where(sessions_table.c.id == session_id))
    assert state == {"n": 2}


@pytest.mark.parametrize(
    "state",
    [{"note": "a\x00b"}, {"ratio": float("nan")}, {"tags": {"a", "b"}}, {"text": "\ud800"}],
    ids=["nul", "nan", "not-json", "lone-surrogate"],
)
def test_a_tasks_session_write_postgres_or_json_would_refuse_fails_session_invalid(
    api: ServedApp, make_key: KeyMaker, engine: Engine, state: dict[str, Any]
) -> None:
    """A request's body is parsed strictly; an agent's ``ctx.session.update`` was not, and a
    NUL reached Postgres, whose refusal (the SQL and its values) became the task's error."""
    tenant, token = make_key()
    with client_for(api, token) as http:
        session_id = http.post("/sessions", json={"state": {"n": 0}}).json()["session_id"]
    task_id = a_task_row(engine, tenant=tenant, status="running")
    store = SessionStore(engine, tenant, session_id, task_id, 1 << 20, 20)

    with pytest.raises(AgentFailure) as refused:
        store.write(1, state)

    assert refused.value.code == "session_invalid"
    assert "UPDATE" not in refused.value.message and "SQL" not in refused.value.message
    assert store.read() == (1, {"n": 0})


def _write_waiting_behind(
    engine: Engine, tenant: str, session_id: str, revision: int | frozenset[int] | None
) -> tuple[Future[Any], int]:
    """``compare_and_set`` of ``revision`` begun on a thread of its own, and its backend's pid,
    for a test to see it wait for the session's row."""
    started: Future[int] = Future()

    def write() -> Any:
        with engine.begin() as conn:
            started.set_result(conn.execute(select(func.pg_backend_pid())).scalar_one())
            return sessions.compare_and_set(
                conn, tenant, session_id, revision=revision, state={"w": 2}, **LIMITS
            )

    written = ThreadPoolExecutor(1).submit(write)
    return written, started.result(timeout=30)


def _waiting_for_a_lock(engine: Engine, pid: int) -> bool:
    with engine.connect() as conn:
        query = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"
        return conn.execute(text(query), {"pid": pid}).scalar() == "Lock"


LIMITS: dict[str, Any] = {"max_bytes": 2**20, "revisions_kept": 5}


def test_a_write_that_finds_its_session_deleted_meanwhile_is_not_found_not_a_conflict(
    session: dict[str, Any], tenant: tuple[str, str], engine: Engine
) -> None:
    """A write waits for the session's row while another transaction deletes it; then it is
    told of the session's absence, not of a conflict at a revision made up (412, which a
    worker's write took for retryable, using an attempt)."""
    session_id = session["session_id"]
    with engine.begin() as deleting:
        deleting.execute(sessions_table.delete().where(sessions_table.c.id == session_id))
        written, pid = _write_waiting_behind(engine, tenant[0], session_id, 1)
        eventually(lambda: _waiting_for_a_lock(engine, pid), "the write waiting for the row")
    with pytest.raises(sessions.SessionNotFound):
        written.result(timeout=30)


@pytest.mark.parametrize(
    ("if_match", "outcome"), [(sessions.ANY_REVISION, 3), (frozenset({1, 2}), 3), (1, 412)]
)
def test_a_write_behind_another_matches_the_revision_that_one_leaves(
    session: dict[str, Any],
    tenant: tuple[str, str],
    engine: Engine,
    if_match: int | frozenset[int] | None,
    outcome: int,
) -> None:
    """Two writers at once: the second waits for the first and matches its ``If-Match``
    against the revision the first wrote (2). ``*`` and a list naming 2 write revision 3; a
    tag of 1 is a conflict at 2."""
    session_id = session["session_id"]
    with engine.begin() as first:
        sessions.compare_and_set(first, tenant[0], session_id, revision=1, state={"w": 1}, **LIMITS)
        written, pid = _write_waiting_behind(engine, tenant[0], session_id, if_match)
        eventually(lambda: _waiting_for_a_lock(engine, pid), "the write waiting for the row")
    if outcome == 412:
        with pytest.raises(sessions.RevisionConflict) as conflict:
            written.result(timeout=30)
        assert conflict.value.details["current_revision"] == 2
    else:
        assert written.result(timeout=30).revision == outcome


@pytest.mark.parametrize(
    ("if_match", "status", "revision"),
    [
        ("*", 200, 3),
        ('"9", "2"', 200, 3),
        ('W/"2" ,, "x"', 200, 3),
        ('"1", "3"', 412, 2),
        ('"2" "1"', 412, 2),  # not a list of tags
    ],
)
def test_if_match_star_and_lists_match_as_http_says(
    client: httpx.Client, session: dict[str, Any], if_match: str, status: int, revision: int
) -> None:
    """RFC 9110, 13.1.1: ``*`` matches the session as it is; a list matches when one of its
    tags is the current revision (2, after one write)."""
    path = f"/sessions/{session['session_id']}"
    assert client.put(path, json={"state": {}}, headers={"If-Match": '"1"'}).status_code == 200
    answer = client.put(path, json={"state": {"n": 1}}, headers={"If-Match": if_match})
    assert answer.status_code == status, answer.text
    assert client.get(path).json()["revision"] == revision
    if status == 412:
        assert answer.json()["current_revision"] == 2
