"""Within a tenant, a key reaches only what its patterns allow; tenant-wide settings need a
tenant-admin key; the catalog shows a tenant neither other tenants' figures nor the hosts.

One tenant holds three keys: one limited to ``echo``, one allowing ``*``, and a tenant-admin
key (itself limited to ``echo``, to show that tenant admin, not its patterns, opens the
tenant to it). Another tenant and an operator key stand beside it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, String, column, select, text, values

from broker.registry.capabilities import any_pattern_allows
from broker.registry.figures import SEEN, seen_by
from broker.tasks.queries import allowed_by
from broker.tenancy import key_store
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.receiver import Receiver
from tests.integration.stack import CeleryProcess, ServedApp, wait_for_task
from tests.integration.webhook_client import finished, register, submit, wait_deliveries

FINAL = {"succeeded", "failed", "cancelled", "expired"}
INVOICE = {"text": "Total: USD 1.00"}


@dataclass
class Tenant:
    name: str
    echo: httpx.Client  # patterns: echo
    wide: httpx.Client  # patterns: *
    admin: httpx.Client  # tenant admin; patterns: echo


@pytest.fixture
def acme(api: ServedApp, make_key: KeyMaker, worker: CeleryProcess) -> Iterator[Tenant]:
    tenant, echo = make_key(["echo"])
    _, wide = make_key(["*"], tenant=tenant)
    _, admin = make_key(["echo"], tenant=tenant, tenant_admin=True)
    with client_for(api, echo) as e, client_for(api, wide) as w, client_for(api, admin) as a:
        yield Tenant(tenant, e, w, a)


@pytest.fixture
def operator(api: ServedApp, engine: Engine) -> Iterator[httpx.Client]:
    _, token = key_store.create_key(engine, f"ops-{uuid.uuid4().hex[:8]}", ["*"], is_admin=True)
    with client_for(api, token) as http:
        yield http


def finished_invoice(client: httpx.Client, **envelope: Any) -> dict[str, Any]:
    task = submit(client, "invoice.extract", payload=INVOICE, **envelope)
    return wait_for_task(client, task["task_id"], FINAL)


def problem(response: httpx.Response) -> tuple[int, str | None, str | None]:
    """Status, code and detail; a success has neither code nor detail."""
    is_problem = response.headers["content-type"] == "application/problem+json"
    body = response.json() if is_problem else {}
    return response.status_code, body.get("code"), body.get("detail")


# --- tasks ---------------------------------------------------------------------------------

NAMES = ["echo", "invoice", "invoice.extract", "invoices", "invoicex.y", "a_b.c", "axb.c", "a_b"]


@pytest.mark.parametrize(
    "patterns",
    [["*"], ["echo"], ["invoice.*"], ["invoice"], ["a_b.*"], ["a_b.c", "echo"], ["nothing"]],
)
def test_the_sql_filter_allows_exactly_the_names_the_patterns_allow(
    engine: Engine, patterns: list[str]
) -> None:
    names = values(column("name", String), name="names").data([(n,) for n in NAMES])
    query = select(names.c.name).where(allowed_by(patterns, names.c.name))
    # and the figures' text SQL, over a column named as theirs
    names_of = "SELECT capability FROM unnest(CAST(:names AS text[])) AS capability"
    seen = text(f"{names_of} WHERE {SEEN}")
    with engine.connect() as conn:
        allowed = {row.name for row in conn.execute(query)}
        counted = set(conn.execute(seen, {"names": NAMES, **seen_by(patterns)}).scalars())
    assert allowed == counted == {n for n in NAMES if any_pattern_allows(patterns, n)}


def test_a_task_outside_the_keys_patterns_reads_exactly_like_an_unknown_one(
    acme: Tenant,
) -> None:
    task = finished_invoice(acme.wide)
    assert task["status"] == "succeeded"

    hidden = acme.echo.get(f"/tasks/{task['task_id']}")
    unknown = acme.echo.get(f"/tasks/{uuid.uuid4()}")

    assert problem(hidden) == problem(unknown) == (404, "task_not_found", "no such task")
    assert "USD" not in hidden.text
    assert acme.admin.get(f"/tasks/{task['task_id']}").json()["result"] == task["result"]


def test_a_task_outside_the_keys_patterns_cannot_be_streamed(acme: Tenant) -> None:
    task = finished_invoice(acme.wide)

    with acme.echo.stream("GET", f"/tasks/{task['task_id']}/events") as hidden:
        hidden.read()

    assert problem(hidden) == (404, "task_not_found", "no such task")
    with acme.wide.stream("GET", f"/tasks/{task['task_id']}/events") as shown:
        assert shown.status_code == 200


def test_a_task_outside_the_keys_patterns_cannot_be_cancelled_and_runs_on(
    acme: Tenant,
) -> None:
    task = submit(acme.wide, "test.sleepy", payload={"sleep_s": 1})

    refused = acme.echo.post(f"/tasks/{task['task_id']}/cancel")

    assert problem(refused) == (404, "task_not_found", "no such task")
    assert wait_for_task(acme.wide, task["task_id"], FINAL)["status"] == "succeeded"


def test_listing_shows_only_the_keys_capabilities_and_pages_through_them_fully(
    acme: Tenant,
) -> None:
    echoes = [submit(acme.wide, payload={"i": i})["task_id"] for i in range(3)]
    # The newest tasks are ones the echo key may not see: a page filtered after the
    # LIMIT would come back short or empty.
    invoices = [submit(acme.wide, "invoice.extract", payload=INVOICE)["task_id"] for _ in range(3)]

    seen, cursor, pages = [], None, []
    while True:
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = acme.echo.get("/tasks", params=params).json()
        pages.append(len(page["tasks"]))
        seen += [t["task_id"] for t in page["tasks"]]
        if (cursor := page["next_cursor"]) is None:
            break

    assert seen == echoes[::-1]
    assert pages == [2, 1]
    filtered = acme.echo.get("/tasks", params={"capability": "invoice.extract"}).json()
    assert filtered == {"tasks": [], "next_cursor": None}
    everything = acme.admin.get("/tasks", params={"limit": 10}).json()["tasks"]
    assert [t["task_id"] for t in everything] == (echoes + invoices)[::-1]


def test_a_tasks_deliveries_are_hidden_with_the_task(acme: Tenant) -> None:
    assert acme.admin.post("/callbacks/secret").status_code == 201
    with Receiver() as receiver:
        task = finished_invoice(acme.wide, callback={"url": receiver.url})
        path = f"/tasks/{task['task_id']}/deliveries"
        [delivery] = wait_deliveries(acme.wide, path, finished("succeeded"))

    listed = acme.echo.get(path)
    redelivered = acme.echo.post(f"{path}/{delivery['delivery_id']}/redeliver")

    assert problem(listed) == (404, "task_not_found", "no such task")
    assert problem(redelivered) == (404, "task_not_found", "no such task")


def test_a_tasks_deliveries_show_a_key_only_its_callback_and_the_webhooks_it_reaches(
    acme: Tenant,
) -> None:
    assert acme.admin.post("/callbacks/secret").status_code == 201
    with Receiver() as receiver:
        register(acme.admin, receiver.url)  # no filter: beyond what the echo key reaches
        task = submit(acme.echo, callback={"url": receiver.url})
        path = f"/tasks/{task['task_id']}/deliveries"
        every = wait_deliveries(acme.wide, path, lambda found: len(found) == 2)
    webhook_delivery = next(d for d in every if d["kind"] == "subscription")

    shown = acme.echo.get(path).json()["deliveries"]
    redelivered = acme.echo.post(f"{path}/{webhook_delivery['delivery_id']}/redeliver")

    assert [d["kind"] for d in shown] == ["callback"]
    assert problem(redelivered)[:2] == (404, "delivery_not_found")


# --- webhooks and the callback secret ------------------------------------------------------


def test_a_key_may_subscribe_only_to_capabilities_its_patterns_cover(acme: Tenant) -> None:
    url = "http://127.0.0.1:9/hook"

    wider = acme.echo.post("/webhooks", json={"url": url, "capabilities": ["invoice.*"]})
    unfiltered = acme.echo.post("/webhooks", json={"url": url})
    own = acme.echo.post("/webhooks", json={"url": url, "capabilities": ["echo"]})

    assert wider.status_code == unfiltered.status_code == 403
    assert wider.json()["code"] == unfiltered.json()["code"] == "tenant_admin_required"
    assert own.status_code == 201
    [only] = acme.admin.get("/webhooks").json()["webhooks"]
    assert only["webhook_id"] == own.json()["webhook_id"]
    assert acme.admin.post("/webhooks", json={"url": url}).status_code == 201


def test_a_webhook_the_keys_patterns_do_not_cover_is_404_on_every_path(acme: Tenant) -> None:
    with Receiver() as receiver:
        webhook, _ = register(acme.wide, receiver.url)  # no filter: every capability
        own, _ = register(acme.echo, "http://127.0.0.1:9/hook", capabilities=["echo"])
        submit(acme.wide)
        wid = webhook["webhook_id"]
        [delivery] = wait_deliveries(
            acme.wide, f"/webhooks/{wid}/deliveries", finished("succeeded")
        )
    did = delivery["delivery_id"]

    answers = {
        "get": acme.echo.get(f"/webhooks/{wid}"),
        "delete": acme.echo.delete(f"/webhooks/{wid}"),
        "rotate": acme.echo.post(f"/webhooks/{wid}/rotate-secret"),
        "deliveries": acme.echo.get(f"/webhooks/{wid}/deliveries"),
        "redeliver": acme.echo.post(f"/webhooks/{wid}/deliveries/{did}/redeliver"),
    }
    listed = acme.echo.get("/webhooks").json()["webhooks"]

    assert {name: problem(r)[:2] for name, r in answers.items()} == dict.fromkeys(
        answers, (404, "webhook_not_found")
    )
    assert [w["webhook_id"] for w in listed] == [own["webhook_id"]]
    untouched = acme.wide.get(f"/webhooks/{wid}").json()
    assert untouched["status"] == "enabled"
    assert untouched["previous_secret_expires_at"] is None
    every = {w["webhook_id"] for w in acme.admin.get("/webhooks").json()["webhooks"]}
    assert every == {wid, own["webhook_id"]}


def test_only_a_tenant_admin_key_sets_the_callback_secret(
    acme: Tenant, operator: httpx.Client
) -> None:
    refused = {
        "echo": acme.echo.post("/callbacks/secret"),
        "*": acme.wide.post("/callbacks/secret"),
    }
    callback = {"url": "http://127.0.0.1:9/hook"}
    before = acme.wide.post(
        "/tasks", json={"capability": "echo", "payload": {}, "callback": callback}
    )

    assert {k: problem(r)[:2] for k, r in refused.items()} == dict.fromkeys(
        refused, (403, "tenant_admin_required")
    )
    assert before.json()["code"] == "callback_secret_missing"  # the refusals created nothing
    assert acme.admin.post("/callbacks/secret").status_code == 201
    assert operator.post("/callbacks/secret").status_code == 201  # an operator key, its tenant
    after = acme.wide.post(
        "/tasks", json={"capability": "echo", "payload": {}, "callback": callback}
    )
    assert after.status_code == 202


# --- the catalog ---------------------------------------------------------------------------


def echo_entry(client: httpx.Client) -> dict[str, Any]:
    found = client.get("/capabilities").json()["capabilities"]
    return next(c for c in found if c["capability"] == "echo")


def test_capability_figures_count_only_the_callers_tenant(
    acme: Tenant, make_key: KeyMaker, api: ServedApp
) -> None:
    _, stranger = make_key()
    with client_for(api, stranger) as other:
        for i in range(3):
            wait_for_task(other, submit(other, payload={"i": i})["task_id"], FINAL)
    for i in range(2):
        wait_for_task(acme.wide, submit(acme.wide, payload={"i": i})["task_id"], FINAL)

    measured = echo_entry(acme.wide)["measured"]

    assert measured["tasks"] == 2
    assert measured["success_rate"] == 1.0


def test_a_keys_figures_count_only_the_tasks_it_may_read(
    make_key: KeyMaker, api: ServedApp, worker: CeleryProcess
) -> None:
    """Figures count a task by the capability that served it: a key allowed
    ``invoice.extract`` alone was shown the counts, success rate and times of its tenant's
    tasks asked for as ``invoice.extract.private`` (served there, by its prefix), which it
    may not read."""
    tenant, wide_key = make_key(["*"])
    _, narrow_key = make_key(["invoice.extract"], tenant=tenant)
    body = {"capability": "invoice.extract.private", "payload": {"text": "Total: USD 1.00"}}
    with client_for(api, wide_key) as wide, client_for(api, narrow_key) as narrow:
        ids = [wide.post("/tasks", json=body).json()["task_id"] for _ in range(3)]
        for task_id in ids:
            assert wait_for_task(wide, task_id, FINAL)["status"] == "succeeded"
            assert narrow.get(f"/tasks/{task_id}").status_code == 404
        served = "/capabilities/invoice.extract/series"
        assert wide.get(served).json()["total"]["tasks"] == 3
        assert narrow.get(served).json()["total"]["tasks"] == 0
        shown = {c["capability"]: c for c in narrow.get("/capabilities").json()["capabilities"]}
        assert shown["invoice.extract"]["measured"]["tasks"] == 0
        wide_shown = {c["capability"]: c for c in wide.get("/capabilities").json()["capabilities"]}
        assert wide_shown["invoice.extract"]["measured"]["tasks"] == 3


def test_capabilities_show_a_key_only_its_patterns_and_queue_depth_only_to_operators(
    acme: Tenant, operator: httpx.Client
) -> None:
    shown = acme.echo.get("/capabilities").json()["capabilities"]

    assert [c["capability"] for c in shown] == ["echo"]
    assert "queue_depth" not in shown[0]
    assert "queue_depth" not in echo_entry(acme.wide)
    everything = operator.get("/capabilities").json()["capabilities"]
    assert {"echo", "invoice.extract"} <= {c["capability"] for c in everything}
    assert all(isinstance(c["queue_depth"], int) for c in everything)


def test_agents_show_a_tenant_key_its_capabilities_and_no_instance_internals(
    acme: Tenant, operator: httpx.Client
) -> None:
    agents = acme.echo.get("/agents").json()["agents"]
    hidden = acme.echo.get("/agents/invoice-extractor")
    wide = acme.wide.get("/agents/echo").json()
    internal = operator.get("/agents/echo").json()

    assert "echo" in {a["agent_id"] for a in agents}
    assert {c["capability"] for a in agents for c in a["cards"]} == {"echo"}
    assert problem(hidden)[:2] == (404, "agent_not_found")
    instances = [i for a in agents for i in a["instances"]] + wide["instances"]
    assert instances and wide["live_instances"] >= 1
    # nor how many tasks an instance holds: every tenant's, as a queue's depth is
    internals = {"instance", "hostname", "pid", "active_tasks"}
    assert all(internals.isdisjoint(i) for i in instances)
    assert all(i["capabilities"] == ["echo"] for a in agents for i in a["instances"])
    assert all(internals <= set(i) for i in internal["instances"])
