"""A task page under load and refusals, in Chromium against the running stack: an agent that
emits fast leaves the page its last outputs only, and a 429 or a 503 is waited out instead of
stopping the page for good."""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Route, expect

from api.app import create_app
from broker.settings import Settings
from tests.integration.conftest import client_for
from tests.integration.console.conftest import Console
from tests.integration.stack import ServedApp, wait_for_task

FINAL = {"succeeded", "failed", "cancelled", "expired"}
SHOWN = 1000  # feed.js's SHOWN: the items a list keeps


def refused(errors: list[str], *statuses: int) -> list[str]:
    """The browser's errors but its own log lines of the refusals the test provoked."""
    return [e for e in errors if not any(f"status of {s}" in e for s in statuses)]


def test_a_task_with_many_outputs_keeps_the_last_thousand_on_its_page(
    console: Console, key: str, api: ServedApp
) -> None:
    # Given a task whose agent emitted 2,500 outputs
    with client_for(api, key) as http:
        task = http.post("/tasks", json={"capability": "test.gen", "payload": {"n": 2500}})
        task_id = task.json()["task_id"]
        wait_for_task(http, task_id, FINAL)

    # When its page is opened
    page = console.page
    console.sign_in(key)
    expect(page.get_by_role("heading", name="Tasks")).to_be_visible()  # signed in
    console.open(f"#/tasks/{task_id}")
    expect(page.locator("#stream-state")).to_have_text("ended")

    # Then Outputs and Timeline hold their last 1,000 items each, and say what they leave out
    expect(page.locator("#outputs > li")).to_have_count(SHOWN)
    expect(page.locator("#timeline > li")).to_have_count(SHOWN)
    assert json.loads(page.locator("#outputs > li").last.inner_text()) == {"i": 2499}
    assert json.loads(page.locator("#outputs > li").first.inner_text()) == {"i": 1500}
    expect(page.locator("#outputs").locator("xpath=preceding-sibling::p[1]")).to_have_text(
        "1,500 earlier outputs not shown (the last 1,000 are)."
    )
    expect(page.locator("#timeline > li").last).to_have_attribute("data-type", "succeeded")
    assert console.errors == []


def test_a_task_page_refused_a_stream_waits_for_a_free_one_and_then_shows_the_outputs(
    console: Console, key: str, api: ServedApp, settings: Settings
) -> None:
    # Given an API that lets a tenant hold one stream open, and the tenant holding it
    limited = settings.model_copy(update={"max_streams_per_tenant": 1})
    with ServedApp(create_app(limited)) as served, client_for(served, key) as http:
        held = http.post("/tasks", json={"capability": "test.sleepy", "payload": {"sleep_s": 20}})
        watched = http.post("/tasks", json={"capability": "test.gen", "payload": {"n": 3}})
        watched_id = watched.json()["task_id"]
        wait_for_task(http, watched_id, FINAL)
        page = console.page
        console.url = served.url
        console.sign_in(key)
        expect(page.get_by_role("heading", name="Tasks")).to_be_visible()  # signed in
        with http.stream("GET", f"/tasks/{held.json()['task_id']}/events") as stream:
            assert stream.status_code == 200

            # When the page of another task opens: its stream is answered 429 too_many_streams
            console.open(f"#/tasks/{watched_id}")
            expect(page.locator("#stream-state")).to_have_text("reconnecting…")
            expect(page.locator("#stream-problem")).to_contain_text("too_many_streams")
            expect(page.locator("#outputs > li")).to_have_count(0)

        # Then once the held stream is closed, the page gets its stream and the outputs
        expect(page.locator("#outputs > li")).to_have_count(3)
        expect(page.locator("#stream-state")).to_have_text("ended")
        expect(page.locator("#stream-problem")).to_be_empty()
        http.post(f"/tasks/{held.json()['task_id']}/cancel")
        page.goto("about:blank")
    assert refused(console.errors, 429) == []


def test_a_first_read_refused_for_the_rate_is_asked_again(
    console: Console, key: str, api: ServedApp, settings: Settings
) -> None:
    # Given an API allowing the tenant 2 requests a second (a burst of 4), and a finished task
    limited = settings.model_copy(update={"request_rate_per_s": 2.0})
    with client_for(api, key) as http:
        task = http.post("/tasks", json={"capability": "test.gen", "payload": {"n": 3}})
        task_id = task.json()["task_id"]
        wait_for_task(http, task_id, FINAL)
    with ServedApp(create_app(limited)) as served:
        page = console.page
        console.url = served.url
        console.open()
        statuses: list[int] = []
        page.on(
            "response",
            lambda r: statuses.append(r.status) if f"/tasks/{task_id}?" in r.url else None,
        )
        # When the tenant spends its burst and at once opens the task's page
        page.evaluate(
            """async ([key, taskId]) => {
                sessionStorage.setItem("agent-reach.api-key", key);
                const auth = { headers: { Authorization: `Bearer ${key}` } };
                for (let i = 0; i < 6; i++) await fetch("tasks?limit=1", auth);
                window.location.hash = `#/tasks/${taskId}`;
            }""",
            [key, task_id],
        )
        # Then its first read, answered 429 rate_limited, is made again and the page fills in
        # (its other requests are refused too, now and then, and waited out the same way)
        expect(page.locator("#stream-state")).to_have_text("ended", timeout=20_000)
        expect(page.locator("#outputs > li")).to_have_count(3)
        expect(page.locator("h1 .badge")).to_have_text("succeeded")
        assert statuses[0] == 429 and 200 in statuses, statuses
        expect(page.get_by_role("alert")).to_have_count(0)
        page.goto("about:blank")
    assert refused(console.errors, 429) == []


