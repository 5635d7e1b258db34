"""Turns through the real API, Postgres, Redis and Celery workers: a task's ``session_id``
must name a live session of its tenant, and the tasks of one session run one at a time, in
the order they were accepted, each seeing what the one before it wrote."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import Engine, func, select, text, update

from api.app import create_app
from broker import sessions
from broker.db.models import sessions_table, tasks_table
from broker.settings import Settings
from broker.tasks import execution, turns
from broker.tasks.dispatch import Dispatcher, send_run
from tests.agents import GATE_KEY
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for, count_tasks
from tests.integration.rows import a_task_row
from tests.integration.stack import (
    CeleryProcess,
    ServedApp,
    start_worker,
    submit_many,
    wait_for_task,
)


def new_session(client: httpx.Client, **body: Any) -> str:
    answer = client.post("/sessions", json=body)
    assert answer.status_code == 201, answer.text
    session_id: str = answer.json()["session_id"]
    return session_id


def _session_column(engine: Engine, session_id: str, column: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            select(sessions_table.c[column]).where(sessions_table.c.id == session_id)
        ).scalar_one()


def turns_taken(engine: Engine, session_id: str) -> int:
    return int(_session_column(engine, session_id, "turns"))


def _tenant_of_session(engine: Engine, session_id: str) -> str:
    return str(_session_column(engine, session_id, "tenant"))


def wait_expired(client: httpx.Client, session_id: str) -> None:
    """Until the session reads 404: its idle TTL has passed."""
    eventually(
        lambda: client.get(f"/sessions/{session_id}").status_code,
        "the session to expire",
        10,
        0.1,
        (404).__eq__,
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
    wait_expired(client, session_id)
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
        "deadline_ms": 2000,  # not left at the head of its session's line
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


# -- turns in order ----------------------------------------------------------------------------

TURN_QUEUES = "chat.reply,test.turn,test.turn-async"
FINAL = {"succeeded", "failed", "cancelled", "expired"}


@pytest.fixture(scope="module")
def turn_worker(
    settings: Settings, log_dir: Path, system_workers: list[CeleryProcess]
) -> Iterator[CeleryProcess]:
    """A worker of its own for the session capabilities: prefork, 2 processes."""
    process = start_worker(settings, TURN_QUEUES, "turns", log_dir)
    yield process
    process.stop()


@pytest.fixture
def gates(redis_url: str) -> Iterator[Callable[[str], None]]:
    """Opens a gate ``test.turn`` waits at."""
    client = redis.Redis.from_url(redis_url)

    def open_gate(gate: str) -> None:
        client.set(GATE_KEY.format(gate), 1, ex=300)

    yield open_gate
    client.close()


def submit(
    client: httpx.Client, capability: str, payload: dict[str, Any], session_id: str, **more: Any
) -> str:
    envelope = {"capability": capability, "payload": payload, "session_id": session_id, **more}
    answer = client.post("/tasks", json=envelope)
    assert answer.status_code == 202, answer.text
    task_id: str = answer.json()["task_id"]
    return task_id


def rows_by_turn(engine: Engine, task_ids: list[str]) -> list[Any]:
    """The tasks' rows, in their session's order."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(tasks_table)
                .where(tasks_table.c.id.in_(task_ids))
                .order_by(tasks_table.c.session_turn)
            )
        )


def assert_one_at_a_time(rows: list[Any]) -> None:
    """Each turn that ran started after the one before it had finished."""
    ran = [r for r in rows if r.started_at is not None]
    for before, after in itertools.pairwise(ran):
        assert after.started_at >= before.finished_at, (before.session_turn, after.session_turn)


def session_of(client: httpx.Client, session_id: str) -> dict[str, Any]:
    found: dict[str, Any] = client.get(f"/sessions/{session_id}").json()
    return found


def said_by_user(session: dict[str, Any]) -> list[str]:
    return [m["text"] for m in session["state"].get("history", []) if m["role"] == "user"]


