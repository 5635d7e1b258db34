"""The console's webhooks and sessions pages, in Chromium against the running stack."""

from __future__ import annotations

from playwright.sync_api import expect
from standardwebhooks import Webhook

from tests.integration.conftest import KeyMaker, client_for
from tests.integration.console.conftest import Console
from tests.integration.receiver import Receiver, Reply
from tests.integration.stack import ServedApp


def test_a_failed_delivery_is_shown_with_its_attempt_and_redelivered(
    console: Console, key: str, api: ServedApp
) -> None:
    # Given a subscription whose receiver refuses the first request and takes the next
    with (
        Receiver(lambda n: Reply(400) if n == 1 else Reply(200)) as receiver,
        client_for(api, key) as http,
    ):
        webhook = http.post(
            "/webhooks", json={"url": receiver.url, "events": ["task.succeeded"]}
        ).json()
        task_id = http.post("/tasks", json={"capability": "echo", "payload": {}}).json()["task_id"]
        page = console.page
        console.sign_in(key)
        page.get_by_role("link", name="Webhooks").click()
        page.get_by_role("link", name=receiver.url).click()

        # Then its delivery shows as failed, with the 400 of its one attempt
        delivery = page.locator("article.delivery").filter(has_text=task_id)
        expect(delivery.locator("h3 .badge")).to_have_text("failed")
        expect(delivery.locator("td.status-code")).to_have_text(["400"])

        # When it is redelivered, it succeeds on a second attempt with the same message
        delivery.get_by_role("button", name="Redeliver").click()
        expect(delivery.locator("h3 .badge")).to_have_text("succeeded")
        expect(delivery.locator("td.status-code")).to_have_text(["400", "200"])
        expect(delivery.get_by_role("button", name="Redeliver")).to_have_count(0)
        first, second = receiver.wait_for(2)
    assert first.headers["webhook-id"] == second.headers["webhook-id"]
    assert webhook["webhook_id"] in page.url
    assert console.errors == []


def test_a_session_shows_its_state_and_revisions(
    console: Console, key: str, api: ServedApp
) -> None:
    with client_for(api, key) as http:
        session = http.post("/sessions", json={"state": {"step": 1}}).json()
        sid = session["session_id"]
        updated = http.put(
            f"/sessions/{sid}", json={"state": {"step": 2}}, headers={"If-Match": '"1"'}
        )
        assert updated.status_code == 200
    page = console.page
    console.sign_in(key)
    page.get_by_role("link", name="Sessions").click()
    page.get_by_label("Session id").fill(sid)
    page.get_by_role("button", name="Show").click()

    expect(page.locator("#session-revision")).to_have_text("2")
    expect(page.locator("#revisions > li")).to_have_count(2)
    expect(page.locator("#revisions > li").first).to_contain_text("by the API")
    expect(page.locator("details").first).to_contain_text('"step": 2')
    assert console.errors == []


def test_the_sessions_page_lists_a_session_whose_tasks_link_lists_exactly_its_tasks(
    console: Console, key: str, api: ServedApp
) -> None:
    # Given two sessions of a fresh tenant, each with tasks, and a task in no session
    with client_for(api, key) as http:
        sid = http.post("/sessions", json={"state": {"step": 1}}).json()["session_id"]
        http.put(f"/sessions/{sid}", json={"state": {"step": 2}}, headers={"If-Match": '"1"'})
        other = http.post("/sessions").json()["session_id"]

        def submit(**envelope: str) -> str:
            answer = http.post("/tasks", json={"capability": "echo", "payload": {}, **envelope})
            assert answer.status_code == 202, answer.text
            task_id: str = answer.json()["task_id"]
            return task_id

        ours = [submit(session_id=sid), submit(session_id=sid)]
        submit(session_id=other)
        submit()
    page = console.page
    console.sign_in(key)

    # When the sessions page is opened, expect both sessions, newest first
    page.get_by_role("link", name="Sessions").click()
    rows = page.locator("#sessions tbody tr")
    expect(rows).to_have_count(2)
    assert rows.evaluate_all("rows => rows.map((r) => r.dataset.sessionId)") == [other, sid]
    expect(page.locator(f"tr[data-session-id='{sid}'] td").nth(1)).to_have_text("2")

    # And clicking one shows its detail
    page.get_by_role("link", name=sid).click()
    expect(page.locator("#session-revision")).to_have_text("2")
    expect(page.locator("#revisions > li")).to_have_count(2)

    # And its tasks link lists exactly its tasks, the filter kept in the URL
    page.get_by_role("link", name="Tasks of this session").click()
    expect(page.get_by_label("Session")).to_have_value(sid)
    tasks = page.locator("tr[data-task-id]")
    expect(tasks).to_have_count(2)
    assert tasks.evaluate_all("rows => rows.map((r) => r.dataset.taskId)") == ours[::-1]
    assert f"session_id={sid}" in page.url
    assert console.errors == []


