"""Listing by session through the real API and Postgres: a tenant's live sessions
(``GET /sessions``), paged newest first, and a session's tasks (``GET /tasks?session_id=``);
neither ever shows another tenant's."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, func, update

from api.app import create_app
from broker.db.models import sessions_table
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import CeleryProcess, ServedApp


def new_session(client: httpx.Client, **body: Any) -> str:
    answer = client.post("/sessions", json=body)
    assert answer.status_code == 201, answer.text
    session_id: str = answer.json()["session_id"]
    return session_id


def every_page(client: httpx.Client, path: str, key: str, **params: Any) -> list[list[str]]:
    """The ids of each page, following ``next_cursor`` to the end."""
    pages: list[list[str]] = []
    cursor = None
    while True:
        answer = client.get(path, params={**params, **({"cursor": cursor} if cursor else {})})
        assert answer.status_code == 200, answer.text
        found = answer.json()
        pages.append([item[f"{key[:-1]}_id"] for item in found[key]])
        cursor = found["next_cursor"]
        if cursor is None:
            return pages


def submit(client: httpx.Client, **envelope: Any) -> str:
    answer = client.post("/tasks", json={"capability": "echo", "payload": {}, **envelope})
    assert answer.status_code == 202, answer.text
    task_id: str = answer.json()["task_id"]
    return task_id


# -- GET /sessions ---------------------------------------------------------------------------


def test_sessions_are_listed_newest_first_with_the_resource_get_answers(
    client: httpx.Client,
) -> None:
    # Given three sessions, the last one written to once
    made = [new_session(client, state={"n": i}, metadata={"who": "ana"}) for i in range(3)]
    written = client.put(
        f"/sessions/{made[2]}", json={"state": {"n": 9}}, headers={"If-Match": '"1"'}
    )
    assert written.status_code == 200, written.text
    # When the tenant lists its sessions
    answer = client.get("/sessions")
    # Then each is there, newest first, exactly as GET /sessions/{id} has it
    assert answer.status_code == 200, answer.text
    listed = answer.json()
    assert [s["session_id"] for s in listed["sessions"]] == made[::-1]
    assert listed["next_cursor"] is None
    for session in listed["sessions"]:
        assert session == client.get(f"/sessions/{session['session_id']}").json()
    assert listed["sessions"][0]["revision"] == 2
    assert listed["sessions"][0]["state"] == {"n": 9}


def test_paging_through_the_sessions_skips_and_repeats_none(client: httpx.Client) -> None:
    made = [new_session(client) for _ in range(7)]
    pages = every_page(client, "/sessions", "sessions", limit=3)
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [s for page in pages for s in page] == made[::-1]


def test_sessions_created_at_the_same_instant_page_without_gaps_or_repeats(
    client: httpx.Client, engine: Engine
) -> None:
    # Given seven sessions that share one creation time (only their ids tell them apart)
    made = [new_session(client) for _ in range(7)]
    with engine.begin() as conn:
        conn.execute(
            update(sessions_table)
            .where(sessions_table.c.id.in_(made))
            .values(created_at=func.now())
        )
    # When they are listed two at a time, expect each once
    pages = every_page(client, "/sessions", "sessions", limit=2)
    seen = [s for page in pages for s in page]
    assert [len(p) for p in pages] == [2, 2, 2, 1]
    assert sorted(seen) == sorted(made)


def test_another_tenants_sessions_are_never_listed(
    api: ServedApp, client: httpx.Client, make_key: KeyMaker
) -> None:
    mine = [new_session(client) for _ in range(2)]
    _, token = make_key()
    with client_for(api, token) as stranger:
        theirs = [new_session(stranger) for _ in range(2)]
        assert every_page(stranger, "/sessions", "sessions", limit=1) == [[t] for t in theirs[::-1]]
        # A cursor made from the other tenant's session still lists only one's own.
        cursor = client.get("/sessions", params={"limit": 1}).json()["next_cursor"]
        after = stranger.get("/sessions", params={"cursor": cursor})
        assert after.status_code == 200, after.text
        assert {s["session_id"] for s in after.json()["sessions"]} <= set(theirs)
    assert every_page(client, "/sessions", "sessions") == [mine[::-1]]


def test_an_expired_session_is_not_listed(client: httpx.Client) -> None:
    lasting = new_session(client)
    # Long enough to be listed on a loaded machine (with 1 s, it had expired by the listing)
    brief = new_session(client, ttl_s=5)
    listed = [s["session_id"] for s in client.get("/sessions").json()["sessions"]]
    assert listed == [brief, lasting]
    eventually(
        lambda: [s["session_id"] for s in client.get("/sessions").json()["sessions"]],
        "the brief session to expire",
        30,
        0.1,
        [lasting].__eq__,
    )


def test_the_page_size_is_capped_by_the_settings(
    settings: Settings, tenant: tuple[str, str], worker: CeleryProcess
) -> None:
    # Given an API whose pages hold at most 3
    capped = settings.model_copy(update={"list_page_max": 3})
    with ServedApp(create_app(capped)) as api, client_for(api, tenant[1]) as client:
        made = [new_session(client) for _ in range(4)]
        # When a client asks for 50, expect 3 and a cursor to the fourth
        answer = client.get("/sessions", params={"limit": 50}).json()
        assert [s["session_id"] for s in answer["sessions"]] == made[:0:-1]
        rest = client.get("/sessions", params={"cursor": answer["next_cursor"]}).json()
        assert [s["session_id"] for s in rest["sessions"]] == [made[0]]


# State of about 3 KB (as JSON text), and a page budget that holds two of them but not three.
SOME_STATE = {"blob": "x" * 3000}
LARGE_STATE = {"blob": "x" * 10_000}
TWO_AND_A_HALF = 7_500


def test_sessions_whose_state_passes_the_byte_budget_come_in_shorter_pages(
    settings: Settings, tenant: tuple[str, str], client: httpx.Client
) -> None:
    # Given five sessions of 3 KB each
    made = [new_session(client, state=SOME_STATE) for _ in range(5)]
    # When an API whose pages hold 7.5 KB lists them, expect two a page, each once, in order
    budgeted = settings.model_copy(update={"list_page_max_bytes": TWO_AND_A_HALF})
    with ServedApp(create_app(budgeted)) as api, client_for(api, tenant[1]) as small:
        pages = every_page(small, "/sessions", "sessions")
    assert [len(p) for p in pages] == [2, 2, 1]
    assert [s for page in pages for s in page] == made[::-1]
    # And with the default budget, one page as before
    assert every_page(client, "/sessions", "sessions") == [made[::-1]]


def test_a_session_larger_than_the_byte_budget_is_listed_alone_and_paging_goes_on(
    settings: Settings, tenant: tuple[str, str], client: httpx.Client
) -> None:
    # Given a 10 KB session between 3 KB ones, under a budget of 7.5 KB
    first, large, last = (new_session(client, state=s) for s in (SOME_STATE, LARGE_STATE, {}))
    budgeted = settings.model_copy(update={"list_page_max_bytes": TWO_AND_A_HALF})
    with ServedApp(create_app(budgeted)) as api, client_for(api, tenant[1]) as small:
        # When they are listed, expect the first page to end before the large one, which
        # comes alone on the next, with a cursor to the rest
        assert every_page(small, "/sessions", "sessions") == [[last], [large], [first]]


def test_revisions_are_listed_within_the_byte_budget_the_newest_always(
    settings: Settings, tenant: tuple[str, str], client: httpx.Client
) -> None:
    session = f"/sessions/{new_session(client, state=SOME_STATE)}"
    path = f"{session}/revisions"

    def write(revision: int, state: dict[str, Any]) -> None:
        headers = {"If-Match": f'"{revision}"'}
        answer = client.put(session, json={"state": state}, headers=headers)
        assert answer.status_code == 200, answer.text

    budgeted = settings.model_copy(update={"list_page_max_bytes": TWO_AND_A_HALF})
    with ServedApp(create_app(budgeted)) as api, client_for(api, tenant[1]) as small:
        # Given three revisions of 3 KB states, when an API whose pages hold 7.5 KB lists
        # them, expect the newest two
        write(1, SOME_STATE)
        write(2, SOME_STATE)
        assert [r["revision"] for r in small.get(path).json()["revisions"]] == [3, 2]
        # Given a fourth of 10 KB, expect it alone: it passes the budget by itself
        write(3, LARGE_STATE)
        assert [r["revision"] for r in small.get(path).json()["revisions"]] == [4]
    # And with the default budget, all four
    assert [r["revision"] for r in client.get(path).json()["revisions"]] == [4, 3, 2, 1]


@pytest.mark.parametrize(
    ("params", "status", "code"),
    [
        ({"cursor": "not a cursor"}, 400, "invalid_cursor"),
        ({"cursor": "A" * 11}, 400, "invalid_cursor"),
        ({"limit": 0}, 422, "invalid_parameter"),
        ({"limit": "many"}, 422, "invalid_parameter"),
    ],
)
def test_a_bad_sessions_query_is_a_problem_with_its_code(
    client: httpx.Client, params: dict[str, Any], status: int, code: str
) -> None:
    answer = client.get("/sessions", params=params)
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.json()["code"] == code


# -- GET /tasks?session_id= ------------------------------------------------------------------


def test_the_tasks_of_a_session_are_only_its_own(
    api: ServedApp, client: httpx.Client, make_key: KeyMaker
) -> None:
    # Given two sessions with tasks, and a task in none
    ours, other = new_session(client), new_session(client)
    in_ours = [submit(client, session_id=ours, payload={"i": i}) for i in range(3)]
    submit(client, session_id=other)
    submit(client)
    # When the tasks are listed by session, two at a time
    pages = every_page(client, "/tasks", "tasks", session_id=ours, limit=2)
    # Then exactly that session's are, newest first
    assert [t for page in pages for t in page] == in_ours[::-1]
    listed = client.get("/tasks", params={"session_id": ours}).json()["tasks"]
    assert {t["session_id"] for t in listed} == {ours}
    # And filters combine: none of this session's tasks failed
    none = client.get("/tasks", params={"session_id": ours, "status": "failed"}).json()
    assert none["tasks"] == []
    # And another tenant asking for this session's tasks finds none
    _, token = make_key()
    with client_for(api, token) as stranger:
        submit(stranger)
        theirs = stranger.get("/tasks", params={"session_id": ours})
        assert theirs.status_code == 200, theirs.text
        assert theirs.json() == {"tasks": [], "next_cursor": None}


def test_a_session_that_does_not_exist_lists_no_tasks(client: httpx.Client) -> None:
    submit(client)
    answer = client.get("/tasks", params={"session_id": "sess_nobody"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["tasks"] == []


@pytest.mark.parametrize("session_id", ["", "sess x", "sess_\u00e9", "sess_\x00", "s" * 129])
def test_a_malformed_session_id_is_422_invalid_parameter(
    client: httpx.Client, session_id: str
) -> None:
    answer = client.get("/tasks", params={"session_id": session_id})
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    problem = answer.json()
    assert problem["code"] == "invalid_parameter"
    assert [e["field"] for e in problem["errors"]] == ["query.session_id"]
