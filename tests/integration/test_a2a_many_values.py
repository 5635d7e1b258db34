"""A2A messages and answers of many JSON values, through the running API and a worker.

Protobuf takes a data part through Python value by value: a tenant's task of 750 KB of small
values cost the API's event loop 1.2 s for every GetTask or ListTasks of it, and a message as
large as much to parse. So a message's data part, of any size, reaches the task as the API's
own parse gave it (protobuf would round an integer past 2**53: here it arrives exact), an answer
carries at most ``ANSWER_DATA_VALUES`` values as data parts and the rest as JSON text, and
ListTasks leaves the results out unless asked for them."""

from __future__ import annotations

import json
from typing import Any

import httpx

from broker.facades.a2a import ANSWER_DATA_VALUES, JSON_MEDIA_TYPE
from tests.integration.conftest import KeyMaker
from tests.integration.stack import CeleryProcess, ServedApp
from tests.integration.test_a2a_facade import rpc, send_message_body

# More values than an answer carries as data (two per row, and the row itself), and an
# integer a double does not hold.
EXACT = 2**60 + 1
MANY = {"rows": [[i, -i] for i in range(ANSWER_DATA_VALUES)], "id": EXACT}


def send(api: ServedApp, token: str, payload: Any) -> dict[str, Any]:
    """A blocking ``SendMessage`` to echo: the finished task."""
    answer = rpc(api, token, send_message_body([{"data": payload}])).json()
    assert "error" not in answer, answer["error"]
    task: dict[str, Any] = answer["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_COMPLETED", task["status"]
    return task


def with_payload(api: ServedApp, token: str, task_id: str) -> dict[str, Any]:
    """The task as the HTTP API shows it, its payload included."""
    answer = httpx.get(
        f"{api.url}/tasks/{task_id}",
        params={"include": "payload"},
        headers={"Authorization": f"Bearer {token}"},
    )
    shown: dict[str, Any] = answer.json()
    return shown


def call(api: ServedApp, token: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
    answer = rpc(api, token, {"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    assert "error" not in answer.json(), answer.text
    result: dict[str, Any] = answer.json()["result"]
    return result


def test_a_message_of_many_values_reaches_the_agent_exactly_and_its_result_comes_as_json_text(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    _, token = make_key()
    task = send(api, token, MANY)
    # The payload the agent got, and its result, as the HTTP API shows them: exact
    shown = with_payload(api, token, task["id"])
    assert shown["payload"] == MANY
    assert shown["result"] == MANY
    # and over A2A, a text part of the result's JSON, read back exactly
    (part,) = task["artifacts"][0]["parts"]
    assert part["mediaType"] == JSON_MEDIA_TYPE
    assert json.loads(part["text"]) == MANY
    got = call(api, token, "GetTask", {"id": task["id"]})
    assert json.loads(got["artifacts"][0]["parts"][0]["text"]) == MANY


def test_a_small_data_part_reaches_the_agent_exactly(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    """A part of a few values went through protobuf, where a number is a double: an id of
    2**60 + 1 reached the agent as 2**60, and 10**400 was refused with no code of ours."""
    _, token = make_key()
    for payload in ({"id": EXACT}, {"n": 10**400}):
        shown = with_payload(api, token, send(api, token, payload)["id"])
        assert (shown["payload"], shown["result"]) == (payload, payload)


def test_a_small_result_is_still_a_data_part(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    _, token = make_key()
    task = send(api, token, {"total": 10, "lines": ["a", "b"]})
    assert task["artifacts"][0]["parts"] == [{"data": {"total": 10, "lines": ["a", "b"]}}]


def test_list_tasks_shows_results_only_when_asked_and_within_one_answers_values(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    _, token = make_key()
    small = {"rows": [[i, -i] for i in range(ANSWER_DATA_VALUES // 10)]}  # 1,201 values
    for _ in range(4):
        send(api, token, small)

    plain = call(api, token, "ListTasks", {})
    assert len(plain["tasks"]) == 4
    assert [t.get("artifacts") for t in plain["tasks"]] == [None] * 4

    asked = call(api, token, "ListTasks", {"includeArtifacts": True})
    parts = [t["artifacts"][0]["parts"][0] for t in asked["tasks"]]
    # Three results fit the answer's values as data; the fourth comes as JSON text.
    assert [p.get("data") for p in parts[:3]] == [small] * 3
    assert parts[3]["mediaType"] == JSON_MEDIA_TYPE
    assert json.loads(parts[3]["text"]) == small


def test_a_request_of_too_many_values_besides_its_data_part_is_refused(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    _, token = make_key()
    filler = {"filler": list(range(ANSWER_DATA_VALUES))}
    body = send_message_body([{"data": {"x": 1}}], metadata=filler)
    answer = rpc(api, token, body).json()
    assert answer["error"]["code"] == -32600
    assert answer["error"]["data"]["code"] == "too_many_values"
    rest = httpx.post(
        f"{api.url}/a2a/rest/message:send",
        json={"message": body["params"]["message"]},
        headers={"Authorization": f"Bearer {token}", "A2A-Version": "1.0"},
    )
    assert rest.status_code == 400, rest.text
    assert rest.json()["code"] == "too_many_values"