def assert_twenty_turns_run_in_order(
    api: ServedApp, token: str, client: httpx.Client, engine: Engine
) -> list[Any]:
    """Given a session, when 20 chat.reply turns are submitted at once, expect each to run
    after the one before it finished, in the order they were accepted, each seeing what the
    one before wrote; returns their rows."""
    session_id = new_session(client)
    texts = [f"message {i}" for i in range(20)]
    envelopes: list[dict[str, object]] = [
        {"capability": "chat.reply", "payload": {"text": t}, "session_id": session_id}
        for t in texts
    ]
    answers = asyncio.run(submit_many(api, token, envelopes, concurrency=20))
    assert [a.status_code for a in answers] == [202] * 20, [a.text for a in answers]
    ids = [a.json()["task_id"] for a in answers]
    done = {i: wait_for_task(client, i, FINAL, timeout_s=90) for i in ids}
    assert {d["status"] for d in done.values()} == {"succeeded"}, done
    rows = rows_by_turn(engine, ids)
    assert [r.session_turn for r in rows] == list(range(1, 21))
    # expect the history in turn order, every message once, at one revision per turn
    session = session_of(client, session_id)
    assert session["revision"] == 21
    assert said_by_user(session) == [r.payload["text"] for r in rows]
    assert sorted(said_by_user(session)) == sorted(texts)
    for row in rows:
        result: Any = done[str(row.id)]["result"]
        assert result["turn"] == row.session_turn
        if row.session_turn > 1:  # it saw the turn before it
            assert result["reply"].endswith(
                f"(before that: {rows[row.session_turn - 2].payload['text']})"
            )
    assert_one_at_a_time(rows)
    # and each revision kept names the turn that wrote it
    kept = client.get(f"/sessions/{session_id}/revisions", params={"limit": 20}).json()
    assert [r["task_id"] for r in reversed(kept["revisions"])] == [str(r.id) for r in rows]
    return rows


def test_twenty_turns_submitted_at_once_run_in_the_order_accepted(
    api: ServedApp,
    tenant: tuple[str, str],
    client: httpx.Client,
    engine: Engine,
    turn_worker: CeleryProcess,
) -> None:
    assert_twenty_turns_run_in_order(api, tenant[1], client, engine)


def test_two_workers_serving_one_session_keep_its_order(
    api: ServedApp,
    tenant: tuple[str, str],
    client: httpx.Client,
    engine: Engine,
    settings: Settings,
    log_dir: Path,
    turn_worker: CeleryProcess,
) -> None:
    # given a second worker on the same queues, on the threads pool (claims in groups)
    second = start_worker(
        settings, TURN_QUEUES, "turns-threads", log_dir, concurrency=8, pool="threads"
    )
    try:
        rows = assert_twenty_turns_run_in_order(api, tenant[1], client, engine)
    finally:
        second.stop()
    # expect both to have served the session
    assert len({r.instance for r in rows}) == 2, {r.instance for r in rows}


def test_a_turn_whose_deadline_passes_while_it_waits_ends_expired_and_the_next_runs(
    client: httpx.Client,
    engine: Engine,
    turn_worker: CeleryProcess,
    system_beat: CeleryProcess,
    gates: Callable[[str], None],
) -> None:
    # given a turn holding the line, then one with a short deadline, then another
    session_id = new_session(client)
    gate = secrets.token_hex(4)
    first = submit(client, "test.turn", {"gate": gate, "text": "one"}, session_id)
    wait_for_task(client, first, {"running"})
    late = submit(client, "chat.reply", {"text": "too late"}, session_id, deadline_ms=500)
    last = submit(client, "chat.reply", {"text": "three"}, session_id)
    # when the deadline passes while it waits, expect it expired, the first still running
    expired = wait_for_task(client, late, FINAL)
    assert expired["status"] == "expired"
    assert expired["error"]["code"] == "deadline_exceeded"  # type: ignore[index]
    assert client.get(f"/tasks/{first}").json()["status"] == "running"
    # and once the first is done, expect the last to run, after it
    gates(gate)
    assert wait_for_task(client, first, FINAL)["status"] == "succeeded"
    assert wait_for_task(client, last, FINAL)["status"] == "succeeded"
    session = session_of(client, session_id)
    assert session["state"]["log"] == ["one"]
    assert said_by_user(session) == ["three"]
    assert_one_at_a_time(rows_by_turn(engine, [first, last]))


def test_a_first_turn_that_expires_waiting_for_an_agent_lets_the_next_run(
    client: httpx.Client, turn_worker: CeleryProcess, system_beat: CeleryProcess
) -> None:
    # given a first turn no agent serves, with a deadline, and a second behind it
    session_id = new_session(client)
    nobody = {"queue_if_unavailable": True, "deadline_ms": 1000}
    first = submit(client, "test.nobody", {}, session_id, **nobody)
    second = submit(client, "chat.reply", {"text": "hello"}, session_id)
    # expect the first expired (by the sweeper) and the second run after it
    assert wait_for_task(client, first, FINAL)["status"] == "expired"
    done = wait_for_task(client, second, FINAL)
    assert done["status"] == "succeeded"
    assert done["result"]["turn"] == 1  # type: ignore[index]


