"""A tenant's webhook deliveries count in what it holds (migration 0023): each its URL, its
dedupe key and a kilobyte, and a kilobyte for each attempt it made, from the fanout that writes
it to the sweep that purges it, and a tenant whose deliveries fill its quota is refused new
tasks. Through the real API, a real worker's fanout and attempts, and a real receiver."""

from __future__ import annotations

from typing import Any

import httpx
from sqlalchemy import Engine, text

from broker.settings import Settings
from broker.tasks import execution
from broker.webhooks import upkeep
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.receiver import Receiver, Reply, always
from tests.integration.stack import CeleryProcess, ServedApp
from tests.integration.test_tenant_quota import expired, held, quota_app
from tests.integration.webhook_client import register, submit

# No more than the tenant's attempts in flight (4): none waits parked for a release.
SUBSCRIPTIONS = 4
ATTEMPTS = 5  # the test settings' schedule: five attempts, then dead
FINISHED = ("succeeded", "failed", "dead")


def deliveries_measured(engine: Engine, tenant: str) -> int:
    """What the tenant's deliveries hold, measured on their rows as the triggers count."""
    query = text(
        "SELECT coalesce(sum(octet_length(url) + coalesce(octet_length(dedupe_key), 0)"
        " + 1024 + attempts * 1024), 0) FROM webhook_deliveries WHERE tenant = :t"
    )
    with engine.connect() as conn:
        return int(conn.execute(query, {"t": tenant}).scalar_one())


def tasks_measured(engine: Engine, tenant: str) -> int:
    query = text(
        "SELECT coalesce(sum(payload_size + coalesce(octet_length(metadata::text), 0)"
        " + 1024), 0) FROM tasks WHERE tenant = :t"
    )
    with engine.connect() as conn:
        return int(conn.execute(query, {"t": tenant}).scalar_one())


def stored_row_bytes(engine: Engine, tenant: str) -> int:
    """The deliveries' rows as Postgres stores them (their index entries not included)."""
    query = text(
        "SELECT coalesce(sum(pg_column_size(d.*)), 0) FROM webhook_deliveries d WHERE tenant = :t"
    )
    with engine.connect() as conn:
        return int(conn.execute(query, {"t": tenant}).scalar_one())


def finished_deliveries(engine: Engine, tenant: str, count: int) -> list[Any]:
    """Wait until the tenant has ``count`` deliveries, every one finished; their attempts."""
    query = text("SELECT status, attempts FROM webhook_deliveries WHERE tenant = :t")

    def read() -> list[Any]:
        with engine.connect() as conn:
            return list(conn.execute(query, {"t": tenant}))

    return eventually(
        read,
        f"{count} deliveries of {tenant}, finished",
        60,
        0.1,
        until=lambda rows: len(rows) == count and all(r.status in FINISHED for r in rows),
    )


def purge_deliveries(engine: Engine, tenant: str) -> None:
    """The seven days of retention pass for the tenant's deliveries, and the sweep runs."""
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE webhook_deliveries SET expires_at = now() WHERE tenant = :t"),
            {"t": tenant},
        )
    upkeep.purge_expired(engine, batch=1000, budget_s=30)


def subscribe(http: httpx.Client, url: str, count: int) -> list[str]:
    return [
        register(http, f"{url}/{n}", events=["task.succeeded"])[0]["webhook_id"]
        for n in range(count)
    ]


def test_the_bytes_a_tenants_deliveries_hold_follow_every_fanout_attempt_and_delete(
    api: ServedApp, make_key: KeyMaker, engine: Engine, worker: CeleryProcess
) -> None:
    # Given a tenant with three subscriptions, one answering 503 (five attempts, then dead)
    tenant, key = make_key()
    with client_for(api, key) as http:
        with Receiver() as good, Receiver(always(Reply(status=503))) as failing:
            subscribe(http, good.url, 2)
            [flaky] = subscribe(http, failing.url, 1)
            # When two tasks finish and their deliveries are attempted, one after the other
            submit(http, payload={"n": 1})
            finished_deliveries(engine, tenant, 3)
            submit(http, payload={"n": 2})
            rows = finished_deliveries(engine, tenant, 6)
        # Expect every delivery counted, each attempt too, beside the tasks
        assert sorted(r.attempts for r in rows) == [1, 1, 1, 1, ATTEMPTS, ATTEMPTS]
        deliveries_bytes = deliveries_measured(engine, tenant)
        assert held(engine, tenant) == tasks_measured(engine, tenant) + deliveries_bytes
        assert deliveries_bytes > 6 * 1024 + (4 + 2 * ATTEMPTS) * 1024
        assert deliveries_bytes > stored_row_bytes(engine, tenant)  # never less than the rows

        # When a subscription is deleted, its deliveries with it: what they held is given back
        assert http.delete(f"/webhooks/{flaky}").status_code == 204
    assert deliveries_measured(engine, tenant) < deliveries_bytes
    assert held(engine, tenant) == tasks_measured(engine, tenant) + deliveries_measured(
        engine, tenant
    )

    # When the sweep purges the rest at the end of their retention: nothing is left counted
    purge_deliveries(engine, tenant)
    assert deliveries_measured(engine, tenant) == 0
    assert held(engine, tenant) == tasks_measured(engine, tenant) > 0


def test_a_tenant_whose_deliveries_fill_its_quota_gets_429_until_the_sweep_purges_them(
    settings: Settings, make_key: KeyMaker, engine: Engine, worker: CeleryProcess
) -> None:
    # Given a quota of 20,000 bytes: twenty tiny tasks' rows, but not one task's deliveries
    # to four endpoints that answer 503 (4 x 5 attempts, about 25 KB)
    app = quota_app(settings, tenant_max_held_bytes=20_000)
    hog, hog_key = make_key()
    _, other_key = make_key()
    with (
        Receiver(always(Reply(status=503))) as failing,
        ServedApp(app) as served,
        client_for(served, hog_key) as http,
    ):
        subscribe(http, failing.url, SUBSCRIPTIONS)
        # When one short-lived task finishes and its deliveries are attempted
        first = submit(http, payload={}, result_ttl_s=5)
        finished_deliveries(engine, hog, SUBSCRIPTIONS)
        # Expect its next submit refused: its deliveries hold its quota, its task 1 KB
        refused = http.post("/tasks", json={"capability": "echo", "payload": {}})
        assert refused.status_code == 429, refused.text
        problem = refused.json()
        assert problem["code"] == "quota_exceeded"
        assert "webhook deliveries" in problem["detail"]
        assert problem["held_bytes"] == held(engine, hog) > 20_000
        assert tasks_measured(engine, hog) < 2000
        # and another tenant not held back
        with client_for(served, other_key) as other:
            assert submit(other, payload={})["task_id"]

        # When its task expires and goes, it is still refused: the deliveries are kept
        expired(http, first["task_id"])
        execution.purge_expired(engine, batch=1000, budget_s=30)
        assert held(engine, hog) == deliveries_measured(engine, hog) > 20_000
        again = http.post("/tasks", json={"capability": "echo", "payload": {}})
        assert again.status_code == 429, again.text

        # Once the sweep purges the deliveries, the bytes are back and it gets in again
        purge_deliveries(engine, hog)
        assert held(engine, hog) == 0
        after = http.post("/tasks", json={"capability": "echo", "payload": {}})
        assert after.status_code == 202, after.text
