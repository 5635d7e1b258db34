"""Every page of the console at 1280 and 390 px wide: readable (nothing wider than the
window) and without errors. Screenshots go to ``REACH_CONSOLE_SCREENSHOTS`` when set (the
README's are made with ``REACH_CONSOLE_SCREENSHOTS=docs/console``), else to a temp folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import Engine

from broker.tenancy import key_store
from tests.integration.conftest import client_for
from tests.integration.console.conftest import NARROW, WIDE, Console
from tests.integration.console.test_console import TEXT
from tests.integration.receiver import Receiver, Reply
from tests.integration.stack import ROOT, ServedApp, wait_for_task

FINAL = {"succeeded", "failed", "cancelled", "expired"}


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    wanted = os.environ.get("REACH_CONSOLE_SCREENSHOTS")
    folder = (ROOT / wanted) if wanted else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def fits(page: Page) -> bool:
    width: int = page.evaluate("document.documentElement.scrollWidth")
    return width <= page.viewport_size["width"]  # type: ignore[index]


def test_every_page_reads_at_1280_and_390_px_without_errors(
    console: Console, api: ServedApp, engine: Engine, shots: Path
) -> None:
    receiver = Receiver(lambda n: Reply(400) if n == 1 else Reply(200))
    # An operator's key: the capabilities page shows queue depths, the agents page instances.
    _, key = key_store.create_key(engine, "console-shots", ["*"], is_admin=True)
    with receiver, client_for(api, key) as http:
        webhook = http.post(
            "/webhooks", json={"url": receiver.url, "events": ["task.succeeded", "task.failed"]}
        ).json()["webhook_id"]
        session = http.post("/sessions", json={"state": {"cart": ["tea"]}}).json()["session_id"]
        http.put(
            f"/sessions/{session}",
            json={"state": {"cart": ["tea", "milk"]}},
            headers={"If-Match": '"1"'},
        )
        summary = http.post(
            "/tasks",
            json={"capability": "text.summarize", "payload": {"text": TEXT, "max_sentences": 3}},
        ).json()["task_id"]
        failed = http.post(
            "/tasks", json={"capability": "echo", "payload": {"fail": "out_of_paper"}}
        ).json()["task_id"]
        http.post("/tasks", json={"capability": "test.sleepy", "payload": {"sleep_s": 0.2}})
        for task_id in (summary, failed):
            wait_for_task(http, task_id, FINAL)
        receiver.wait_for(3)  # the three tasks succeeded or failed

    page = console.page
    pages = {
        "sign-in": ("", "Sign in"),
        "tasks": ("#/tasks", "Tasks"),
        "task": (f"#/tasks/{summary}", "text.summarize"),
        "task-failed": (f"#/tasks/{failed}", "echo"),
        "submit": ("#/submit?capability=text.summarize", "Submit a task"),
        "capabilities": ("#/capabilities", "Capabilities"),
        "agents": ("#/agents", "Agents"),
        "webhooks": ("#/webhooks", "Webhooks"),
        "webhook": (f"#/webhooks/{webhook}", "http://127.0.0.1"),
        "sessions": ("#/sessions", "Sessions"),
        "session": (f"#/sessions?id={session}", "Sessions"),
    }
    for size, viewport in (("1280", WIDE), ("390", NARROW)):
        page.set_viewport_size(viewport)
        for name, (fragment, heading) in pages.items():
            if name == "sign-in":
                console.open()
                page.evaluate("sessionStorage.clear()")
                console.open("#/")
                page.reload()
            elif name == "tasks":
                console.sign_in(key)
                console.open(fragment)
            else:
                console.open(fragment)
            expect(page.get_by_role("heading", level=1)).to_contain_text(heading)
            if name.startswith("task-") or name == "task":
                expect(page.locator("#stream-state")).to_have_text("ended")
            if name == "capabilities":
                expect(page.locator("tr[data-capability='text.summarize']")).to_be_visible()
            if name == "agents":
                expect(page.locator("article[data-agent-id='summarizer']")).to_be_visible()
            if name == "webhook":
                expect(page.locator("article.delivery")).to_have_count(3)
            if name == "sessions":
                expect(page.locator(f"tr[data-session-id='{session}']")).to_be_visible()
            if name == "session":
                expect(page.locator("#revisions > li")).to_have_count(2)
            if name == "submit":
                expect(page.get_by_label("max_sentences")).to_be_visible()
            if name == "tasks":
                expect(page.locator(f"tr[data-task-id='{failed}'] .badge")).to_have_text("failed")
            assert fits(page), f"{name} is wider than {size} px"
            # The long lists (every test agent) are shown as far as the window goes.
            whole = name not in ("capabilities", "agents")
            page.screenshot(path=shots / f"{name}-{size}.png", full_page=whole)
            if name == "capabilities":  # below the long table: the last hour's charts
                charts = page.locator(".charts")
                expect(charts.locator("svg")).to_have_count(3)  # echo, summarize, sleepy
                charts.screenshot(path=shots / f"capability-charts-{size}.png")
    assert console.errors == []