def test_the_sweeper_publishes_a_waiting_turn_whose_release_was_lost(
    client: httpx.Client,
    engine: Engine,
    turn_worker: CeleryProcess,
    system_beat: CeleryProcess,
    gates: Callable[[str], None],
) -> None:
    # given a running turn and a second one whose message was dropped while it waited
    session_id = new_session(client)
    gate = secrets.token_hex(4)
    first = submit(client, "test.turn", {"gate": gate}, session_id)
    wait_for_task(client, first, {"running"})
    second = submit(client, "chat.reply", {"text": "after"}, session_id)
    eventually(
        lambda: f"task {second} waiting for its turn" in turn_worker.output(),
        "the second turn's message to be dropped",
    )
    # when the first ends without releasing it (its worker died between commit and publish)
    with engine.begin() as conn:
        conn.execute(
            update(tasks_table)
            .where(tasks_table.c.id == first)
            .values(status="succeeded", finished_at=func.now())
        )
    gates(gate)  # its handler stops; its late result is not taken
    # expect the sweeper to publish the second again, and it runs
    done = wait_for_task(client, second, FINAL)
    assert done["status"] == "succeeded"
    assert client.get(f"/tasks/{first}").json()["status"] == "succeeded"


def test_a_failed_and_a_cancelled_turn_let_the_next_go(
    client: httpx.Client, engine: Engine, turn_worker: CeleryProcess
) -> None:
    # given a turn that fails, one that runs until cancelled, then two waiting
    session_id = new_session(client)
    failing = submit(client, "test.turn", {"fail": "nope"}, session_id)
    held = submit(client, "test.turn", {"gate": secrets.token_hex(4), "text": "held"}, session_id)
    third = submit(client, "chat.reply", {"text": "three"}, session_id)
    fourth = submit(client, "test.turn", {"text": "four"}, session_id)
    assert wait_for_task(client, failing, FINAL)["status"] == "failed"
    wait_for_task(client, held, {"running"})
    # when the waiting fourth and then the running second are cancelled
    assert client.post(f"/tasks/{fourth}/cancel").json()["status"] == "cancelled"
    assert client.get(f"/tasks/{third}").json()["status"] == "queued"
    assert client.post(f"/tasks/{held}/cancel").json()["status"] == "cancelled"
    # expect the third to run, after the cancelled one, and nothing of theirs in the session
    assert wait_for_task(client, third, FINAL)["status"] == "succeeded"
    session = session_of(client, session_id)
    assert said_by_user(session) == ["three"]
    assert "log" not in session["state"]  # the cancelled agent's write was refused
    assert session["revision"] == 2
    rows = rows_by_turn(engine, [failing, held, third, fourth])
    assert [r.status for r in rows] == ["failed", "cancelled", "succeeded", "cancelled"]
    assert_one_at_a_time(rows)


def test_a_deleted_session_fails_its_turns(
    client: httpx.Client, turn_worker: CeleryProcess, gates: Callable[[str], None]
) -> None:
    session_id = new_session(client)
    gate = secrets.token_hex(4)
    first = submit(client, "test.turn", {"gate": gate, "text": "one"}, session_id)
    wait_for_task(client, first, {"running"})
    second = submit(client, "chat.reply", {"text": "two"}, session_id)
    assert client.delete(f"/sessions/{session_id}").status_code == 204
    gates(gate)
    for task_id in (first, second):
        done = wait_for_task(client, task_id, FINAL)
        assert done["status"] == "failed"
        assert done["error"]["code"] == "session_not_found"  # type: ignore[index]


# -- ctx.session ----------------------------------------------------------------------------


def test_ctx_session_is_none_without_a_session_and_read_at_the_claim_with_one(
    client: httpx.Client,
) -> None:
    plain = client.post("/tasks", json={"capability": "test.context", "payload": {}})
    assert wait_for_task(client, plain.json()["task_id"], FINAL)["result"]["session"] is None  # type: ignore[index]
    session_id = new_session(client)
    client.put(f"/sessions/{session_id}", json={"state": {"a": 1}}, headers={"If-Match": '"1"'})
    with_one = submit(client, "test.context", {}, session_id)
    assert wait_for_task(client, with_one, FINAL)["result"]["session"] == 2  # type: ignore[index]


