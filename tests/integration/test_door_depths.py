"""A payload is held to one depth whichever door brings it: the depth it has in a ``POST
/tasks`` body (``REACH_MAX_JSON_DEPTH`` levels, the payload at the second). Each door measured
it within a body of its own: A2A refused a payload nested 28 deep, which ``POST /tasks``
takes, and MCP took one nested 32 deep, which ``POST /tasks`` refuses (and so does the console,
sending a task's payload again)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from broker.settings import Settings
from tests.integration.conftest import client_for
from tests.integration.stack import CeleryProcess, ServedApp
from tests.integration.test_a2a_facade import A2A_VERSION, rpc, send_message_body
from tests.integration.test_mcp import call


def nested(levels: int) -> dict[str, Any]:
    """An object ``levels`` objects deep, itself the first."""
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def refused_as_too_deep_by_each_door(api: ServedApp, token: str, payload: Any) -> list[bool]:
    """Whether ``POST /tasks``, A2A's two bindings and MCP each refused ``payload`` as too
    deep (else it was accepted: an answer with its task)."""
    with client_for(api, token) as http:
        rest = http.post("/tasks", json={"capability": "echo", "payload": payload})
    assert rest.status_code in (202, 400), rest.text
    body = send_message_body([{"data": payload}], returnImmediately=True)
    json_rpc = rpc(api, token, body).json()
    assert "result" in json_rpc or json_rpc["error"]["code"] == -32600, json_rpc
    a2a_rest = httpx.post(
        f"{api.url}/a2a/rest/message:send",
        json={**body["params"]},
        headers={"Authorization": f"Bearer {token}", **A2A_VERSION},
        timeout=30,
    )
    assert a2a_rest.status_code in (200, 400), a2a_rest.text
    mcp = call(api, token, "echo", payload)
    assert not mcp.is_error or mcp.structured_content is not None, mcp
    return [
        rest.status_code == 400 and rest.json()["code"] == "json_too_deep",
        "error" in json_rpc and json_rpc["error"]["data"] == {"code": "json_too_deep"},
        a2a_rest.status_code == 400 and a2a_rest.json()["code"] == "json_too_deep",
        mcp.is_error and (mcp.structured_content or {})["error"]["code"] == "json_too_deep",
    ]


@pytest.mark.parametrize(("levels", "refused"), [(31, False), (32, True)])
def test_every_door_takes_and_refuses_the_same_payload_depths(
    api: ServedApp,
    tenant: tuple[str, str],
    worker: CeleryProcess,
    settings: Settings,
    levels: int,
    refused: bool,
) -> None:
    # Given a payload as deep as POST /tasks takes (31 of its 32 levels), or one deeper
    assert settings.max_json_depth == 32
    # When each door is given it, each answers alike
    assert refused_as_too_deep_by_each_door(api, tenant[1], nested(levels)) == [refused] * 4
