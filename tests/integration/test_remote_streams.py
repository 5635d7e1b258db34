"""What an ``http`` agent's event stream may carry, through a real bridge to the task's row:
its progress messages are agent text, written to Postgres as they come."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.integration.remote import StreamAgent, events_of, wait_routed
from tests.integration.stack import CeleryProcess, wait_for_task

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("bad", ["\\u0000", "\\ud800"], ids=["nul", "lone-surrogate"])
def test_a_progress_message_postgres_cannot_hold_is_shown_with_a_replacement_character(
    ops: httpx.Client, caller: httpx.Client, bridge: CeleryProcess, bad: str
) -> None:
    """The progress write failed (``DataError``, ``UnicodeEncodeError``) and with it a call
    whose result was fine: the task ended ``agent_error`` at its first attempt."""
    events = (
        b'event: progress\ndata: {"percent": 50, "message": "half' + bad.encode() + b'way"}\n\n'
        b'event: result\ndata: {"ok": true}\n\n'
    )
    name = f"stream-{uuid.uuid4().hex[:6]}"
    card = {"capability": f"test.{name}", "streaming": True, "idempotent": True}
    with StreamAgent(events) as agent:
        body = {"version": "1.0.0", "endpoint": {"protocol": "http", "url": agent.url}}
        assert ops.put(f"/agents/{name}", json={**body, "capabilities": [card]}).status_code == 201
        try:
            wait_routed(ops, name)
            sent = caller.post("/tasks", json={"capability": f"test.{name}", "payload": {}})
            done = wait_for_task(caller, sent.json()["task_id"], {"succeeded", "failed"}, 60)
        finally:
            ops.delete(f"/agents/{name}")
    assert (done["status"], done.get("result")) == ("succeeded", {"ok": True}), done.get("error")
    progress = [data for kind, data in events_of(caller, done["task_id"]) if kind == "progress"]
    assert [p["message"] for p in progress] == ["half\ufffdway"]