@pytest.mark.parametrize("capability", ["test.turn", "test.turn-async"])
def test_an_update_at_a_revision_someone_moved_past_raises_session_conflict(
    client: httpx.Client,
    turn_worker: CeleryProcess,
    gates: Callable[[str], None],
    capability: str,
) -> None:
    # given a turn that read revision 1 and waits
    session_id = new_session(client, state={"log": []})
    gate = secrets.token_hex(4)
    payload = {"gate": gate, "text": "mine", "write": "update"}
    task_id = submit(client, capability, payload, session_id)
    wait_for_task(client, task_id, {"running"})
    # when the API writes revision 2 meanwhile and the turn then updates
    path = f"/sessions/{session_id}"
    assert client.put(
        path, json={"state": {"log": ["api"]}}, headers={"If-Match": '"1"'}
    ).is_success
    gates(gate)
    # expect SessionConflict naming revision 2, and the API's write kept
    done = wait_for_task(client, task_id, FINAL)
    assert done["status"] == "succeeded", done
    assert done["result"]["read_revision"] == 1  # type: ignore[index]
    assert done["result"]["conflict"] == 2  # type: ignore[index]
    assert session_of(client, session_id)["state"] == {"log": ["api"]}
    assert session_of(client, session_id)["revision"] == 2


@pytest.mark.parametrize("capability", ["test.turn", "test.turn-async"])
def test_mutate_reads_again_after_a_conflict_and_writes_on_top(
    client: httpx.Client,
    turn_worker: CeleryProcess,
    gates: Callable[[str], None],
    capability: str,
) -> None:
    session_id = new_session(client, state={"log": []})
    gate = secrets.token_hex(4)
    task_id = submit(client, capability, {"gate": gate, "text": "mine"}, session_id)
    wait_for_task(client, task_id, {"running"})
    path = f"/sessions/{session_id}"
    assert client.put(
        path, json={"state": {"log": ["api"]}}, headers={"If-Match": '"1"'}
    ).is_success
    gates(gate)
    done = wait_for_task(client, task_id, FINAL)
    assert done["status"] == "succeeded", done
    assert done["result"]["revision"] == 3  # type: ignore[index]
    session = session_of(client, session_id)
    assert (session["revision"], session["state"]) == (3, {"log": ["api", "mine"]})
    kept = client.get(f"{path}/revisions", params={"limit": 1}).json()["revisions"]
    assert kept[0]["task_id"] == task_id


# -- a long session's claims and releases ----------------------------------------------------


FINISHED_TURNS = text(
    "INSERT INTO tasks (id, tenant, capability, queue, status, payload, payload_digest,"
    " payload_size, trace_id, session_id, session_turn, result_ttl_s, finished_at, expires_at)"
    " SELECT gen_random_uuid(), CAST(:tenant AS text), 'chat.reply', 'chat.reply', 'succeeded',"
    " '{}', 'd', 2, 'trace', CAST(:session AS text), turn, 600, now(), now() + interval '1 hour'"
    " FROM generate_series(1, CAST(:turns AS integer)) AS turn"
)


def explained(engine: Engine, options: str, statement: Any) -> list[Any]:
    """``EXPLAIN (options)`` of ``statement`` with its values inlined: the rows it answers."""
    sql = statement.compile(dialect=engine.dialect, compile_kwargs={"literal_binds": True})
    with engine.connect() as conn:
        return [r[0] for r in conn.exec_driver_sql(f"EXPLAIN ({options}) {sql}")]


def plan_of(engine: Engine, statement: Any) -> str:
    """The plan of ``statement`` (no ANALYZE: nothing runs)."""
    return "\n".join(explained(engine, "COSTS OFF", statement))


def test_a_turns_claim_and_release_read_only_the_sessions_unfinished_turns(
    engine: Engine,
) -> None:
    """With every turn indexed, a claim's ``IS_DUE`` and a release's ``_HEAD`` read each
    finished turn of the session and filtered it out: ~10 ms a statement at 50,000 turns."""
    # given a session of 5,000 finished turns and a queued one after them
    session_id, tenant = f"sess_{secrets.token_hex(6)}", f"t-{secrets.token_hex(4)}"
    with engine.begin() as conn:
        conn.execute(FINISHED_TURNS, {"tenant": tenant, "session": session_id, "turns": 5_000})
    head = a_task_row(engine, tenant=tenant, capability="chat.reply", turn=(session_id, 5_001))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("ANALYZE tasks")
    # when a claim asks whether its turn is due, and a release asks for the session's head
    claim = select(tasks_table.c.id).where(tasks_table.c.id == head, turns.IS_DUE)
    release = turns._HEAD.params(session=session_id)
    # expect both to probe the index of unfinished turns only
    for statement in (claim, release):
        assert "ix_tasks_session_id_session_turn_unfinished" in plan_of(engine, statement)
    with engine.connect() as conn:
        assert turns.next_due(conn, session_id, 5_000) is not None


# -- how many turns a session may hold unfinished ----------------------------------------------

MAX_UNFINISHED = 3


@pytest.fixture(scope="module")
def capped_api(settings: Settings) -> Iterator[ServedApp]:
    """An API whose sessions hold at most three unfinished turns."""
    capped = settings.model_copy(update={"session_max_unfinished_turns": MAX_UNFINISHED})
    with ServedApp(create_app(capped)) as served:
        yield served


