"""Every malformed request answers a 4xx problem+json with a stable code and writes nothing."""

from __future__ import annotations

import json

import httpx
import pytest
from sqlalchemy import Engine

from api.app import create_app
from broker.settings import Settings
from tests.integration.conftest import count_tasks
from tests.integration.stack import ServedApp

OK = {"capability": "echo", "payload": {"a": 1}}


def nested(depth: int) -> str:
    return '{"capability": "echo", "payload": {"x": ' + "[" * depth + "]" * depth + "}}"


CASES: list[tuple[str, bytes | str, int, str]] = [
    ("missing payload", json.dumps({"capability": "echo"}), 422, "envelope_invalid"),
    ("missing capability", json.dumps({"payload": {}}), 422, "envelope_invalid"),
    (
        "payload not an object",
        json.dumps({"capability": "echo", "payload": [1]}),
        422,
        "envelope_invalid",
    ),
    (
        "bad capability name",
        json.dumps({"capability": "Invoice..x", "payload": {}}),
        422,
        "envelope_invalid",
    ),
    (
        "reserved capability",
        json.dumps({"capability": "reach.webhooks", "payload": {}}),
        422,
        "envelope_invalid",
    ),
    ("unknown top-level field", json.dumps({**OK, "destination": "x"}), 422, "envelope_invalid"),
    ("malformed target", json.dumps({**OK, "target": "x"}), 422, "target_invalid"),
    ("deadline not positive", json.dumps({**OK, "deadline_ms": 0}), 422, "envelope_invalid"),
    ("body is a list", "[1, 2]", 422, "envelope_invalid"),
    ("not JSON", "{capability: echo", 400, "invalid_json"),
    ("not UTF-8", b'{"capability": "echo", "payload": {"a": "\xff"}}', 400, "invalid_json"),
    ("empty body", "", 400, "invalid_json"),
    ("deep nesting, 40", nested(40), 400, "json_too_deep"),
    ("deep nesting, 5000", nested(5000), 400, "json_too_deep"),
    (
        "NUL in a string",
        '{"capability": "echo", "payload": {"a": "x\\u0000y"}}',
        400,
        "invalid_string",
    ),
    ("NUL in a key", '{"capability": "echo", "payload": {"a\\u0000": 1}}', 400, "invalid_string"),
    (
        "lone surrogate",
        '{"capability": "echo", "payload": {"a": "\\ud800"}}',
        400,
        "invalid_string",
    ),
    (
        "huge integer",
        '{"capability": "echo", "payload": {"a": ' + "9" * 5000 + "}}",
        400,
        "number_out_of_range",
    ),
    (
        "float overflow",
        '{"capability": "echo", "payload": {"a": 1e999}}',
        400,
        "number_out_of_range",
    ),
    ("NaN", '{"capability": "echo", "payload": {"a": NaN}}', 400, "number_out_of_range"),
    ("reply mode unknown", json.dumps({**OK, "reply_mode": "later"}), 422, "envelope_invalid"),
    (
        "callback to the metadata address",
        json.dumps({**OK, "callback": {"url": "http://169.254.169.254/latest/meta-data"}}),
        422,
        "url_not_allowed",
    ),
    (
        "callback event unknown",
        json.dumps({**OK, "callback": {"url": "https://e.x/h", "events": ["task.done"]}}),
        422,
        "envelope_invalid",
    ),
]


