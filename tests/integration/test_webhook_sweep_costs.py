"""What the webhook sweep and a tenant's releases cost Postgres, whatever the backlog: in a
database of the test's own, read with EXPLAIN and by what is left."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Engine, func, select, text

from broker.db.models import webhook_attempts_table as attempts_log
from broker.db.models import webhook_deliveries_table as deliveries_table
from broker.settings import Settings
from broker.webhooks import deliveries
from reach import localservices
from tests.integration.webhook_rows import idle_producer
from workers.system.webhooks import SWEEP_BATCH, Webhooks

# Deliveries of one tenant, ``:count`` of them, ``:status``, with an attempt each; expired
# (past their retention) or not, released (marked on their way) or not.
DELIVERIES = text(
    "WITH made AS (INSERT INTO webhook_deliveries (id, tenant, task_id, event_type, url,"
    " body_expires_at, trace_id, status, attempts, final_attempt, next_attempt_at,"
    " lease_until, expires_at)"
    " SELECT gen_random_uuid(), CAST(:tenant AS text), gen_random_uuid(), 'task.progress',"
    " 'http://127.0.0.1:9/hook', now() + interval '1 hour', md5(i::text), CAST(:status AS text),"
    " 1, 3, now() - make_interval(secs => i),"
    " CASE WHEN CAST(:released AS boolean) THEN now() + interval '30 seconds' END,"
    " now() + CASE WHEN CAST(:expired AS boolean) THEN interval '-1 minute'"
    " ELSE interval '7 days' END"
    " FROM generate_series(1, CAST(:count AS integer)) AS i RETURNING id)"
    " INSERT INTO webhook_attempts (delivery_id, attempt, at, status_code, latency_ms)"
    " SELECT id, 1, now(), 503, 1 FROM made"
)


def add_deliveries(
    engine: Engine,
    tenant: str,
    count: int,
    *,
    status: str = "pending",
    expired: bool = False,
    released: bool = False,
) -> None:
    values = {
        "tenant": tenant,
        "count": count,
        "status": status,
        "expired": expired,
        "released": released,
    }
    with engine.begin() as conn:
        conn.execute(DELIVERIES, values)


@pytest.fixture
def producer(services: localservices.Services, settings: Settings) -> Iterator[Celery]:
    with idle_producer(services, settings) as made:
        yield made


def count_of(engine: Engine, table: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def test_one_sweep_deletes_every_delivery_past_its_retention_not_one_batch(
    settings: Settings, own_engine: Engine, producer: Celery
) -> None:
    """A sweep deleted one batch of 500 (17 a second at a sweep every 30 s), while one task's
    progress reports to its tenant's subscriptions may write hundreds a second."""
    # Given more than two batches of deliveries past their retention, an attempt each, and
    # one kept
    tenant = f"t-{secrets.token_hex(4)}"
    add_deliveries(own_engine, tenant, 2 * SWEEP_BATCH + 1, status="succeeded", expired=True)
    add_deliveries(own_engine, tenant, 1, status="succeeded")
    # When the sweep runs once
    counts = Webhooks(producer, settings, lambda: own_engine).sweep()
    # Expect all of them gone, their attempts with them, and the one kept
    assert counts["purged"] == 2 * SWEEP_BATCH + 1
    assert count_of(own_engine, deliveries_table) == 1
    assert count_of(own_engine, attempts_log) == 1


def explained(engine: Engine, statement: Any) -> dict[str, Any]:
    """The plan of ``statement`` as it ran (EXPLAIN ANALYZE, BUFFERS, JSON), values inlined."""
    sql = statement.compile(dialect=engine.dialect, compile_kwargs={"literal_binds": True})
    with engine.connect() as conn:
        (document,) = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}").one()
    plan: dict[str, Any] = document[0]["Plan"]
    return plan


def scans(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of the plan that reads a table or an index."""
    found = [plan] if "Relation Name" in plan or "Index Name" in plan else []
    for child in plan.get("Plans", []):
        found += scans(child)
    return found


def test_a_release_counts_the_tenants_releases_on_their_way_from_an_index_not_its_backlog(
    own_engine: Engine,
) -> None:
    """Counting a tenant's released deliveries read every pending delivery it had: each
    release (one after every attempt) cost time in proportion to its backlog."""
    # Given a tenant with a backlog of 5,000 due deliveries, three of them released
    tenant = f"t-{secrets.token_hex(4)}"
    add_deliveries(own_engine, tenant, 5000)
    add_deliveries(own_engine, tenant, 3, released=True)
    add_deliveries(own_engine, f"t-{secrets.token_hex(4)}", 2, status="sending", released=True)
    with own_engine.begin() as conn:
        conn.execute(text("ANALYZE webhook_deliveries"))
    # When a release counts the tenant's slots taken
    plan = explained(own_engine, deliveries.slots_taken(tenant))
    # Expect the three counted, read from the index of released deliveries: no row of the
    # backlog visited
    with own_engine.connect() as conn:
        assert conn.execute(deliveries.slots_taken(tenant)).scalar_one() == 3
    read = {node.get("Index Name", node.get("Relation Name")): node for node in scans(plan)}
    released = read.get("ix_webhook_deliveries_released_tenant_lease_until")
    assert released is not None, read.keys()
    assert released["Actual Rows"] == 3 and released.get("Rows Removed by Filter", 0) == 0
    assert "webhook_deliveries" not in read  # no scan of the table itself
    assert sum(node["Actual Rows"] for node in read.values()) == 3
