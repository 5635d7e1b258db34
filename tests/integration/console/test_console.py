"""The console, used as a person would: in Chromium, against the running stack."""

from __future__ import annotations

import re
import secrets

import httpx
from playwright.sync_api import expect
from sqlalchemy import Engine

from broker.tenancy import key_store
from tests.integration.conftest import client_for
from tests.integration.console.conftest import Console, unreachable_agent
from tests.integration.stack import ServedApp, wait_for_task

TEXT = (
    "Brokers route work to agents. Each agent advertises what it can do on a card. "
    "Tasks are kept in Postgres so their history survives restarts. "
    "Streams show the outputs of a task while it runs. "
    "Webhooks tell callers when a task has finished."
)

# Records, at each change of the task page, how many outputs it shows, with the status shown
# beside them and whether a result is shown yet: outputs that arrive one by one leave one
# record each, outputs that arrive together leave one record in all.
WATCH_OUTPUTS = """
window.__outputs = [];
new MutationObserver(() => {
  const list = document.getElementById("outputs");
  const count = list ? list.children.length : 0;
  const last = window.__outputs[window.__outputs.length - 1];
  if (count && (!last || last.count !== count)) {
    window.__outputs.push({
      count,
      status: document.querySelector("h1 .badge")?.dataset.status ?? null,
      result: document.getElementById("task-result") !== null,
    });
  }
}).observe(document, { childList: true, subtree: true });
"""


def test_the_console_is_served_by_the_api_from_the_package(api: ServedApp) -> None:
    with httpx.Client(base_url=api.url) as http:
        page = http.get("/console")
        script = http.get("/console/static/app.js")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert script.status_code == 200
    assert "javascript" in script.headers["content-type"]
    # Nothing from elsewhere: every reference is relative to this origin.
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)


def test_signing_in_with_the_keyboard_shows_the_tasks_with_live_statuses(
    console: Console, key: str, api: ServedApp
) -> None:
    page = console.page
    console.open()
    expect(page.get_by_label("API key")).to_be_focused()
    page.keyboard.type(key)
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", name="Tasks")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('agent-reach.api-key')") == key

    with client_for(api, key) as http:
        task = http.post("/tasks", json={"capability": "test.sleepy", "payload": {"sleep_s": 3}})
    row = page.locator(f"tr[data-task-id='{task.json()['task_id']}']")
    # The list was not reloaded by hand: the row appears, runs and finishes on its own.
    expect(row.locator(".badge")).to_have_text("running", timeout=20_000)
    expect(row.locator(".badge")).to_have_text("succeeded", timeout=20_000)
    assert console.errors == []


def test_a_wrong_key_shows_the_error_and_is_not_kept(console: Console) -> None:
    console.sign_in("rk_not_a_key.nothing")
    expect(console.page.get_by_role("alert")).to_contain_text("not valid")
    expect(console.page.get_by_role("navigation", name="Console")).to_be_hidden()
    assert console.page.evaluate("sessionStorage.getItem('agent-reach.api-key')") is None
    # The browser logs the refused call itself; the page's own code logged nothing.
    assert [e for e in console.errors if "status of 401" not in e] == []


def test_a_task_submitted_from_the_form_runs_and_shows_its_result(
    console: Console, key: str, api: ServedApp
) -> None:
    page = console.page
    console.sign_in(key)
    page.get_by_role("link", name="Submit").click()
    page.get_by_label("Capability").select_option("echo")
    page.get_by_label("Payload (JSON)").fill('{"greeting": "from the console"}')
    page.get_by_role("button", name="Submit").click()

    expect(page).to_have_url(re.compile(r"#/tasks/[0-9a-f-]{36}$"))
    expect(page.locator("h1 .badge")).to_have_text("succeeded")
    expect(page.locator("#task-result")).to_contain_text("from the console")
    task_id = page.url.rsplit("/", 1)[1]
    with client_for(api, key) as http:
        stored = http.get(f"/tasks/{task_id}", params={"include": "payload"}).json()
    assert stored["payload"] == {"greeting": "from the console"}
    assert stored["result"] == {"greeting": "from the console"}
    assert console.errors == []


def test_a_summary_streams_onto_the_task_page_sentence_by_sentence(
    console: Console, key: str, api: ServedApp
) -> None:
    page = console.page
    page.add_init_script(WATCH_OUTPUTS)
    console.sign_in(key)
    console.open("#/submit?capability=text.summarize")
    page.get_by_label("text").fill(TEXT)
    page.get_by_label("max_sentences").fill("3")
    page.get_by_label("delay_s").fill("1")
    page.get_by_role("button", name="Submit").click()

    expect(page.locator("h1 .badge")).to_have_text("succeeded", timeout=30_000)
    expect(page.locator("#outputs li")).to_have_count(3)
    expect(page.locator("#task-progress")).to_have_attribute("value", "100")
    expect(page.locator("#task-progress-label")).to_have_text("100% — sentence 3 of 3")
    task_id = page.url.rsplit("/", 1)[1]
    with client_for(api, key) as http:
        result = http.get(f"/tasks/{task_id}").json()["result"]
    shown = page.locator("#outputs li").all_inner_texts()
    for sentence, line in zip(result["sentences"], shown, strict=True):
        assert sentence in line
    seen = page.evaluate("window.__outputs")
    assert [s["count"] for s in seen] == [1, 2, 3]
    assert all(s["status"] == "running" and not s["result"] for s in seen)
    assert console.errors == []