def test_a_subscription_made_in_the_console_signs_with_the_secret_it_showed_once(
    console: Console, key: str, api: ServedApp
) -> None:
    page = console.page
    with Receiver() as receiver, client_for(api, key) as http:
        console.sign_in(key)
        page.get_by_role("link", name="Webhooks").click()
        # When a subscription is made from the form (the final events are ticked already)
        page.get_by_label("URL").fill(receiver.url)
        page.get_by_label("task.progress").check()
        page.get_by_label("Capabilities").fill("echo")
        page.get_by_role("button", name="Subscribe").click()
        secret = page.locator("#webhook-secret").inner_text()
        assert secret.startswith("whsec_")
        row = page.locator("tbody tr[data-webhook-id]")
        expect(row).to_have_count(1)
        expect(row.locator("td").nth(1)).to_contain_text("task.progress")
        (made,) = http.get("/webhooks").json()["webhooks"]
        assert (made["url"], made["capabilities"]) == (receiver.url, ["echo"])

        # Then a task's callback is signed with the secret the page showed
        http.post("/tasks", json={"capability": "echo", "payload": {"n": 1}})
        (call,) = receiver.wait_for(1)
        Webhook(secret).verify(call.body, call.headers)

        # And a rotation shows a new one, once
        row.get_by_role("link", name=receiver.url).click()
        page.get_by_role("button", name="Rotate secret").click()
        expect(page.get_by_role("status")).to_contain_text("A new secret signs from now on")
        assert page.locator("#webhook-secret").inner_text() not in ("", secret)

        # And deleting it (after a confirmation) leaves none
        page.get_by_role("link", name="← Webhooks").click()
        page.once("dialog", lambda dialog: dialog.accept())
        page.get_by_role("button", name=f"Delete {receiver.url}").click()
        expect(page.get_by_text("No subscription.")).to_be_visible()
        assert http.get("/webhooks").json()["webhooks"] == []
    assert console.errors == []


def test_a_tasks_page_shows_its_callback_delivery_and_redelivers_it(
    console: Console, api: ServedApp, make_key: KeyMaker
) -> None:
    # Given a tenant with a callback secret, and a task whose callback refuses the first call
    _, key = make_key(tenant_admin=True)
    with (
        Receiver(lambda n: Reply(400) if n == 1 else Reply(200)) as receiver,
        client_for(api, key) as http,
    ):
        assert http.post("/callbacks/secret").status_code == 201
        envelope = {
            "capability": "echo",
            "payload": {},
            "callback": {"url": receiver.url, "events": ["task.succeeded"]},
        }
        task_id = http.post("/tasks", json=envelope).json()["task_id"]
        page = console.page
        console.sign_in(key)
        console.open(f"#/tasks/{task_id}")
        # Then its page shows the delivery failed with the 400 of its one attempt
        delivery = page.locator("#deliveries article.delivery")
        expect(delivery.locator("h3 .badge")).to_have_text("failed")
        expect(delivery.locator("td.status-code")).to_have_text(["400"])
        # When it is redelivered from there, it succeeds on a second attempt
        delivery.get_by_role("button", name="Redeliver").click()
        expect(delivery.locator("h3 .badge")).to_have_text("succeeded")
        expect(delivery.locator("td.status-code")).to_have_text(["400", "200"])
        first, second = receiver.wait_for(2)
    assert first.headers["webhook-id"] == second.headers["webhook-id"]
    assert console.errors == []
