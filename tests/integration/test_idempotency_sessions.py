"""An idempotency key names one submit: the same payload in another session is not it."""

from __future__ import annotations

import httpx
from sqlalchemy import Engine

from tests.integration.test_session_turns import new_session, turns_taken


def test_a_key_sent_again_with_another_session_is_refused_and_takes_no_turn(
    client: httpx.Client, engine: Engine
) -> None:
    # Given a task of session A made with a key
    first_session, other_session = new_session(client), new_session(client)
    envelope = {"capability": "echo", "payload": {"text": "hello"}, "idempotency_key": "turn-1"}
    first = client.post("/tasks", json={**envelope, "session_id": first_session})
    assert first.status_code == 202, first.text
    # When the same key and payload come for session B, or for no session
    for session in (other_session, None):
        again = client.post("/tasks", json={**envelope, "session_id": session})
        # Then it is refused as a reused key, saying the session differs (before: session A's
        # task came back as a replay, and B's caller took it for B's turn)
        assert again.status_code == 422, again.text
        assert again.json()["code"] == "idempotency_key_reused"
        assert "session" in again.json()["detail"]
    # And session B has no turn taken, nor a task
    assert turns_taken(engine, other_session) == 0
    listed = client.get("/tasks", params={"session_id": other_session}).json()["tasks"]
    assert listed == []
    # And in session A the same submit is still a replay of its task
    replay = client.post("/tasks", json={**envelope, "session_id": first_session})
    assert replay.status_code == 202, replay.text
    assert replay.json()["task_id"] == first.json()["task_id"]
    assert replay.headers["idempotent-replayed"] == "true"