def test_cancelling_a_running_task_from_its_page(
    console: Console, key: str, api: ServedApp
) -> None:
    with client_for(api, key) as http:
        task_id = http.post(
            "/tasks", json={"capability": "test.sleepy", "payload": {"sleep_s": 30}}
        ).json()["task_id"]
        page = console.page
        console.sign_in(key)
        console.open(f"#/tasks/{task_id}")
        expect(page.locator("h1 .badge")).to_have_text("running")
        page.get_by_role("button", name="Cancel").click()

        expect(page.locator("h1 .badge")).to_have_text("cancelled")
        expect(page.locator("#timeline li[data-type='cancelled']")).to_have_count(1)
        expect(page.get_by_role("button", name="Cancel")).to_have_count(0)
        assert wait_for_task(http, task_id, {"cancelled"})["status"] == "cancelled"
    assert console.errors == []


def test_resubmitting_a_task_runs_it_again_with_the_same_payload(
    console: Console, key: str, api: ServedApp
) -> None:
    with client_for(api, key) as http:
        first = http.post("/tasks", json={"capability": "echo", "payload": {"n": 7}}).json()
        page = console.page
        console.sign_in(key)
        console.open(f"#/tasks/{first['task_id']}")
        expect(page.locator("h1 .badge")).to_have_text("succeeded")
        page.get_by_role("button", name="Re-submit").click()

        expect(page).not_to_have_url(re.compile(first["task_id"]))
        expect(page.locator("h1 .badge")).to_have_text("succeeded")
        second = page.url.rsplit("/", 1)[1]
        again = http.get(f"/tasks/{second}", params={"include": "payload"}).json()
    assert again["capability"] == "echo"
    assert again["payload"] == {"n": 7}
    assert console.errors == []


def test_the_task_list_pages_older_and_newer_and_filters_by_status(
    console: Console, key: str, api: ServedApp
) -> None:
    with client_for(api, key) as http:
        ids = [
            http.post("/tasks", json={"capability": "echo", "payload": {"n": n}}).json()["task_id"]
            for n in range(23)
        ]
        for task_id in ids:
            wait_for_task(http, task_id, {"succeeded"})
    page = console.page
    rows = page.locator("tbody tr[data-task-id]")
    older = page.get_by_role("button", name="Older")
    newer = page.get_by_role("button", name="Newer")
    console.sign_in(key)
    # The newest 20 first, then the 3 older ones, then the newest 20 again
    expect(rows).to_have_count(20)
    assert rows.first.get_attribute("data-task-id") == ids[-1]
    expect(newer).to_be_disabled()
    older.click()
    expect(rows).to_have_count(3)
    assert [r.get_attribute("data-task-id") for r in rows.all()] == ids[2::-1]
    expect(older).to_be_disabled()
    newer.click()
    expect(rows).to_have_count(20)
    expect(newer).to_be_disabled()
    # A status no task has lists none
    page.get_by_label("Status").select_option("failed")
    page.get_by_role("button", name="Filter").click()
    expect(page.get_by_text("No tasks.")).to_be_visible()
    assert console.errors == []


def test_every_page_is_reached_and_used_with_the_keyboard_alone(
    console: Console, key: str, engine: Engine, api: ServedApp
) -> None:
    # Pages as long as a busy registry makes them: 30 capabilities, two links a row
    _, admin = key_store.create_key(engine, "console-keyboard", ["*"], is_admin=True)
    agent_id = f"console-many-{secrets.token_hex(3)}"
    card = unreachable_agent([f"test.{agent_id}.n{n}" for n in range(30)])
    with client_for(api, admin) as ops:
        assert ops.put(f"/agents/{agent_id}", json=card).status_code == 201
        try:
            _walk_the_console_with_keys(console, key)
        finally:
            ops.delete(f"/agents/{agent_id}")


def _walk_the_console_with_keys(console: Console, key: str) -> None:
    page = console.page
    console.sign_in(key)
    expect(page.get_by_role("heading", name="Tasks")).to_be_visible()

    def tab_to(name: str, attribute: str = "textContent", key: str = "Tab") -> None:
        for _ in range(40):
            page.keyboard.press(key)
            if page.evaluate(f"(document.activeElement.{attribute} ?? '').trim()") == name:
                return
        raise AssertionError(f"{key} never reached {name!r}")

    for link, heading in [
        ("Capabilities", "Capabilities"),
        ("Agents", "Agents"),
        ("Webhooks", "Webhooks"),
        ("Sessions", "Sessions"),
        ("Submit", "Submit a task"),
        ("Tasks", "Tasks"),
    ]:
        # A followed link leaves the focus on the page's content (<main>); the navigation
        # is before it, a few Shift+Tabs back however many rows the page lists (forward,
        # 40 Tabs did not get through the whole suite's capabilities in CI)
        tab_to(link, key="Shift+Tab")
        page.keyboard.press("Enter")
        expect(page.get_by_role("heading", level=1)).to_contain_text(heading)
        if heading == "Capabilities":
            expect(page.locator("tr[data-capability^='test.console-many-']")).to_have_count(30)
    # The filters too: a status chosen and applied with keys only
    tab_to("filter-status", "id")
    page.keyboard.press("End")  # the last status
    tab_to("Filter")
    page.keyboard.press("Enter")
    expect(page).to_have_url(re.compile(r"status=\w+"))
    assert console.errors == []
