"""A tenant's fair slice of a queue holds for every message of its tasks, not only the one its
submit publishes: a session's turn is run by the message published when the turn before it
ends (by a worker, or by a cancel), and that one goes behind the other tenants' too once its
tenant holds its slice of the queue."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import Engine, select

from api.app import create_app
from broker.db.models import tasks_table
from broker.settings import Settings
from broker.tasks.dispatch import BEHIND, redis_list, redis_lists
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import ServedApp, start_worker

FAIR_SLICE = 3
SESSIONS = 8
# Each served by a one-slot worker the test starts: the first turns' queue, then the queue of
# the later turns and of the other tenant's task, once it holds them all.
FIRSTS = "test.fair-threads"
LATERS = "test.fair-prefork"


@pytest.fixture
def fair_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"queue_fair_slice": FAIR_SLICE})


@pytest.fixture
def fair_api(fair_settings: Settings) -> Iterator[ServedApp]:
    app = create_app(fair_settings)
    app.state.services.queue_bound.refresh_s = 0  # each submit sees the ones before it
    app.state.services.queue_bound.stale_s = 0
    with ServedApp(app) as served:
        yield served


@pytest.fixture
def broker(redis_url: str) -> Iterator[redis.Redis]:
    """The broker's Redis, with both queues empty before and after: what a test leaves (the
    cancelled first turns' messages, a turn's second message, which finds it done) must not
    count in the next one's."""
    client = redis.Redis.from_url(redis_url)
    queues = [*redis_lists(FIRSTS), *redis_lists(LATERS)]
    client.delete(*queues)
    yield client
    client.delete(*queues)
    client.close()


def submit(http: httpx.Client, capability: str, session_id: str | None = None) -> str:
    envelope = {"capability": capability, "payload": {}, "queue_if_unavailable": True}
    if session_id is not None:
        envelope["session_id"] = session_id
    answer = http.post("/tasks", json=envelope)
    assert answer.status_code == 202, answer.text
    task_id: str = answer.json()["task_id"]
    return task_id


def statuses(engine: Engine, task_ids: list[str]) -> set[str]:
    with engine.connect() as conn:
        found = conn.execute(select(tasks_table.c.status).where(tasks_table.c.id.in_(task_ids)))
        return set(found.scalars())


def tenants_by_start(engine: Engine, task_ids: list[str]) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(tasks_table.c.tenant)
                .where(tasks_table.c.id.in_(task_ids))
                .order_by(tasks_table.c.started_at)
            ).scalars()
        )


@pytest.mark.parametrize("first_turns_end", ["run by a worker", "cancelled"])
def test_a_sessions_later_turns_go_behind_another_tenants_task_past_the_fair_slice(
    first_turns_end: str,
    fair_api: ServedApp,
    fair_settings: Settings,
    make_key: KeyMaker,
    engine: Engine,
    broker: redis.Redis,
    log_dir: Path,
) -> None:
    hog, hog_key = make_key()
    calm, calm_key = make_key()
    # given a tenant's sessions, each with a first turn in one queue and two later ones in
    # another, which no worker serves yet
    firsts: list[str] = []
    laters: list[str] = []
    with client_for(fair_api, hog_key) as http:
        for _ in range(SESSIONS):
            answer = http.post("/sessions", json={})
            assert answer.status_code == 201, answer.text
            session_id = answer.json()["session_id"]
            firsts.append(submit(http, FIRSTS, session_id))
            laters += [submit(http, LATERS, session_id) for _ in range(2)]
        # when every first turn ends, each letting its session's second go
        if first_turns_end == "cancelled":
            for task_id in firsts:
                assert http.post(f"/tasks/{task_id}/cancel").json()["status"] == "cancelled"
        else:
            worker = start_worker(
                fair_settings, FIRSTS, "fair-firsts", log_dir, concurrency=1, pool="threads"
            )
            try:
                eventually(lambda: statuses(engine, firsts) == {"succeeded"}, "the firsts run")
            finally:
                worker.stop()
    # (each submit's message, and one released for each session)
    eventually(
        lambda: sum(int(broker.llen(key)) for key in redis_lists(LATERS)) == 3 * SESSIONS,
        "every second turn released",
    )
    # and then the other tenant submits one task to the later turns' queue
    with client_for(fair_api, calm_key) as http:
        calm_task = submit(http, LATERS)
    # expect the released turns behind it: the queue's first list holds the hog's first
    # three submits, made before the queue held its slice, and the calm tenant's task
    assert broker.llen(redis_list(LATERS)) == FAIR_SLICE + 1
    assert broker.llen(redis_list(LATERS, BEHIND)) == 3 * SESSIONS - FAIR_SLICE
    # and, with one slot serving that queue, at most the slice of the hog's turns started
    # before the calm tenant's task (it was every released turn, in front)
    worker = start_worker(fair_settings, LATERS, "fair-laters", log_dir, concurrency=1)
    try:
        eventually(
            lambda: statuses(engine, [*laters, calm_task]) == {"succeeded"}, "all laters run"
        )
    finally:
        worker.stop()
    order = tenants_by_start(engine, [*laters, calm_task])
    assert order.count(hog) == 2 * SESSIONS
    assert order.index(calm) <= FAIR_SLICE, order
