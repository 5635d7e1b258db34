"""What waiting on a task reads of Postgres: its status, once an interval for every waiter of
an API process, and never its payload; and what reading one task reads: the columns shown.

Every sync wait, and every quiet stream, read the task's whole row every few seconds: 256
waits on one queued task of a megabyte's payload (idempotent replays let them share it)
decoded that payload 128 times a second on the loop every tenant's requests share."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from sqlalchemy import event

from api.app import create_app
from api.replies import STORE_CHECK_S as POLL_S
from broker.settings import Settings
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import ServedApp
from tests.integration.test_a2a_facade import rpc
from tests.integration.test_mcp import call

MiB = 1024 * 1024
WAIT_S = 5.0
# A capability with a card and no agent: its tasks stay queued.
NOBODY = "test.nobody"


@dataclass(frozen=True)
class Read:
    at: float
    statement: str
    columns: tuple[str, ...]

    @property
    def payload(self) -> bool:
        """Whether Postgres sent back a task's payload."""
        return "payload" in self.columns

    @property
    def status_poll(self) -> bool:
        return self.columns == ("status",) and "FROM tasks" in self.statement


@dataclass
class Reads:
    """Every statement the API ran, with the columns it answered (from the cursor)."""

    seen: list[Read] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        columns = tuple(c[0] for c in cursor.description or ())
        with self.lock:
            self.seen.append(Read(time.monotonic(), statement, columns))

    def since(self, mark: int) -> list[Read]:
        with self.lock:
            return self.seen[mark:]

    def mark(self) -> int:
        with self.lock:
            return len(self.seen)


@pytest.fixture(scope="module")
def watched(settings: Settings) -> Iterator[tuple[ServedApp, Reads]]:
    """An API whose statements are recorded: sync waits of ``WAIT_S``, quiet streams that
    ping (and so spend a quiet spell) every 0.3 s, payloads up to a megabyte."""
    app = create_app(
        settings.model_copy(
            update={"sync_max_wait_s": WAIT_S, "sse_ping_s": 0.3, "max_payload_bytes": MiB}
        )
    )
    reads = Reads()
    event.listen(app.state.services.engine.sync_engine, "after_cursor_execute", reads.record)
    with ServedApp(app) as served:
        yield served, reads


def envelope(**extra: Any) -> dict[str, Any]:
    """A task that stays queued, with a payload of half a megabyte."""
    payload = {"blob": "x" * (MiB // 2)}
    return {"capability": NOBODY, "payload": payload, "queue_if_unavailable": True, **extra}


def queued_task(http: httpx.Client, **extra: Any) -> str:
    accepted = http.post("/tasks", json=envelope(**extra))
    assert accepted.status_code == 202, accepted.text
    task_id: str = accepted.json()["task_id"]
    return task_id


def test_sync_waits_on_one_queued_task_share_a_status_poll_and_never_read_its_payload(
    watched: tuple[ServedApp, Reads], make_key: KeyMaker
) -> None:
    api, reads = watched
    _, token = make_key()
    waiters = 12
    # Given a queued task with a payload of half a megabyte
    with client_for(api, token) as http:
        task_id = queued_task(http, idempotency_key="one-task")
    mark = reads.mark()

    # When 12 sync submits of the same envelope (idempotent replays) wait on it
    async def wait_all() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=waiters)
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(
            base_url=api.url, headers=headers, limits=limits, timeout=60
        ) as http:
            sync = envelope(idempotency_key="one-task", reply_mode="sync")
            return await asyncio.gather(*(http.post("/tasks", json=sync) for _ in range(waiters)))

    started = time.monotonic()
    answers = asyncio.run(wait_all())
    elapsed_s = time.monotonic() - started
    during = reads.since(mark)

    # Then each wait ends with 202 and the task still queued
    assert [a.status_code for a in answers] == [202] * waiters
    assert {a.json()["task_id"] for a in answers} == {task_id}
    assert {a.json()["status"] for a in answers} == {"queued"}
    assert "payload" not in answers[0].json()
    # And Postgres sent the payload to none of the waits, nor to the replays' checks
    assert [r.statement for r in during if r.payload] == []
    # And the waits looked at the task's status, all of them at once: one poll an interval,
    # not one per waiter (12 waits of 5 s, each polling alone, poll 36 times)
    polls = [r for r in during if r.status_poll]
    print(f"{waiters} waits of {elapsed_s:.1f} s: {len(polls)} status polls")
    assert 1 <= len(polls) <= elapsed_s / POLL_S + 1
    assert len(polls) < waiters


def test_quiet_streams_of_one_queued_task_share_a_status_poll_and_never_read_its_payload(
    watched: tuple[ServedApp, Reads], make_key: KeyMaker
) -> None:
    api, reads = watched
    _, token = make_key()
    streams = 8
    with client_for(api, token) as http:
        task_id = queued_task(http)
    mark = reads.mark()

    # When 8 clients stream its events until each has had 20 quiet spells (a ping each):
    # a stream looks at Postgres at its 15th (``EventHub._ask_store``)
    async def one(http: httpx.AsyncClient) -> list[str]:
        frames: list[str] = []
        async with http.stream("GET", f"/tasks/{task_id}/events") as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                frames += [line] if line else []
                if frames.count(": ping") == 20:
                    return frames
        return frames

    async def stream_all() -> list[list[str]]:
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=api.url, headers=headers, timeout=60) as http:
            return await asyncio.gather(*(one(http) for _ in range(streams)))

    started = time.monotonic()
    seen = asyncio.run(stream_all())
    elapsed_s = time.monotonic() - started
    during = reads.since(mark)

    # Then every stream showed the queued status and stayed open, pinging
    assert all(s.count(": ping") == 20 and "event: status" in s for s in seen)
    # And no read of the task, opening the streams or looking while they were quiet, sent
    # its payload
    assert [r.statement for r in during if r.payload] == []
    polls = [r for r in during if r.status_poll]
    print(f"{streams} streams of {elapsed_s:.1f} s: {len(polls)} status polls")
    assert 1 <= len(polls) <= elapsed_s / POLL_S + 1
    assert len(polls) < streams