@pytest.mark.parametrize("status", [503, 429])
def test_a_first_read_answered_unavailable_is_asked_again(
    console: Console, key: str, api: ServedApp, status: int
) -> None:
    """The first read of the task is answered ``status`` once, by Playwright's interception of
    that one request: a real 503 on demand would need the API's Postgres taken away (the
    real 429 is the test above). Every other request reaches the real API."""
    with client_for(api, key) as http:
        task = http.post("/tasks", json={"capability": "test.gen", "payload": {"n": 3}})
        task_id = task.json()["task_id"]
        wait_for_task(http, task_id, FINAL)
    page = console.page
    answered: list[int] = []

    def once(route: Route) -> None:
        if answered:
            answered.append(200)
            route.continue_()
            return
        answered.append(status)
        problem = {"code": "service_unavailable", "detail": "Postgres is away", "status": status}
        route.fulfill(
            status=status,
            headers={"Retry-After": "1", "Content-Type": "application/problem+json"},
            body=json.dumps(problem),
        )

    page.route(lambda url: url.endswith(f"/tasks/{task_id}?include=payload"), once)
    console.sign_in(key)
    expect(page.get_by_role("heading", name="Tasks")).to_be_visible()  # signed in
    console.open(f"#/tasks/{task_id}")
    expect(page.locator("#stream-state")).to_have_text("ended")
    expect(page.locator("#outputs > li")).to_have_count(3)
    expect(page.get_by_role("alert")).to_have_count(0)
    expect(page.locator("#stream-problem")).to_be_empty()
    assert answered[0] == status and answered.count(200) >= 1, answered
    assert refused(console.errors, status) == []


def test_a_task_page_answered_404_stops_and_says_why(console: Console, key: str) -> None:
    # A 404 answers the same next time: the page stops at once
    console.sign_in(key)
    expect(console.page.get_by_role("heading", name="Tasks")).to_be_visible()  # signed in
    console.open("#/tasks/00000000-0000-4000-8000-000000000000")
    expect(console.page.locator("#stream-state")).to_have_text("stopped")
    expect(console.page.get_by_role("alert").first).to_contain_text("task_not_found")
    assert refused(console.errors, 404) == []


@pytest.mark.parametrize("fragment", ["#/tasks/%E0%A4%A", "#/webhooks/%E0%A4%A"])
def test_a_malformed_escape_in_the_address_says_not_found_not_a_blank_page(
    console: Console, key: str, fragment: str
) -> None:
    """``decodeURIComponent`` threw on it, uncaught: the page stayed blank."""
    console.sign_in(key)
    expect(console.page.get_by_role("heading", name="Tasks")).to_be_visible()  # signed in
    console.open(fragment)
    expect(console.page.get_by_role("alert").first).to_contain_text("not_found")
    assert refused(console.errors, 404) == []


@pytest.mark.parametrize(
    "fragment",
    [
        "#/tasks/{task_id}%2Fevents",
        "#/tasks/..",
        "#/tasks/%2E%2E",
        "#/webhooks/..",
        "#/tasks/.%5C..",
    ],
)
def test_an_id_in_the_address_names_that_id_alone_not_another_route(
    console: Console, key: str, api: ServedApp, fragment: str
) -> None:
    """The server decodes an escaped slash before it routes (``<id>%2Fevents`` opened the
    task's event stream) and the browser resolves ``..`` and ``%2E%2E`` (``GET /`` and
    ``GET /deliveries`` were sent)."""
    with client_for(api, key) as http:
        task_id = http.post("/tasks", json={"capability": "echo", "payload": {}}).json()["task_id"]
    paths: list[str] = []
    console.page.on("request", lambda request: paths.append(urlsplit(request.url).path))
    console.sign_in(key)
    expect(console.page.get_by_role("heading", name="Tasks")).to_be_visible()  # signed in
    paths.clear()
    console.open(fragment.format(task_id=task_id))
    expect(console.page.get_by_role("alert").first).to_contain_text("not_found")
    assert refused(console.errors, 404) == []
    api_paths = [p for p in paths if not p.startswith("/console")]
    assert api_paths, "the page asked the API nothing"
    assert f"/tasks/{task_id}/events" not in api_paths
    assert all(p.startswith(("/tasks/", "/webhooks/")) for p in api_paths), api_paths
