"""A tenant's share of a worker's slots (``REACH_MAX_SLOTS_SHARE``, ``workers.loop_consumer``):
one tenant's runs that do not end (an agent it makes wait) hold at most its share of a
threads-pool worker's slots, and another tenant's tasks run in the rest. Its messages beyond
the share wait in their queue's last list and run, once each, as its runs end."""

from __future__ import annotations

import json
from pathlib import Path

import redis
from sqlalchemy import Engine, func, select

from broker.db.models import tasks_table
from broker.settings import Settings
from tests.agents import GATE_KEY
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import CeleryProcess, ServedApp, start_worker
from tests.integration.test_async_agents import all_final, runs, submit

CAPABILITY = "test.async-share"  # served only by this test's worker
LAST_LIST = f"{CAPABILITY}\x06\x169"  # the queue's last list (``dispatch.BEHIND``)


def counts(engine: Engine, tenant: str, queue: str = CAPABILITY) -> dict[str, int]:
    query = (
        select(tasks_table.c.status, func.count())
        .where(tasks_table.c.tenant == tenant, tasks_table.c.queue == queue)
        .group_by(tasks_table.c.status)
    )
    with engine.connect() as conn:
        return {status: int(n) for status, n in conn.execute(query)}


def set_aside(broker: redis.Redis) -> set[str]:
    """The task ids whose messages wait in the queue's last list."""
    return {json.loads(m)["headers"]["id"] for m in broker.lrange(LAST_LIST, 0, -1)}


def test_one_tenants_runs_that_never_end_hold_its_share_of_the_slots_and_another_tenant_runs(
    api: ServedApp,
    make_key: KeyMaker,
    settings: Settings,
    engine: Engine,
    log_dir: Path,
    redis_url: str,
) -> None:
    hog, hog_key = make_key()
    calm, calm_key = make_key()
    gates = redis.Redis.from_url(redis_url)
    broker = redis.Redis.from_url(settings.celery_broker_url)
    worker: CeleryProcess | None = None
    try:
        # Given a worker of 4 slots, of which one tenant may hold 2
        worker = start_worker(
            settings,
            CAPABILITY,
            "slot-share",
            log_dir,
            env={"REACH_MAX_SLOTS_SHARE": "0.5"},
            concurrency=4,
            pool="threads",
        )
        # When one tenant sends 6 tasks that wait (its agent made to wait, as a slow model)
        with client_for(api, hog_key) as http:
            hogs = [submit(http, CAPABILITY, {"gate": f"{hog}-go", "sleep_s": 0}) for _ in range(6)]
        # Then 2 run, and the other 4 wait in the queue's last list, set aside
        eventually(
            lambda: (counts(engine, hog).get("running", 0), set_aside(broker)),
            "the tenant's share running and the rest set aside",
            60,
            0.05,
            until=lambda found: found[0] == 2 and len(found[1] & set(hogs)) == 4,
        )
        # And another tenant's two tasks run in the slots left: before, the first tenant's
        # took all 4 and these waited for one of its runs to end (never, here)
        with client_for(api, calm_key) as http:
            calms = [
                submit(http, CAPABILITY, {"gate": f"{calm}-go", "sleep_s": 0}) for _ in range(2)
            ]
            eventually(
                lambda: counts(engine, calm).get("running", 0),
                "the other tenant's two running",
                60,
                0.05,
                until=lambda running: running == 2,
            )
            assert counts(engine, hog) == {"running": 2, "queued": 4}
            gates.set(GATE_KEY.format(f"{calm}-go"), 1, ex=300)
            done = all_final(http, calms, "the other tenant's two done", 60)
        assert {t["status"] for t in done.values()} == {"succeeded"}
        # And with two slots free again, the tenant still holds only its share
        eventually(
            lambda: (counts(engine, hog), set_aside(broker)),
            "the tenant's others set aside again, two slots free",
            60,
            0.05,
            until=lambda found: (
                found[0] == {"running": 2, "queued": 4} and len(found[1] & set(hogs)) == 4
            ),
        )
        # When its agent answers, every one of its tasks runs, once
        gates.set(GATE_KEY.format(f"{hog}-go"), 1, ex=300)
        with client_for(api, hog_key) as http:
            finished = all_final(http, hogs, "the tenant's six done", 60)
    finally:
        if worker is not None:
            worker.stop()
        gates.close()
        broker.close()
    assert {(t["status"], t["attempts"]) for t in finished.values()} == {("succeeded", 1)}
    assert {runs(redis_url, t) for t in hogs + calms} == {1}


BOUNDED = "test.async-bounded"  # max_concurrency 2, served only by its tests' workers