def test_reading_one_task_reads_its_payload_only_when_it_is_shown(
    watched: tuple[ServedApp, Reads], make_key: KeyMaker
) -> None:
    api, reads = watched
    _, token = make_key()
    with client_for(api, token) as http:
        task_id = queued_task(http)

        def payload_reads(since: int) -> int:
            return sum(1 for r in reads.since(since) if r.payload)

        # GET /tasks/{id} shows no payload, and reads none
        mark = reads.mark()
        shown = http.get(f"/tasks/{task_id}")
        assert shown.status_code == 200 and "payload" not in shown.json()
        assert shown.json()["status"] == "queued"
        assert payload_reads(mark) == 0
        # include=payload shows it, read once
        mark = reads.mark()
        asked = http.get(f"/tasks/{task_id}", params={"include": "payload"})
        assert asked.json()["payload"] == envelope()["payload"]
        assert {k: v for k, v in asked.json().items() if k != "payload"} == shown.json()
        assert payload_reads(mark) == 1
        # Opening its events
        mark = reads.mark()
        with http.stream("GET", f"/tasks/{task_id}/events") as response:
            assert response.status_code == 200
            assert next(response.iter_lines()).startswith("id: ")
        assert payload_reads(mark) == 0
        # MCP's reach_get_task and A2A's GetTask
        mark = reads.mark()
        got = call(api, token, "reach_get_task", {"task_id": task_id}).structured_content
        assert got is not None and got["status"] == "queued"
        a2a = rpc(
            api, token, {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": task_id}}
        )
        assert a2a.json()["result"]["id"] == task_id
        assert payload_reads(mark) == 0
        # A cancel, and one answering 409 as the task has ended
        mark = reads.mark()
        assert http.post(f"/tasks/{task_id}/cancel").status_code == 200
        again = http.post(f"/tasks/{task_id}/cancel")
        assert again.status_code == 409 and again.json()["code"] == "task_final"
        assert payload_reads(mark) == 0
        # Another tenant's key finds nothing
        _, stranger = make_key()
        with client_for(api, stranger) as theirs:
            assert theirs.get(f"/tasks/{task_id}").status_code == 404
            assert theirs.get(f"/tasks/{uuid.uuid4()}").status_code == 404


def test_a_replay_with_another_payload_is_refused_without_reading_the_first(
    watched: tuple[ServedApp, Reads], make_key: KeyMaker
) -> None:
    """A submit of a few bytes reusing the key of a task of half a megabyte decoded that
    payload (and the task's whole row) on the loop to compare two digests (an audit,
    2026-12-06: 34-38 ms of the API's CPU each, against 3 for a fresh submit)."""
    api, reads = watched
    _, token = make_key()
    with client_for(api, token) as http:
        task_id = queued_task(http, idempotency_key="big-one")
        mark = reads.mark()
        other = {"capability": NOBODY, "payload": {"small": 1}, "idempotency_key": "big-one"}
        refused = http.post("/tasks", json={**other, "queue_if_unavailable": True})
        assert refused.status_code == 422, refused.text
        assert refused.json()["code"] == "idempotency_key_reused"
        checked = reads.since(mark)
        assert [r.statement for r in checked if r.payload or "result" in r.columns] == []
        # The same envelope again is the first task, read without its payload too
        mark = reads.mark()
        again = http.post("/tasks", json=envelope(idempotency_key="big-one"))
        assert again.status_code == 202 and again.json()["task_id"] == task_id
        assert again.headers["Idempotent-Replayed"] == "true"
        assert [r.statement for r in reads.since(mark) if r.payload] == []
