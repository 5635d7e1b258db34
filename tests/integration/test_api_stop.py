"""An API process told to stop (SIGTERM, as Docker and systemd send it) while it holds long
answers: each ends with what its caller needs, and the process exits.

uvicorn waits for every open connection to end. An event stream ended only with its task, so
one of a queued task nobody serves kept the process alive for as long as the task lived (a
day); an MCP call's stream was closed with no answer at all (its task ran, its caller never
learned its id)."""

from __future__ import annotations

import json
import signal
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text

from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, count_tasks
from tests.integration.stack import CeleryProcess
from tests.integration.test_many_processes import ApiProcess

QUEUED = {"capability": "test.nobody", "payload": {}, "queue_if_unavailable": True}
# Long enough to outlast a process stop by far (the test waits for nothing like it).
EXIT_WITHIN_S = 60


@dataclass
class Read:
    """One long answer, read whole in a thread of its own."""

    status: int | None = None
    body: bytes = b""
    error: str | None = None  # how the read failed, None when the answer ended cleanly
    done: threading.Event = field(default_factory=threading.Event)

    def start(self, method: str, url: str, **request: Any) -> Read:
        threading.Thread(target=self._read, args=(method, url), kwargs=request).start()
        return self

    def _read(self, method: str, url: str, **request: Any) -> None:
        try:
            with httpx.stream(method, url, timeout=httpx.Timeout(120, connect=5), **request) as r:
                self.status = r.status_code
                for chunk in r.iter_raw():
                    self.body += chunk
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()


def _sse_data(body: bytes) -> list[Any]:
    return [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stopping_api_ends_its_streams_and_waits_cleanly_and_exits(
    settings: Settings, make_key: KeyMaker, log_dir: Path, engine: Engine, workers: int
) -> None:
    # Given an API holding an event stream of a queued task nobody serves, a sync wait for
    # another, and an A2A stream of a third
    tenant, token = make_key()
    auth = {"Authorization": f"Bearer {token}"}
    api = ApiProcess(settings, log_dir / f"api-stop-{workers}.log", workers=workers).start()
    try:
        task_id = httpx.post(f"{api.url}/tasks", json=QUEUED, headers=auth).json()["task_id"]
        stream = Read().start("GET", f"{api.url}/tasks/{task_id}/events", headers=auth)
        sync = Read().start(
            "POST", f"{api.url}/tasks", headers=auth, json={**QUEUED, "reply_mode": "sync"}
        )
        message = {
            "messageId": str(uuid.uuid4()),
            "role": "ROLE_USER",
            "parts": [{"text": "hi"}],
            "metadata": {"capability": "test.nobody", "queue_if_unavailable": True},
        }
        a2a = Read().start(
            "POST",
            f"{api.url}/a2a/jsonrpc",
            headers={**auth, "A2A-Version": "1.0"},
            json={
                "jsonrpc": "2.0",
                "id": 1,
                "method": "SendStreamingMessage",
                "params": {"message": message},
            },
        )
        eventually(lambda: b"event: status" in stream.body, "the stream's first event")
        eventually(lambda: a2a.body, "the A2A stream's first event")
        eventually(lambda: count_tasks(engine, tenant) == 3, "the sync submit's task")

        # When the API is told to stop
        assert api.process is not None
        api.process.send_signal(signal.SIGTERM)

        # Then it exits, each answer ended whole
        api.process.wait(timeout=EXIT_WITHIN_S)
        for read in (stream, sync, a2a):
            assert read.done.wait(EXIT_WITHIN_S)
            assert read.error is None, read.error
        # the stream's client has what it needs to resume elsewhere: its events' ids
        assert stream.status == 200 and b"id: 1\n" in stream.body
        # the sync wait answered with the task, still queued
        assert sync.status == 202 and json.loads(sync.body)["status"] == "queued"
        assert a2a.status == 200 and _sse_data(a2a.body)[0]["result"]["task"]["id"]
    finally:
        api.stop()


def test_an_mcp_call_waiting_as_the_api_stops_answers_its_task_to_poll(
    settings: Settings, make_key: KeyMaker, log_dir: Path, worker: CeleryProcess, engine: Engine
) -> None:
    # Given an MCP call waiting for its task, which runs for a while
    tenant, token = make_key()
    api = ApiProcess(settings, log_dir / "api-stop-mcp.log").start()
    try:
        call = {
            "jsonrpc": "2.0",
            "id": 7,
            "method": "tools/call",
            "params": {"name": "test.sleepy", "arguments": {"sleep_s": 8}},
        }
        headers = {
            "Authorization": f"Bearer {token}",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": "2025-06-18",
        }
        answer = Read().start("POST", f"{api.url}/mcp", headers=headers, json=call)
        eventually(lambda: _statuses(engine, tenant) == ["running"], "the call's task to run")

        # When the API is told to stop
        assert api.process is not None
        api.process.send_signal(signal.SIGTERM)

        # Then the call answers with its task's id and status, before the process exits
        api.process.wait(timeout=EXIT_WITHIN_S)
        assert answer.done.wait(EXIT_WITHIN_S) and answer.error is None, answer.error
        [response] = _sse_data(answer.body)
        assert response["id"] == 7
        told = response["result"]["structuredContent"]
        assert told["status"] == "running"
        # and its task ends as any task does, whatever became of the API
        eventually(lambda: _statuses(engine, tenant) == ["succeeded"], "the task to succeed")
        assert [told["task_id"]] == _ids(engine, tenant)
    finally:
        api.stop()


def _statuses(engine: Engine, tenant: str) -> list[str]:
    query = text("SELECT status FROM tasks WHERE tenant = :tenant")
    with engine.connect() as conn:
        return [row.status for row in conn.execute(query, {"tenant": tenant})]


def _ids(engine: Engine, tenant: str) -> list[str]:
    query = text("SELECT id FROM tasks WHERE tenant = :tenant")
    with engine.connect() as conn:
        return [str(row.id) for row in conn.execute(query, {"tenant": tenant})]