def a2a_send(api: ServedApp, token: str, session_id: str, text: str) -> httpx.Response:
    """A JSON-RPC ``SendMessage`` of ``chat.reply`` in the session (its ``contextId``)."""
    message = {
        "messageId": uuid.uuid4().hex,
        "role": "ROLE_USER",
        "contextId": session_id,
        "parts": [{"text": text}],
        "metadata": {"capability": "chat.reply"},
    }
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": {"message": message, "configuration": {"returnImmediately": True}},
    }
    headers = {"Authorization": f"Bearer {token}", "A2A-Version": "1.0"}
    return httpx.post(f"{api.url}/a2a/jsonrpc", json=body, headers=headers, timeout=30)


def test_a_session_holding_its_most_unfinished_turns_is_refused_another_until_they_finish(
    capped_api: ServedApp,
    make_key: KeyMaker,
    engine: Engine,
    turn_worker: CeleryProcess,
    gates: Callable[[str], None],
) -> None:
    """Waiting turns hold no message in their queue (a worker drops it), so no queue bound
    saw them: a session took turns without end, a row each."""
    tenant, token = make_key()
    with client_for(capped_api, token) as client:
        # given a session holding its most unfinished turns: one running, two waiting on it
        session_id = new_session(client)
        gate = secrets.token_hex(4)
        first = submit(client, "test.turn", {"gate": gate, "text": "one"}, session_id)
        wait_for_task(client, first, {"running"})
        keyed = {t: {"idempotency_key": f"turn-{t}"} for t in ("two", "three")}
        waiting = [submit(client, "chat.reply", {"text": t}, session_id, **keyed[t]) for t in keyed]
        # when one more is submitted, through POST /tasks and through A2A's contextId
        envelope = {"capability": "chat.reply", "payload": {"text": "four"}}
        refused = client.post("/tasks", json={**envelope, "session_id": session_id})
        sent = a2a_send(capped_api, token, session_id, "four")
        # expect 429 session_turns_exceeded with Retry-After, nothing written, no turn taken
        assert refused.status_code == 429, refused.text
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert refused.json()["code"] == "session_turns_exceeded"
        assert int(refused.headers["Retry-After"]) >= 1
        # (A2A has no error for a limit: it is answered as the API answers it)
        assert sent.status_code == 429, sent.text
        assert sent.json()["code"] == "session_turns_exceeded"
        assert int(sent.headers["Retry-After"]) >= 1
        assert count_tasks(engine, tenant) == MAX_UNFINISHED
        assert turns_taken(engine, session_id) == MAX_UNFINISHED
        # and a replay of an accepted turn still answers with its task
        replay = {"capability": "chat.reply", "payload": {"text": "three"}, **keyed["three"]}
        again = client.post("/tasks", json={**replay, "session_id": session_id})
        assert (again.status_code, again.json()["task_id"]) == (202, waiting[1]), again.text
        # when the turns finish, expect them run one at a time, in the order accepted
        gates(gate)
        for task_id in (first, *waiting):
            assert wait_for_task(client, task_id, FINAL)["status"] == "succeeded"
        assert said_by_user(session_of(client, session_id)) == ["two", "three"]
        assert_one_at_a_time(rows_by_turn(engine, [first, *waiting]))
        # and the session takes new turns again
        later = [submit(client, "chat.reply", {"text": t}, session_id) for t in ("four", "five")]
        for task_id in later:
            assert wait_for_task(client, task_id, FINAL)["status"] == "succeeded"
        assert said_by_user(session_of(client, session_id)) == ["two", "three", "four", "five"]


def test_a_waiting_turns_drop_mark_goes_when_the_turn_ends(
    client: httpx.Client,
    redis_url: str,
    turn_worker: CeleryProcess,
    gates: Callable[[str], None],
) -> None:
    """A worker that drops a waiting turn's message marks it for the sweeper
    (``turns.mark_dropped``); the mark stayed a day after the turn had ended, one key for
    every turn that ever waited."""
    marks = redis.Redis.from_url(redis_url)
    try:
        # given two turns waiting on a running one, each message dropped and marked
        session_id = new_session(client)
        gate = secrets.token_hex(4)
        first = submit(client, "test.turn", {"gate": gate}, session_id)
        wait_for_task(client, first, {"running"})
        ran = submit(client, "chat.reply", {"text": "ran"}, session_id)
        cancelled = submit(client, "chat.reply", {"text": "cancelled"}, session_id)
        keys = [turns.DROPPED_KEY.format(t) for t in (ran, cancelled)]
        eventually(lambda: marks.exists(*keys) == 2, "both waiting turns marked as dropped")
        # when one is cancelled as it waits, and the other runs once the first is done
        assert client.post(f"/tasks/{cancelled}/cancel").json()["status"] == "cancelled"
        gates(gate)
        assert wait_for_task(client, ran, FINAL)["status"] == "succeeded"
        # expect neither mark left
        eventually(lambda: marks.exists(*keys), "the marks gone", 10, until=(0).__eq__)
    finally:
        marks.close()


