"""The registry with real worker processes: leases, states, drain, readiness and routing."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import Engine

from broker.registry import leases
from broker.registry.model import READY, CardRef, Lease, live_key
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for, count_tasks
from tests.integration.stack import CeleryProcess, ServedApp, start_worker, wait_for_task

FINAL = {"succeeded", "failed", "cancelled", "expired"}


def states(http: httpx.Client, agent_id: str = "test-pool") -> dict[str, str]:
    response = http.get(f"/agents/{agent_id}")
    if response.status_code == 404:
        return {}
    return {i["instance"].split("@")[0]: i["state"] for i in response.json()["instances"]}


@pytest.fixture
def pool_workers(settings: Settings, log_dir: Path) -> Iterator[dict[str, CeleryProcess]]:
    """Two instances of the test.pool agent, named pool-a and pool-b (fresh for each test)."""
    stamp = str(time.monotonic_ns())[-6:]
    workers = {
        name: start_worker(settings, "test.pool", f"{name}-{stamp}", log_dir, concurrency=1)
        for name in ("pool-a", "pool-b")
    }
    yield workers
    for worker in workers.values():
        worker.stop()


@pytest.fixture
def admin(api: ServedApp, engine: Engine) -> Iterator[httpx.Client]:
    from broker.tenancy import key_store

    _, token = key_store.create_key(engine, "ops", ["*"], is_admin=True)
    with client_for(api, token) as http:
        yield http


def live_instances(http: httpx.Client, capability: str = "test.pool") -> int:
    found = http.get("/capabilities").json()["capabilities"]
    return int(next(c for c in found if c["capability"] == capability)["live_instances"])


def by_name(http: httpx.Client, prefix: str) -> str:
    instances = http.get("/agents/test-pool").json()["instances"]
    return next(
        i["instance"]
        for i in instances
        if i["instance"].startswith(prefix) and i["state"] != "offline"
    )


def test_two_instances_are_ready_and_kill_9_shows_suspect_then_offline(
    admin: httpx.Client, pool_workers: dict[str, CeleryProcess], redis_url: str
) -> None:
    a = by_name(admin, "pool-a")
    b = by_name(admin, "pool-b")
    assert states(admin)[a.split("@")[0]] == states(admin)[b.split("@")[0]] == "ready"

    # When pool-a dies without a word
    pool_workers["pool-a"].kill_hard()

    # Then it turns suspect once a renewal is late, and offline once its lease expired
    seen = []

    def offline() -> bool:
        state = states(admin)[a.split("@")[0]]
        seen.append(state)
        return state == "offline"

    eventually(offline, "pool-a offline", timeout_s=15)
    assert "suspect" in seen
    # Its entry may still sit in the live index, but nothing lists an expired lease
    assert live_instances(admin) == 1

    # And pool-b keeps serving
    task = admin.post("/tasks", json={"capability": "test.pool", "payload": {}}).json()
    done = wait_for_task(admin, task["task_id"], FINAL)
    assert done["status"] == "succeeded"
    assert done["agent"]["instance"] == b
    # The stale index entry, if it was not pruned yet, is harmless: it holds an expired score.
    client = redis.Redis.from_url(redis_url)
    score = client.zscore(live_key("test.pool"), a)
    assert score is None or score < time.time()


def test_sigterm_mid_task_drains_finishes_the_task_then_goes_offline(
    admin: httpx.Client, pool_workers: dict[str, CeleryProcess]
) -> None:
    pool_workers["pool-b"].stop()  # so the task lands on pool-a
    a = by_name(admin, "pool-a")
    task = admin.post("/tasks", json={"capability": "test.pool", "payload": {"sleep_s": 3}}).json()
    eventually(
        lambda: admin.get(f"/tasks/{task['task_id']}").json()["status"] == "running", "task running"
    )

    worker = pool_workers["pool-a"]
    assert worker.process is not None
    worker.process.send_signal(15)
    eventually(lambda: states(admin)[a.split("@")[0]] == "draining", "draining")
    done = wait_for_task(admin, task["task_id"], FINAL)
    assert done["status"] == "succeeded"
    assert done["result"] == {"slept_s": 3.0}
    eventually(lambda: states(admin)[a.split("@")[0]] == "offline", "offline after the drain")
    assert worker.process.wait(timeout=30) == 0


def test_drain_by_an_admin_stops_the_instance_taking_work(
    admin: httpx.Client, pool_workers: dict[str, CeleryProcess], make_key: KeyMaker, api: ServedApp
) -> None:
    a = by_name(admin, "pool-a")
    b = by_name(admin, "pool-b")
    _, plain = make_key()
    with client_for(api, plain) as http:
        refused = http.post(f"/agents/test-pool/instances/{a}/drain")
    assert refused.status_code == 403
    assert refused.json()["code"] == "admin_required"
    assert admin.post("/agents/test-pool/instances/nobody@x/drain").status_code == 404

    assert admin.post(f"/agents/test-pool/instances/{a}/drain").status_code == 202
    eventually(lambda: states(admin)[a.split("@")[0]] == "offline", "drained to offline")
    ran_on = {
        wait_for_task(
            admin,
            admin.post("/tasks", json={"capability": "test.pool", "payload": {}}).json()["task_id"],
            FINAL,
        )["agent"]["instance"]
        for _ in range(6)
    }
    assert ran_on == {b}
    assert pool_workers["pool-a"].process is not None
    assert pool_workers["pool-a"].process.poll() is None  # drained, not dead


def test_a_not_ready_instance_stops_consuming_while_the_other_serves(
    admin: httpx.Client, pool_workers: dict[str, CeleryProcess], redis_url: str
) -> None:
    a = by_name(admin, "pool-a")
    b = by_name(admin, "pool-b")
    # Given pool-a's agent said, through the SDK, that it is not ready for a while
    client = redis.Redis.from_url(redis_url)
    leases.mark_not_ready(client, a, "test.pool", for_s=60)

    def a_not_ready() -> bool:
        cards = [
            c
            for i in admin.get("/agents/test-pool").json()["instances"]
            if i["instance"] == a
            for c in i.get("capabilities", [])
        ]
        return bool(cards) and live_instances(admin) == 1

    eventually(a_not_ready, "pool-a out of routing")
    assert states(admin)[a.split("@")[0]] == "ready"  # alive, only this capability paused

    # Then every task goes to pool-b, even those sent straight to the queue
    ids = [
        admin.post("/tasks", json={"capability": "test.pool", "payload": {}}).json()["task_id"]
        for _ in range(8)
    ]
    assert {wait_for_task(admin, i, FINAL)["agent"]["instance"] for i in ids} == {b}

    # And when it is ready again, it takes work again
    leases.mark_ready(client, a, "test.pool")
    eventually(
        lambda: live_instances(admin) == 2,
        "pool-a back in routing",
    )


def test_an_agent_pauses_itself_through_the_sdk(
    admin: httpx.Client, pool_workers: dict[str, CeleryProcess]
) -> None:
    task = admin.post(
        "/tasks", json={"capability": "test.pool", "payload": {"not_ready_s": 30}}
    ).json()
    paused = wait_for_task(admin, task["task_id"], FINAL)["agent"]["instance"]
    eventually(
        lambda: live_instances(admin) == 1,
        "the paused instance out of routing",
    )
    ids = [
        admin.post("/tasks", json={"capability": "test.pool", "payload": {}}).json()["task_id"]
        for _ in range(6)
    ]
    assert paused not in {wait_for_task(admin, i, FINAL)["agent"]["instance"] for i in ids}


def test_a_prefix_request_is_served_by_the_broader_capability(client: httpx.Client) -> None:
    response = client.post(
        "/tasks",
        json={
            "capability": "invoice.extract.zh",
            "payload": {"text": "Invoice No: A-1\nTotal: 3.00"},
        },
    )
    assert response.status_code == 202
    done = wait_for_task(client, response.json()["task_id"], FINAL)
    assert done["capability"] == "invoice.extract.zh"
    assert done["agent"]["agent_id"] == "invoice-extractor"
    assert done["result"]["number"] == "A-1"


def test_no_live_agent_is_503_with_retry_after_and_nothing_written(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str]
) -> None:
    response = client.post("/tasks", json={"capability": "nobody.home", "payload": {}})
    assert response.status_code == 503
    assert response.json()["code"] == "no_agent_available"
    assert int(response.headers["retry-after"]) > 0
    assert count_tasks(engine, tenant[0]) == 0


def test_queue_if_unavailable_waits_for_an_agent_to_come(
    client: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    response = client.post(
        "/tasks", json={"capability": "test.late", "payload": {}, "queue_if_unavailable": True}
    )
    assert response.status_code == 202
    task_id = response.json()["task_id"]
    assert client.get(f"/tasks/{task_id}").json()["status"] == "queued"
    late = start_worker(settings, "test.late", "late", log_dir)
    try:
        assert wait_for_task(client, task_id, FINAL)["status"] == "succeeded"
    finally:
        late.stop()


def test_two_versions_share_traffic_by_weight_never_all_to_the_top(
    admin: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    stamp = str(time.monotonic_ns())[-6:]
    v1 = start_worker(
        settings,
        "test.pool",
        f"v1-{stamp}",
        log_dir,
        concurrency=1,
        env={"REACH_TEST_POOL_VERSION": "1.0.0", "REACH_TEST_POOL_WEIGHT": "3"},
    )
    v2 = start_worker(
        settings,
        "test.pool",
        f"v2-{stamp}",
        log_dir,
        concurrency=1,
        env={"REACH_TEST_POOL_VERSION": "2.0.0", "REACH_TEST_POOL_WEIGHT": "1"},
    )
    try:
        ids = [
            admin.post("/tasks", json={"capability": "test.pool", "payload": {}}).json()["task_id"]
            for _ in range(60)
        ]
        finished = [wait_for_task(admin, i, FINAL) for i in ids]
        assert all(t["status"] == "succeeded" for t in finished), [
            t for t in finished if t["status"] != "succeeded"
        ][:2]
        versions = Counter(t["agent"]["version"] for t in finished)
    finally:
        v1.stop()
        v2.stop()
    # Weighted random: the heavier card gets more, the lighter still gets some.
    # (P[v2 gets none of 60 at 1/4] ~ 3e-8; P[v2 >= v1] is smaller still.)
    assert versions["2.0.0"] > 0
    assert versions["1.0.0"] > versions["2.0.0"]


def test_capabilities_show_live_instances_queue_depth_and_measured_figures(
    client: httpx.Client, admin: httpx.Client
) -> None:
    ids = [
        client.post("/tasks", json={"capability": "echo", "payload": {"i": i}}).json()["task_id"]
        for i in range(3)
    ]
    done = [wait_for_task(client, task_id, FINAL) for task_id in ids]
    runs = sorted(
        (
            datetime.fromisoformat(d["finished_at"]) - datetime.fromisoformat(d["started_at"])
        ).total_seconds()
        for d in done
    )

    def echo_of(http: httpx.Client) -> dict[str, Any]:
        found = http.get("/capabilities").json()["capabilities"]
        return next(c for c in found if c["capability"] == "echo")

    echo = echo_of(client)
    assert echo["live_instances"] >= 1
    assert echo["measured"]["tasks"] == 3  # this tenant's tasks, and only those
    assert echo["measured"]["success_rate"] == 1  # three echoes, all succeeded
    # the median of the three runs, started to finished (to the figure's 0.1 ms)
    assert echo["measured"]["p50_run_s"] == pytest.approx(runs[1], abs=2e-4)
    assert echo["cards"] == [{"agent_id": "echo", "version": "1.0.0"}]
    assert echo_of(admin)["queue_depth"] == 0  # shared infrastructure: operators only


def test_a_card_of_an_older_schema_never_overwrites_a_newer_one(engine: Engine) -> None:
    from sqlalchemy import select

    from broker.db.models import agent_cards_table as cards

    key = {"agent_id": "schema-probe", "version": "1", "capability": "probe.x"}
    leases.advertise_cards(engine, [{**key, "schema_version": 3, "owner": "new"}])
    leases.advertise_cards(engine, [{**key, "schema_version": 1, "owner": "old"}])
    leases.advertise_cards(engine, [{**key, "schema_version": 3, "owner": "newer"}])
    with engine.connect() as conn:
        stored = conn.execute(select(cards.c.card).where(cards.c.agent_id == "schema-probe"))
        assert stored.scalar_one()["owner"] == "newer"


def test_a_renewal_by_a_clock_ahead_of_its_peers_leaves_their_live_entries(
    own_redis: str,
) -> None:
    """Each renewal removed the live entries that had expired by its own clock: a worker
    running 20 s ahead removed its peers' (15 s leases) at each renewal, and routing saw
    them gone until their next."""
    client = redis.Redis.from_url(own_redis)
    capability = f"test.skew-{time.monotonic_ns()}"
    card = CardRef("skew", "1.0.0", capability)
    now = time.time()

    def lease(instance: str, heartbeat_at: float) -> Lease:
        return Lease(instance, READY, heartbeat_at, heartbeat_at, 15.0, cards=(card,))

    leases.renew(client, lease("behind@h", now))
    leases.renew(client, lease("ahead@h", now + 20))
    live = {m.decode() for m in client.zrange(live_key(capability), 0, -1)}
    assert live == {"behind@h", "ahead@h"}
