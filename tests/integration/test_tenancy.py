"""Keys are required, tenants are walled off, and keys only reach their capabilities."""

from __future__ import annotations

import uuid

import httpx
from sqlalchemy import Engine

from broker.tenancy import key_store
from tests.integration.conftest import KeyMaker, client_for, count_tasks
from tests.integration.stack import ServedApp


def test_no_key_is_401(api: ServedApp) -> None:
    with client_for(api, None) as anonymous:
        response = anonymous.get("/tasks")
    assert response.status_code == 401
    assert response.json()["code"] == "unauthenticated"
    assert response.headers["www-authenticate"] == "Bearer"


def test_a_wrong_secret_or_junk_key_is_401(api: ServedApp, make_key: KeyMaker) -> None:
    _, token = make_key()
    key_id = token.split("_")[1]
    for bad in (f"rk_{key_id}_wrongsecret", "rk_nokey_x", "junk", token + "x"):
        with client_for(api, bad) as http:
            response = http.get("/tasks")
        assert response.status_code == 401, bad
        assert response.json()["code"] == "unauthenticated"


def test_a_revoked_key_is_401(uncached_api: ServedApp, make_key: KeyMaker, engine: Engine) -> None:
    _, token = make_key()
    with client_for(uncached_api, token) as http:
        assert http.get("/tasks").status_code == 200
        assert key_store.revoke_key(engine, token.split("_")[1])
        # This API caches keys for 0 s, so revocation is immediate here.
        assert http.get("/tasks").status_code == 401


def test_a_capability_outside_the_keys_patterns_is_403_and_writes_nothing(
    api: ServedApp, make_key: KeyMaker, engine: Engine
) -> None:
    tenant, token = make_key(["invoice.*"])
    with client_for(api, token) as http:
        refused = http.post("/tasks", json={"capability": "echo", "payload": {}})
        allowed = http.post(
            "/tasks", json={"capability": "invoice.extract", "payload": {"text": "Total: USD 1.00"}}
        )
    assert refused.status_code == 403
    assert refused.json()["code"] == "capability_not_allowed"
    assert allowed.status_code == 202
    assert count_tasks(engine, tenant) == 1


def test_another_tenants_task_is_404_exactly_like_an_unknown_one(
    api: ServedApp, make_key: KeyMaker
) -> None:
    _, owner = make_key()
    _, stranger = make_key()
    with client_for(api, owner) as http:
        task_id = http.post("/tasks", json={"capability": "echo", "payload": {}}).json()["task_id"]
        assert http.get(f"/tasks/{task_id}").status_code == 200
    with client_for(api, stranger) as http:
        foreign = http.get(f"/tasks/{task_id}")
        unknown = http.get(f"/tasks/{uuid.uuid4()}")
        malformed = http.get("/tasks/not-a-uuid")
        listed = http.get("/tasks").json()["tasks"]

    def shape(r: httpx.Response) -> tuple[int, str, str]:
        body = r.json()
        return r.status_code, body["code"], body["detail"]

    assert (
        shape(foreign)
        == shape(unknown)
        == shape(malformed)
        == (404, "task_not_found", "no such task")
    )
    assert listed == []


def test_a_key_for_the_same_tenant_sees_its_tasks(api: ServedApp, make_key: KeyMaker) -> None:
    tenant, first = make_key()
    _, second = make_key(tenant=tenant)
    with client_for(api, first) as http:
        task_id = http.post("/tasks", json={"capability": "echo", "payload": {}}).json()["task_id"]
    with client_for(api, second) as http:
        assert http.get(f"/tasks/{task_id}").status_code == 200