# -- the sweeper's expiry of queued tasks past their deadline ------------------------------------


def test_overdue_queued_tasks_are_shared_out_by_tenant_from_their_own_index(
    own_engine: Engine,
) -> None:
    """The expiry took any 1,000 overdue queued tasks, found by reading every queued one: a
    tenant's parked turns past their deadline filled every sweep, another's waited."""
    # given many finished tasks, a tenant with 30 queued past their deadline long ago, and
    # another with one past it just now (and one not yet)
    with own_engine.begin() as conn:
        conn.execute(FINISHED_TURNS, {"tenant": "t-old", "session": "sess_old", "turns": 5_000})
    now = datetime.now(UTC)
    for minutes in range(30):
        a_task_row(own_engine, tenant="t-hog", deadline_at=now - timedelta(minutes=60 - minutes))
    ours = a_task_row(own_engine, tenant="t-other", deadline_at=now - timedelta(seconds=1))
    a_task_row(own_engine, tenant="t-other", deadline_at=now + timedelta(hours=1))
    with own_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("ANALYZE tasks")
    # when a sweep takes 10 of them
    taken = execution.overdue_queued(own_engine, limit=10)
    # expect ours among them, the hog's no more than its share, the hog's earliest first
    assert ours in taken
    assert 1 < len(taken) <= 10
    with own_engine.connect() as conn:
        hogs = conn.execute(
            select(tasks_table.c.deadline_at)
            .where(tasks_table.c.id.in_(taken), tasks_table.c.tenant == "t-hog")
            .order_by(tasks_table.c.deadline_at)
        ).all()
    assert len(hogs) <= 5
    assert hogs[0].deadline_at == now - timedelta(minutes=60)
    # and the sweep reads the index of queued tasks' deadlines, not every queued task
    plan = plan_of(own_engine, execution.overdue_query(10))
    assert "ix_tasks_queued_tenant_deadline_at" in plan, plan


WAITING_TURNS = text(
    "INSERT INTO tasks (id, tenant, capability, queue, status, payload, payload_digest,"
    " payload_size, trace_id, session_id, session_turn, result_ttl_s, created_at, expires_at)"
    " SELECT gen_random_uuid(), CAST(:tenant AS text), 'echo', 'echo',"
    " CASE WHEN turn = 1 THEN 'running' ELSE 'queued' END, '{}', 'd', 2, 'trace',"
    " 'sess_waiting_' || s, turn, 600, now() - interval '10 minutes' + make_interval(secs => turn),"
    " now() + interval '1 hour'"
    " FROM generate_series(1, CAST(:sessions AS integer)) AS s, generate_series(1, 100) AS turn"
)


def buffers_read(engine: Engine, statement: Any) -> int:
    """The shared buffers ``statement`` touched (hit or read), as EXPLAIN ANALYZE counts them."""
    (document,) = explained(engine, "ANALYZE, BUFFERS, FORMAT JSON", statement)
    plan = document[0]["Plan"]
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def test_the_sweep_reads_each_sessions_first_unfinished_turn_not_every_waiting_one(
    own_engine: Engine,
) -> None:
    """The sweep's search for lost messages read every waiting turn of a (tenant, queue) and
    asked of each whether its turn was due: 0.8 s a sweep for 1,000 sessions of 100 turns."""
    # given 20 sessions, each with a running turn and 99 waiting behind it; a session whose
    # first unfinished turn is queued (its release was lost) with one behind it; and a task
    # outside any session: all accepted ten minutes ago
    with own_engine.begin() as conn:
        conn.execute(WAITING_TURNS, {"tenant": "t-busy", "sessions": 20})
    accepted = timedelta(minutes=10)
    due = a_task_row(own_engine, tenant="t-busy", age=accepted, turn=("sess_lost", 7))
    a_task_row(own_engine, tenant="t-busy", age=accepted, turn=("sess_lost", 8))
    alone = a_task_row(own_engine, tenant="t-busy", age=accepted)
    with own_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE tasks")
    # when the sweep looks for queued tasks whose message may be lost
    found = execution.stale_queued(own_engine, older_than_s=30, limit=100)
    # expect the due turn and the lone task, no turn still waiting
    assert {row["id"] for row in found} == {due, alone}
    # and a read of about a row a session, not of each of the 1,980 waiting turns
    read = buffers_read(own_engine, execution.stale_query(30, 100))
    assert read < 400, read


