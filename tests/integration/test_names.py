"""Capability names a tenant sends, against a real stack: none reaches a key Celery, kombu or
the broker keeps, none nobody serves leaves anything behind, and none escapes the key's
allow-list by falling back up its prefix chain."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
import redis
from fastapi import FastAPI
from sqlalchemy import Engine

from api.app import create_app
from broker.settings import Settings
from tests.integration.conftest import KeyMaker, client_for, count_tasks
from tests.integration.rows import a_task_row
from tests.integration.stack import CeleryProcess, ServedApp, wait_for_task

FINAL = {"succeeded", "failed", "cancelled", "expired"}
SERIES = re.compile(r"^reach_routing_failures_total\{", re.M)


def fresh_name() -> str:
    return f"fresh.n{secrets.token_hex(6)}"


def assert_worker_serves(client: httpx.Client, worker: CeleryProcess) -> None:
    assert worker.process is not None and worker.process.poll() is None
    task = client.post("/tasks", json={"capability": "echo", "payload": {"still": "here"}})
    assert wait_for_task(client, task.json()["task_id"], FINAL)["status"] == "succeeded"


@pytest.mark.parametrize("name", ["unacked", "unacked_index", "unacked_mutex", "celery"])
def test_a_name_kombu_or_celery_keep_a_key_under_is_refused_422_and_the_worker_keeps_serving(
    client: httpx.Client, worker: CeleryProcess, redis_url: str, name: str
) -> None:
    # When a tenant asks to queue for a name kombu or Celery keep a key under
    envelope = {"capability": name, "payload": {}, "queue_if_unavailable": True}
    response = client.post("/tasks", json=envelope)

    # Then it is refused as reserved, before anything reaches Redis
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["code"] == "envelope_invalid"
    [error] = problem["errors"]
    assert error["field"] == "capability" and "reserved" in error["message"]
    assert redis.Redis.from_url(redis_url).type(name) != b"list"
    # And the worker is still up and serving
    assert_worker_serves(client, worker)


def test_a_task_queued_under_a_reserved_name_is_failed_by_the_sweeper_and_never_published(
    client: httpx.Client,
    engine: Engine,
    tenant: tuple[str, str],
    redis_url: str,
    worker: CeleryProcess,
    system_beat: CeleryProcess,
) -> None:
    # Given a row accepted for "unacked" before the name was reserved, its message long gone
    task_id = a_task_row(engine, tenant=tenant[0], capability="unacked", age=timedelta(minutes=1))
    # Then the sweeper fails it instead of publishing it into kombu's key
    done = wait_for_task(client, str(task_id), FINAL)
    assert (done["status"], done["error"]["code"]) == ("failed", "capability_reserved")
    assert redis.Redis.from_url(redis_url).type("unacked") != b"list"
    assert_worker_serves(client, worker)


def test_queueing_for_a_capability_no_card_served_is_503_and_leaves_no_key_and_no_series(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str], redis_url: str
) -> None:
    name = fresh_name()
    envelope = {"capability": name, "payload": {}, "queue_if_unavailable": True}
    response = client.post("/tasks", json=envelope)

    assert response.status_code == 503
    assert response.json()["code"] == "no_agent_available"
    assert int(response.headers["retry-after"]) > 0
    assert count_tasks(engine, tenant[0]) == 0
    assert redis.Redis.from_url(redis_url).exists(name) == 0
    assert f'"{name}"' not in client.get("/metrics").text


@pytest.fixture
def own_api(settings: Settings, own_redis: str) -> Iterator[tuple[ServedApp, FastAPI]]:
    """An API on a Redis db of its own, so every key it writes can be counted; no rate limit
    in the way of a loop."""
    own = settings.model_copy(
        update={"redis_url": own_redis, "rate_limit_per_s": 10_000, "rate_limit_burst": 10_000}
    )
    app = create_app(own)
    with ServedApp(app) as served:
        yield served, app


def test_200_fresh_names_leave_the_redis_key_count_and_the_metric_series_count_unchanged(
    own_api: tuple[ServedApp, FastAPI], own_redis: str, make_key: KeyMaker
) -> None:
    served, app = own_api
    broker = redis.Redis.from_url(own_redis)
    _, token = make_key()
    with client_for(served, token) as http:

        def submit_both_ways(name: str) -> set[int]:
            return {
                http.post(
                    "/tasks", json={"capability": name, "payload": {}, "queue_if_unavailable": q}
                ).status_code
                for q in (True, False)
            }

        # Given the tenant's rate bucket and the label for unknown names exist already
        submit_both_ways(fresh_name())
        keys_before = broker.dbsize()
        series_before = len(SERIES.findall(http.get("/metrics").text))
        tracked_before = app.state.services.queue_bound.tracked

        # When a loop sends 200 names nobody ever served, each queued and not
        answers: set[int] = set()
        for _ in range(200):
            answers |= submit_both_ways(fresh_name())

        # Then every one is refused, and nothing grew
        assert answers == {503}
        keys_after = broker.dbsize()
        series_after = len(SERIES.findall(http.get("/metrics").text))
    assert (keys_after, series_after) == (keys_before, series_before)
    assert app.state.services.queue_bound.tracked == tracked_before


def test_fallback_to_a_parent_capability_runs_only_for_a_key_that_allows_the_parent(
    api: ServedApp, make_key: KeyMaker, engine: Engine, worker: CeleryProcess
) -> None:
    envelope = {"capability": "text.summarize.fr", "payload": {"text": "Un. Deux. Trois."}}

    # Given a key allowed only text.summarize.fr, while only text.summarize is live
    child_only, child_token = make_key(["text.summarize.fr"])
    with client_for(api, child_token) as http:
        refused = http.post("/tasks", json=envelope)
    # Then nothing runs: the answer is the one for no agent at all
    assert refused.status_code == 503
    assert refused.json()["code"] == "no_agent_available"
    assert count_tasks(engine, child_only) == 0

    # While a key that allows the parent still falls back to it
    _, family_token = make_key(["text.*"])
    with client_for(api, family_token) as http:
        accepted = http.post("/tasks", json=envelope)
        assert accepted.status_code == 202
        done = wait_for_task(http, accepted.json()["task_id"], FINAL)
    assert (done["status"], done["agent"]["agent_id"]) == ("succeeded", "summarizer")