@pytest.mark.parametrize(
    ("body", "status", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_envelope_gets_its_code_and_writes_nothing(
    client: httpx.Client,
    engine: Engine,
    tenant: tuple[str, str],
    body: bytes | str,
    status: int,
    code: str,
) -> None:
    response = client.post("/tasks", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["code"] == code
    assert problem["status"] == status
    assert problem["trace_id"] == response.headers["x-trace-id"]
    assert count_tasks(engine, tenant[0]) == 0


def test_envelope_errors_name_the_fields(client: httpx.Client) -> None:
    response = client.post("/tasks", json={"capability": "echo", "priority": 99, "extra": 1})
    fields = {e["field"] for e in response.json()["errors"]}
    assert fields == {"payload", "priority", "extra"}


def test_whole_numbers_written_with_a_point_or_an_exponent_are_integers(
    client: httpx.Client,
) -> None:
    # Given integer fields sent as JSON numbers with a point or an exponent (json.dumps(60.0)
    # writes one; JSON Schema's integer counts them)
    body = (
        b'{"capability": "echo", "payload": {}, "priority": 1.0, "max_attempts": 2.0,'
        b' "deadline_ms": 6e4, "result_ttl_s": 3600.0}'
    )
    # When a task and a session are asked for with them
    task = client.post("/tasks", content=body, headers={"content-type": "application/json"})
    session = client.post("/sessions", content=b'{"ttl_s": 60.0}')
    # Then both are accepted as the integers they are (422 envelope_invalid and
    # session_invalid before)
    assert task.status_code == 202, task.text
    assert session.status_code == 201, session.text
    # and a fraction, a string or true still is no integer
    for bad in (b'"priority": 1.5', b'"priority": "1"', b'"priority": true'):
        refused = client.post(
            "/tasks",
            content=b'{"capability": "echo", "payload": {}, ' + bad + b"}",
            headers={"content-type": "application/json"},
        )
        assert (refused.status_code, refused.json()["code"]) == (422, "envelope_invalid"), bad


def test_a_body_over_the_limit_is_413_before_it_is_read(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str]
) -> None:
    # The test settings allow 64 KiB of payload (plus 64 KiB of envelope).
    big = json.dumps({"capability": "echo", "payload": {"blob": "x" * 200_000}})
    response = client.post("/tasks", content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["code"] == "body_too_large"
    assert count_tasks(engine, tenant[0]) == 0


def test_a_chunked_body_over_the_limit_is_413(client: httpx.Client) -> None:
    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"capability": "echo", "payload": {"blob": "'
        for _ in range(40):
            yield b"x" * 8192
        yield b'"}}'

    response = client.post("/tasks", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["code"] == "body_too_large"


def test_a_payload_over_its_limit_is_413(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str]
) -> None:
    # Within the body limit, over the payload limit of 64 KiB.
    response = client.post("/tasks", json={"capability": "echo", "payload": {"blob": "x" * 80_000}})
    assert response.status_code == 413
    assert response.json()["code"] == "payload_too_large"
    assert count_tasks(engine, tenant[0]) == 0


def test_metadata_over_its_limit_is_413(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str]
) -> None:
    """A task's metadata goes out with its final event, kept in Redis as long as its result:
    a tenant's cancelled submits put 52 MiB there in 6 s with 120 KiB of metadata each."""
    big = {"note": "x" * (16 * 1024)}
    envelope = {"capability": "echo", "payload": {}, "metadata": big}
    response = client.post("/tasks", json=envelope)
    assert (response.status_code, response.json()["code"]) == (413, "metadata_too_large")
    assert count_tasks(engine, tenant[0]) == 0
    # within it, accepted
    small = {**envelope, "metadata": {"note": "x" * 1000}}
    assert client.post("/tasks", json=small).status_code == 202


def test_a_form_body_is_415(client: httpx.Client) -> None:
    response = client.post(
        "/tasks",
        content="capability=echo",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 415
    assert response.json()["code"] == "unsupported_media_type"


def test_json_named_in_any_case_is_json(client: httpx.Client) -> None:
    """Media type names are case-insensitive (RFC 9110): ``Application/JSON`` was 415."""
    body = b'{"capability": "echo", "payload": {}}'
    for content_type in ("Application/JSON", "APPLICATION/VND.API+JSON; charset=utf-8"):
        response = client.post("/tasks", content=body, headers={"content-type": content_type})
        assert response.status_code == 202, (content_type, response.text)


def test_a_bad_list_parameter_is_422_not_500(client: httpx.Client) -> None:
    for query in ("status=done", "limit=0", "limit=abc", "capability=Bad..Name"):
        response = client.get(f"/tasks?{query}")
        assert response.status_code == 422, query
        assert response.json()["code"] == "invalid_parameter"
    response = client.get("/tasks?cursor=%%%")
    assert response.status_code == 400
    assert response.json()["code"] == "invalid_cursor"


def test_unknown_routes_and_methods_are_problems_too(client: httpx.Client) -> None:
    missing = client.get("/nothing-here")
    assert missing.status_code == 404
    assert missing.json()["code"] == "route_not_found"
    wrong = client.delete("/tasks")
    assert wrong.status_code == 405
    assert wrong.json()["code"] == "method_not_allowed"


def test_no_response_but_a_page_may_be_read_as_anything_else_or_run_anything(
    client: httpx.Client, api: ServedApp
) -> None:
    """A JSON body shaped by a tenant's payload (an echoed result, a problem naming a bad
    field) must never be sniffed into HTML or script by a browser, and could run nothing if
    it were. The console page brings its own policy, which is kept."""
    accepted = client.post("/tasks", json={"capability": "echo", "payload": {"x": "<b>"}})
    refused = client.post("/tasks", json={"capability": "<script>", "payload": {}})
    anonymous = httpx.get(f"{api.url}/tasks")
    missing = client.get("/nowhere")
    script = httpx.get(f"{api.url}/console/static/app.js")
    page = httpx.get(f"{api.url}/console")
    # the same page among the console's files: with the same policy, never framed
    same_page = httpx.get(f"{api.url}/console/static/index.html")
    for response in (accepted, refused, anonymous, missing, script, page, same_page):
        assert response.headers["x-content-type-options"] == "nosniff", response.url
    for response in (accepted, refused, anonymous, missing, script):
        policy = response.headers["content-security-policy"]
        assert policy == "default-src 'none'; frame-ancestors 'none'", response.url
    assert (refused.status_code, anonymous.status_code, missing.status_code) == (422, 401, 404)
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert same_page.status_code == 200
    assert same_page.headers["content-security-policy"] == page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]


@pytest.mark.parametrize("docs", [True, False])
def test_the_api_docs_pages_can_be_turned_off_and_the_openapi_document_stays(
    settings: Settings, docs: bool
) -> None:
    """They run jsDelivr's scripts on this origin; an operator may not want that."""
    app = create_app(settings.model_copy(update={"api_docs": docs}))
    with ServedApp(app) as served, httpx.Client(base_url=served.url) as http:
        pages = [http.get("/docs"), http.get("/redoc")]
        document = http.get("/openapi.json")

    assert [page.status_code for page in pages] == ([200, 200] if docs else [404, 404])
    assert document.status_code == 200 and document.json()["info"]["title"] == "Agent-Reach"
    if docs:  # and no other site frames them (they could read the console's key)
        assert [p.headers["content-security-policy"] for p in pages] == [
            "frame-ancestors 'none'"
        ] * 2


def test_an_unexpected_error_is_a_500_problem_with_the_headers_and_count_of_any_response(
    settings: Settings,
) -> None:
    """A bug answers 500 ``internal_error`` that names no detail of it, and is traced,
    hardened and counted like every other response, not sent bare past the middleware."""
    app = create_app(settings.model_copy(update={"metrics_public": True}))

    async def broken() -> None:
        raise RuntimeError("secret detail")

    app.add_api_route("/broken", broken)
    with ServedApp(app) as served, httpx.Client(base_url=served.url) as http:
        given_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        response = http.get("/broken", headers={"X-Trace-Id": given_trace})
        # and the connection stays usable: the next request on it is answered
        metrics = http.get("/metrics").text
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["code"] == "internal_error"
    assert "secret detail" not in response.text
    assert response.headers["x-trace-id"] == response.json()["trace_id"] == given_trace
    assert response.headers["x-content-type-options"] == "nosniff"
    assert (
        response.headers["content-security-policy"] == "default-src 'none'; frame-ancestors 'none'"
    )
    counted = 'route="/broken",status="500"'
    assert any(counted in line and not line.endswith(" 0.0") for line in metrics.splitlines())


UNNAMEABLE = ["ses_a%00b", "ses_" + "x" * 200]  # a NUL, longer than any id


@pytest.mark.parametrize("session_id", UNNAMEABLE)
def test_a_session_id_no_session_can_have_is_404_for_every_route(
    client: httpx.Client, session_id: str
) -> None:
    """A NUL reached Postgres: 422 ``invalid_data``, as if the id were the caller's to fix."""
    answers = {
        "get": client.get(f"/sessions/{session_id}"),
        "put": client.put(
            f"/sessions/{session_id}", json={"state": {}}, headers={"If-Match": '"1"'}
        ),
        "patch": client.patch(
            f"/sessions/{session_id}",
            content=b'{"state": {"a": 1}}',
            headers={"If-Match": '"1"', "Content-Type": "application/merge-patch+json"},
        ),
        "delete": client.delete(f"/sessions/{session_id}"),
        "revisions": client.get(f"/sessions/{session_id}/revisions"),
    }
    assert_each_404(answers, "session_not_found")


@pytest.mark.parametrize("agent_id", ["a%00b", "x" * 65, "Upper"])
def test_an_agent_id_no_agent_can_have_is_404(ops: httpx.Client, agent_id: str) -> None:
    answers = {
        "get": ops.get(f"/agents/{agent_id}"),
        "delete": ops.delete(f"/agents/{agent_id}"),
        "drain": ops.post(f"/agents/{agent_id}/instances/i1/drain"),
        "revoke": ops.post(f"/agents/{agent_id}/versions/1.0.0/revoke"),
        "channel": ops.delete(f"/agents/{agent_id}/channels/stable"),
    }
    assert_each_404(answers, "agent_not_found")


@pytest.mark.parametrize("name", ["a%00b", "1.0.0%00", "x" * 300])
def test_a_version_channel_or_instance_none_can_have_is_404_before_any_query(
    ops: httpx.Client, name: str
) -> None:
    """Only the agent id was checked: a NUL in the rest reached Postgres (422 invalid_data)."""
    answers = {
        "revoke": ops.post(f"/agents/echo/versions/{name}/revoke"),
        "channel": ops.delete(f"/agents/echo/channels/{name}"),
        "drain": ops.post(f"/agents/echo/instances/{name}/drain"),
    }
    seen = {route: (a.status_code, a.json()["code"]) for route, a in answers.items()}
    assert seen == {
        "revoke": (404, "version_not_found"),
        "channel": (404, "channel_not_found"),
        "drain": (404, "instance_not_found"),
    }


def assert_each_404(answers: dict[str, httpx.Response], code: str) -> None:
    seen = {route: (a.status_code, a.json()["code"]) for route, a in answers.items()}
    assert seen == dict.fromkeys(answers, (404, code))