def test_a_turn_running_past_its_sessions_ttl_holds_the_session_and_starts_its_idle_time_again(
    client: httpx.Client,
    engine: Engine,
    turn_worker: CeleryProcess,
    system_beat: CeleryProcess,
    gates: Callable[[str], None],
) -> None:
    """The session went at its TTL under a turn still running: the turn's write was refused,
    the turn behind it failed, and the janitor deleted the conversation's state."""
    # Given a session kept 2 s idle, a turn that runs until a gate opens, and one behind it
    # that writes nothing
    session_id = new_session(client, ttl_s=2)
    gate, later = secrets.token_hex(4), secrets.token_hex(4)
    first = submit(client, "test.turn", {"gate": gate, "text": "one"}, session_id)
    second = submit(client, "test.turn", {"gate": later}, session_id)
    eventually(lambda: client.get(f"/tasks/{first}").json()["status"] == "running", "running")
    # When the turn runs past the session's expiry (the janitor running every half second)
    with engine.connect() as conn:
        expires_at = conn.execute(
            select(sessions_table.c.expires_at).where(sessions_table.c.id == session_id)
        ).scalar_one()
    eventually(lambda: datetime.now(UTC) > expires_at + timedelta(seconds=1), "past its TTL")
    # Then the session is still there, the turn writes to it, and the next turn runs
    assert client.get(f"/sessions/{session_id}").status_code == 200
    gates(gate)
    assert wait_for_task(client, first, FINAL)["status"] == "succeeded"
    written = datetime.fromisoformat(session_of(client, session_id)["updated_at"])
    eventually(lambda: datetime.now(UTC) > written + timedelta(seconds=2.5), "past its TTL")
    gates(later)
    assert wait_for_task(client, second, FINAL)["status"] == "succeeded"
    session = session_of(client, session_id)
    assert session["state"]["log"] == ["one"]
    # And its idle time starts again when the last turn ends
    ended = datetime.fromisoformat(client.get(f"/tasks/{second}").json()["finished_at"])
    assert datetime.fromisoformat(session["expires_at"]) >= ended + timedelta(seconds=1.5)


def test_a_session_its_turn_held_past_its_ttl_takes_the_next_turn_before_its_release(
    client: httpx.Client, engine: Engine
) -> None:
    """A turn's final write and its session's release are two transactions. Between them, a
    client that polled the turn final and sent the next at once was told the session it had
    held past its TTL was gone (422 ``session_not_found``; ``GET /sessions/{id}`` 404), and a
    moment later it was back: its idle time now counts from its last turn's end."""
    # Given a session kept 60 s idle, held past its expiry by a turn no agent takes (the
    # expiry moved back, not waited for)
    session_id = new_session(client, ttl_s=60)
    nobody = {"queue_if_unavailable": True, "result_ttl_s": 10}
    task_id = uuid.UUID(submit(client, "test.nobody", {}, session_id, **nobody))
    with engine.begin() as conn:
        conn.execute(
            update(sessions_table)
            .where(sessions_table.c.id == session_id)
            .values(expires_at=func.now() - timedelta(seconds=1))
        )
    assert client.get(f"/sessions/{session_id}").status_code == 200  # held by its turn
    # When the turn's final write commits, its release not yet run
    ended = execution.expire_unstarted(engine, within_s=60, batch=1000)
    assert task_id in [row["id"] for row in ended]
    assert client.get(f"/tasks/{task_id}").json()["status"] in FINAL
    # Then the session is there, and takes the next turn
    assert client.get(f"/sessions/{session_id}").status_code == 200
    sent = client.post(
        "/tasks",
        json={"capability": "test.nobody", "payload": {}, "session_id": session_id, **nobody},
    )
    assert sent.status_code == 202, sent.text