def test_one_tenant_holds_at_most_its_share_of_a_cards_max_concurrency(
    api: ServedApp,
    make_key: KeyMaker,
    settings: Settings,
    engine: Engine,
    log_dir: Path,
    redis_url: str,
) -> None:
    """A card of a max_concurrency is a smaller pool: one tenant's runs that never end filled
    it, with slots of the process to spare, and another tenant's task of that card waited."""
    hog, hog_key = make_key()
    calm, calm_key = make_key()
    gates = redis.Redis.from_url(redis_url)
    worker: CeleryProcess | None = None

    def running(tenant: str) -> int:
        return counts(engine, tenant, BOUNDED).get("running", 0)

    try:
        # Given a worker of 10 slots, a share of 0.5, and a card of max_concurrency 2
        env = {"REACH_MAX_SLOTS_SHARE": "0.5"}
        worker = start_worker(
            settings, BOUNDED, "card-share", log_dir, env, concurrency=10, pool="threads"
        )
        # When one tenant sends it 3 tasks whose agent waits
        with client_for(api, hog_key) as http:
            hogs = [submit(http, BOUNDED, {"gate": f"{hog}-go", "sleep_s": 0}) for _ in range(3)]
        eventually(lambda: running(hog), "the tenant's first", 60, 0.05, until=lambda n: n == 1)
        # Then another tenant's task of the card runs in its other run: before, the first
        # tenant's took both (its share of the process's slots is 5)
        with client_for(api, calm_key) as http:
            calms = [submit(http, BOUNDED, {"gate": f"{calm}-go", "sleep_s": 0})]
            eventually(lambda: running(calm), "the other's", 60, 0.05, until=lambda n: n == 1)
            assert counts(engine, hog, BOUNDED) == {"running": 1, "queued": 2}
            gates.set(GATE_KEY.format(f"{calm}-go"), 1, ex=300)
            done = all_final(http, calms, "the other tenant's task done", 60)
        gates.set(GATE_KEY.format(f"{hog}-go"), 1, ex=300)
        with client_for(api, hog_key) as http:
            done |= all_final(http, hogs, "the tenant's three done", 60)
    finally:
        if worker is not None:
            worker.stop()
        gates.close()
    assert {(t["status"], t["attempts"]) for t in done.values()} == {("succeeded", 1)}
    assert {runs(redis_url, t) for t in hogs + calms} == {1}


def test_a_retry_due_while_its_tenant_holds_its_share_waits_set_aside_and_runs_once(
    api: ServedApp,
    make_key: KeyMaker,
    settings: Settings,
    engine: Engine,
    log_dir: Path,
    redis_url: str,
) -> None:
    """A retry's back-off is held on the loop; due while its tenant holds its share, it goes
    behind the queue's others as a message taken then would. It stayed in memory instead,
    until some other message was taken (here: the sweep's copy of it, a second message)."""
    tenant, key = make_key()
    gates = redis.Redis.from_url(redis_url)
    broker = redis.Redis.from_url(settings.celery_broker_url)
    worker: CeleryProcess | None = None
    try:
        # Given a worker of 2 slots, of which one tenant may hold 1
        worker = start_worker(
            settings,
            CAPABILITY,
            "slot-share-retry",
            log_dir,
            env={"REACH_MAX_SLOTS_SHARE": "0.5"},
            concurrency=2,
            pool="threads",
        )
        with client_for(api, key) as http:
            # When a task asks to be retried in 2 s, and another of its tenant's then holds
            # the tenant's one slot
            retried = submit(http, CAPABILITY, {"retry_after_s": 2, "sleep_s": 0})
            eventually(
                lambda: (
                    runs(redis_url, retried) == 0
                    and http.get(f"/tasks/{retried}").json()["attempts"] == 1
                    and counts(engine, tenant).get("running", 0) == 0
                ),
                "the first attempt to ask for its retry",
                60,
                0.05,
            )
            holding = submit(http, CAPABILITY, {"gate": f"{tenant}-go", "sleep_s": 0})
            eventually(
                lambda: counts(engine, tenant).get("running", 0) == 1,
                "the other task to hold the slot",
                60,
                0.05,
            )
            # Then the retry, due, waits set aside in its queue's last list, one message
            eventually(
                lambda: set_aside(broker),
                "the retry set aside",
                60,
                0.05,
                until=lambda found: retried in found,
            )
            assert len(broker.lrange(LAST_LIST, 0, -1)) == 1
            # And once the slot is free it runs, once more only
            gates.set(GATE_KEY.format(f"{tenant}-go"), 1, ex=300)
            done = all_final(http, [retried, holding], "both done", 60)
    finally:
        if worker is not None:
            worker.stop()
        gates.close()
        broker.close()
    assert done[retried]["status"] == "succeeded" and done[retried]["attempts"] == 2
    assert done[holding]["status"] == "succeeded"
    assert (runs(redis_url, retried), runs(redis_url, holding)) == (1, 1)
