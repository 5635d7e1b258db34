"""The webhook API: the SSRF guard at registration, at submit and at delivery; per-task
callbacks and their redelivery; tenancy; deletion; the sweep that finds lost messages."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import Engine, insert
from standardwebhooks.webhooks import Webhook

from api.app import create_app
from broker.db.models import webhook_deliveries_table, webhooks_table
from broker.settings import Settings
from broker.tasks.dispatch import WEBHOOK_SWEEP_TASK, Dispatcher
from broker.tasks.resource import new_task_id
from broker.webhooks.signing import new_secret
from tests.integration.conftest import KeyMaker, client_for, count_tasks
from tests.integration.receiver import Receiver, Reply
from tests.integration.rows import a_body_row
from tests.integration.stack import ServedApp
from tests.integration.webhook_client import finished, for_task, register, submit, wait_deliveries

REFUSED_URLS = [
    "http://127.0.0.2/hook",  # loopback, but not the one address the tests allow
    "http://[::1]/hook",
    "http://10.0.0.1/hook",
    "http://172.16.5.4/hook",
    "http://192.168.0.1/hook",
    "http://169.254.169.254/latest/meta-data/",
    "http://100.64.0.1/hook",
    "http://[fd00::1]/hook",
    "http://[fe80::1]/hook",
    "http://[::ffff:10.0.0.1]/hook",
    "http://[::ffff:169.254.169.254]/hook",
    "http://[64:ff9b::a9fe:a9fe]/hook",
    "http://0.0.0.0/hook",
    "http://2130706434/hook",  # 127.0.0.2 written as one number
    "ftp://example.com/hook",
    "file:///etc/passwd",
    "http://user:secret@example.com/hook",
]


@pytest.mark.parametrize("url", REFUSED_URLS)
def test_refused_address_at_registration(client: httpx.Client, url: str) -> None:
    response = client.post("/webhooks", json={"url": url})
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "url_not_allowed"
    assert client.get("/webhooks").json()["webhooks"] == []


@pytest.mark.parametrize("url", REFUSED_URLS)
def test_refused_address_as_a_task_callback(
    client: httpx.Client,
    tenant_admin: httpx.Client,
    engine: Engine,
    tenant: tuple[str, str],
    url: str,
) -> None:
    assert tenant_admin.post("/callbacks/secret").status_code == 201
    response = submit_raw(client, callback={"url": url})
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "url_not_allowed"
    assert count_tasks(engine, tenant[0]) == 0


def submit_raw(client: httpx.Client, **envelope: object) -> httpx.Response:
    return client.post("/tasks", json={"capability": "echo", "payload": {}, **envelope})


@pytest.fixture(scope="module")
def production_api(settings: Settings) -> Iterator[ServedApp]:
    """The production default: no address is allowed despite the deny table."""
    with ServedApp(create_app(settings.model_copy(update={"webhook_allow": []}))) as served:
        yield served


def test_loopback_is_refused_by_default_and_accepted_when_allowed(
    client: httpx.Client, production_api: ServedApp, tenant: tuple[str, str]
) -> None:
    with client_for(production_api, tenant[1]) as production:
        refused = production.post("/webhooks", json={"url": "http://127.0.0.1:9/hook"})
    assert refused.status_code == 422 and refused.json()["code"] == "url_not_allowed"
    accepted = client.post("/webhooks", json={"url": "http://127.0.0.1:9/hook"})
    assert accepted.status_code == 201


def test_a_callback_needs_the_tenant_callback_secret_first(client: httpx.Client) -> None:
    response = submit_raw(client, callback={"url": "http://127.0.0.1:9/hook"})
    assert response.status_code == 422
    assert response.json()["code"] == "callback_secret_missing"


def test_invalid_webhook_specs_are_422(client: httpx.Client) -> None:
    for spec in (
        {"url": "http://127.0.0.1:9/h", "events": ["task.done"]},
        {"url": "http://127.0.0.1:9/h", "events": []},
        {"url": "http://127.0.0.1:9/h", "capabilities": ["Not A Pattern"]},
        {"url": "http://127.0.0.1:9/h", "secret": "mine"},
        {"events": ["task.succeeded"]},
    ):
        response = client.post("/webhooks", json=spec)
        assert response.status_code == 422, spec
        assert response.json()["code"] == "webhook_invalid"


def test_a_task_callback_is_signed_logged_and_redelivered(
    client: httpx.Client, tenant_admin: httpx.Client
) -> None:
    secret = tenant_admin.post("/callbacks/secret").json()["secret"]
    with Receiver(lambda n: Reply(400) if n == 1 else Reply(200)) as receiver:
        task = submit(client, callback={"url": receiver.url, "events": ["task.succeeded"]})
        path = f"/tasks/{task['task_id']}/deliveries"
        [failed] = wait_deliveries(client, path, finished("failed"))
        assert failed["kind"] == "callback" and failed["last_status_code"] == 400

        again = client.post(f"{path}/{failed['delivery_id']}/redeliver")
        assert again.status_code == 202, again.text
        [delivered] = wait_deliveries(client, path, finished("succeeded"))
        first, second = receiver.wait_for(2)
    assert delivered["attempt_count"] == 2
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == failed["message_id"]
    assert Webhook(secret).verify(second.body, second.headers)["data"]["task_id"] == task["task_id"]


def test_another_tenant_sees_404_for_every_webhook_path(
    client: httpx.Client, api: ServedApp, make_key: KeyMaker
) -> None:
    with Receiver() as receiver:
        webhook, _ = register(client, receiver.url)
        task = submit(client)
        wid = webhook["webhook_id"]
        [delivery] = wait_deliveries(client, f"/webhooks/{wid}/deliveries", finished("succeeded"))
    did, tid = delivery["delivery_id"], task["task_id"]
    with client_for(api, make_key()[1]) as other:
        answers = {
            "get": other.get(f"/webhooks/{wid}"),
            "delete": other.delete(f"/webhooks/{wid}"),
            "rotate": other.post(f"/webhooks/{wid}/rotate-secret"),
            "deliveries": other.get(f"/webhooks/{wid}/deliveries"),
            "redeliver": other.post(f"/webhooks/{wid}/deliveries/{did}/redeliver"),
            "task deliveries": other.get(f"/tasks/{tid}/deliveries"),
            "task redeliver": other.post(f"/tasks/{tid}/deliveries/{did}/redeliver"),
        }
        listed = other.get("/webhooks").json()["webhooks"]
    assert {name: r.status_code for name, r in answers.items()} == dict.fromkeys(answers, 404)
    assert listed == []
    assert client.get(f"/webhooks/{wid}").json()["status"] == "enabled"


def test_a_deleted_webhook_is_gone_with_its_log(client: httpx.Client) -> None:
    webhook, _ = register(client, "http://127.0.0.1:9/hook", description="to delete")
    wid = webhook["webhook_id"]
    assert client.delete(f"/webhooks/{wid}").status_code == 204
    assert client.get(f"/webhooks/{wid}").status_code == 404
    assert client.get(f"/webhooks/{wid}/deliveries").json()["code"] == "webhook_not_found"
    assert client.delete(f"/webhooks/{wid}").status_code == 404
    assert client.get("/webhooks/not-a-uuid").status_code == 404


def add_webhook_directly(engine: Engine, tenant: str, url: str) -> str:
    """A subscription the API would refuse: as if written before the rules changed."""
    wid = new_task_id()
    row = {
        "id": wid,
        "tenant": tenant,
        "url": url,
        "events": ["task.succeeded"],
        "capabilities": [],
        "secret": new_secret(),
    }
    with engine.begin() as conn:
        conn.execute(insert(webhooks_table).values(**row))
    return str(wid)


def test_the_guard_applies_again_at_delivery(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str]
) -> None:
    with Receiver(host="127.0.0.2") as canary:
        wid = add_webhook_directly(engine, tenant[0], canary.url)
        submit(client)
        [failed] = wait_deliveries(client, f"/webhooks/{wid}/deliveries", finished("failed"))
        assert canary.requests == []
    assert failed["attempt_count"] == 1
    assert failed["last_error"].startswith("url_not_allowed")


def test_the_sweep_sends_a_delivery_whose_message_was_lost(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str], settings: Settings
) -> None:
    with Receiver() as receiver:
        webhook, secret = register(client, receiver.url)
        task = submit(client)
        wait_deliveries(
            client, f"/tasks/{task['task_id']}/deliveries", for_task(task["task_id"], "succeeded")
        )
        lost = insert_lost_delivery(engine, tenant[0], webhook["webhook_id"], receiver.url)
        dispatcher = Dispatcher(settings)
        dispatcher.app.send_task(WEBHOOK_SWEEP_TASK)
        dispatcher.close()
        _, resent = receiver.wait_for(2)
    assert resent.headers["webhook-id"] == f"msg_{lost}"
    assert Webhook(secret).verify(resent.body, resent.headers)["type"] == "task.succeeded"


def insert_lost_delivery(engine: Engine, tenant: str, webhook_id: str, url: str) -> str:
    """A pending delivery due two minutes ago whose Celery message never arrived."""
    now = datetime.now(UTC)
    did = new_task_id()
    body = '{"type":"task.succeeded","timestamp":"2026-01-01T00:00:00Z","data":{}}'
    row = {
        "id": did,
        "tenant": tenant,
        "webhook_id": webhook_id,
        "task_id": new_task_id(),
        "event_type": "task.succeeded",
        "url": url,
        "body_expires_at": now + timedelta(days=1),
        "trace_id": "0" * 31 + "1",
        "status": "pending",
        "final_attempt": 5,
        "next_attempt_at": now - timedelta(minutes=2),
        "expires_at": now + timedelta(days=1),
    }
    with engine.begin() as conn:
        row["body_id"] = a_body_row(conn, body, now + timedelta(days=1))
        conn.execute(insert(webhook_deliveries_table).values(**row))
    return did.hex