def test_a_session_its_last_turn_held_past_its_ttl_outlives_a_purge_before_its_release(
    client: httpx.Client, engine: Engine
) -> None:
    """A turn's final write and its session's release (``turns.ended``, which starts the
    session's idle time again) are two transactions. Between them a session its turn had
    held past its TTL was neither live nor held, and a janitor's purge then deleted it and
    its revisions for good."""
    # Given a session kept 1 s idle, held past that by a turn no agent takes
    session_id = new_session(client, ttl_s=1)
    # (kept 10 s: the run's janitor, if running, ends it only near then, after the test's end)
    nobody = {"queue_if_unavailable": True, "result_ttl_s": 10}
    task_id = uuid.UUID(submit(client, "test.nobody", {}, session_id, **nobody))
    with engine.connect() as conn:
        expires_at = conn.execute(
            select(sessions_table.c.expires_at).where(sessions_table.c.id == session_id)
        ).scalar_one()
    eventually(lambda: datetime.now(UTC) > expires_at + timedelta(seconds=1), "past its TTL")
    assert client.get(f"/sessions/{session_id}").status_code == 200  # held by its turn
    # When the turn's final write commits, and a purge runs before the release
    ended = execution.expire_unstarted(engine, within_s=60, batch=1000)
    assert task_id in [row["id"] for row in ended]
    sessions.purge_expired(engine, batch=1000)
    # Then the session is still there, and its release starts its idle time again
    with engine.begin() as conn:
        turns.ended(conn, session_id)
    assert client.get(f"/sessions/{session_id}").status_code == 200


# -- a turn is applied once ------------------------------------------------------------------


def test_a_turn_that_wrote_its_session_then_failed_retryably_is_not_tried_again(
    client: httpx.Client, turn_worker: CeleryProcess
) -> None:
    """Tried again, the turn read the revision it had written and applied itself to it."""
    session_id = new_session(client)
    task_id = submit(client, "test.turn", {"text": "once", "retry": True}, session_id)
    done = wait_for_task(client, task_id, FINAL)
    assert (done["status"], done["attempts"]) == ("failed", 1), done
    assert done["error"]["code"] == "upstream_busy"
    assert done["error"]["retryable"] is False
    assert session_of(client, session_id)["state"]["log"] == ["once"]
    # a turn that fails so before it writes is still tried again
    again = submit(client, "test.turn", {"retry": True}, session_id)
    retried = wait_for_task(client, again, FINAL)
    assert (retried["status"], retried["attempts"]) == ("succeeded", 2), retried["error"]


def test_a_turn_whose_earlier_attempt_wrote_its_session_is_not_run_again(
    client: httpx.Client, engine: Engine, settings: Settings, turn_worker: CeleryProcess
) -> None:
    """An idempotent turn whose worker died after its write is delivered again: run, it
    applied the turn a second time."""
    session_id = new_session(client)
    # Given a turn of it accepted, whose first attempt wrote revision 2, then was lost
    owner = _tenant_of_session(engine, session_id)
    task_id = a_task_row(
        engine,
        tenant=owner,
        capability="test.turn",
        payload={"text": "again"},  # run again, it would write
        turn=(session_id, 1),
    )
    with engine.begin() as conn:
        conn.execute(
            update(sessions_table).where(sessions_table.c.id == session_id).values(turns=1)
        )
        running = update(tasks_table).where(tasks_table.c.id == task_id)
        conn.execute(running.values(attempts=1, status="running"))
        sessions.compare_and_set(
            conn,
            owner,
            session_id,
            revision=1,
            state={"log": ["first"]},
            task_id=task_id,
            max_bytes=settings.session_max_bytes,
            revisions_kept=settings.session_revisions_kept,
        )
        conn.execute(running.values(status="queued"))  # its worker lost: queued again
    # and the session written through the API since, until the task's revision is let go
    for n in range(settings.session_revisions_kept):
        put = client.put(
            f"/sessions/{session_id}",
            json={"state": {"log": ["first"], "api": n}},
            headers={"If-Match": "*"},
        )
        assert put.status_code == 200, put.text
    # When its message comes again
    dispatcher = Dispatcher(settings)
    try:
        send_run(dispatcher.app, task_id, "test.turn", trace_id=uuid.uuid4().hex, tenant=owner)
        done = wait_for_task(client, str(task_id), FINAL)
    finally:
        dispatcher.close()
    # Then it is not run again: the session holds its one write
    assert (done["status"], done["error"]["code"]) == ("failed", "worker_lost")
    assert session_of(client, session_id)["state"]["log"] == ["first"]


def test_a_turn_on_the_threads_pool_past_its_deadline_writes_nothing(
    client: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    """The threads pool cannot stop a sync handler: its late result was dropped, but its
    session write, made past the deadline, was kept."""
    worker = start_worker(
        settings, "test.turn-threads", "turns-late", log_dir, concurrency=2, pool="threads"
    )
    try:
        session_id = new_session(client)
        late = submit(
            client,
            "test.turn-threads",
            {"text": "late", "sleep_s": 2},
            session_id,
            deadline_ms=1000,
        )
        done = wait_for_task(client, late, FINAL)
    finally:
        worker.stop()
    assert (done["status"], done["error"]["code"]) == ("expired", "timeout")
    assert "log" not in session_of(client, session_id)["state"]
    assert session_of(client, session_id)["revision"] == 1
