"""A tenant's share of the requests waiting in an API process holds whichever of its keys
they came with: a key the process has not verified yet counts under its own id only until it
is, then under its tenant (``api.middleware.Place``).

Given an API with small waiting bounds (20 in all, 8 a tenant) on a Redis db of its own, and
sync submits for a capability nobody serves (they wait until ``sync_max_wait_s``), when one
tenant sends them with keys this process has never seen, I expect that tenant to hold at most
its 8, every other one refused 503 ``overloaded``, and another tenant still served.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy import Engine

from api.app import create_app
from api.middleware import WaitingLimit
from broker.settings import Settings
from reach.localservices import libpq_url
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for, count_tasks
from tests.integration.stack import ServedApp

SHARE = 8
SYNC_WAIT = {
    "capability": "test.nobody",
    "payload": {},
    "queue_if_unavailable": True,
    "reply_mode": "sync",
}


@pytest.fixture
def api(settings: Settings, own_redis: str) -> Iterator[ServedApp]:
    update = {
        "redis_url": own_redis,
        "max_requests_waiting": 20,
        "max_requests_waiting_per_tenant": SHARE,
        "sync_max_wait_s": 10,
        "rate_limit_per_s": 10_000,
        "rate_limit_burst": 10_000,
    }
    with ServedApp(create_app(settings.model_copy(update=update))) as served:
        yield served


def counts_in(api: ServedApp) -> tuple[int, dict[str, int]]:
    """The requests ``WaitingLimit`` counts now: in all, and by tenant or key id."""
    layer: Any = api.server.config.app.middleware_stack
    while not isinstance(layer, WaitingLimit):
        layer = layer.app
    return layer.waiting, dict(layer.by_tenant)


def sync_submit(api: ServedApp, token: str) -> httpx.Response:
    with client_for(api, token) as http:
        return http.post("/tasks", json=SYNC_WAIT)


@contextlib.contextmanager
def holding_key_lookups(settings: Settings) -> Iterator[None]:
    """No key is looked up in Postgres meanwhile: they wait for the test's lock."""
    with psycopg.connect(libpq_url(settings.database_url)) as conn:
        conn.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
        yield
        conn.rollback()


def refused(sent: list[Future[httpx.Response]]) -> int:
    return sum(1 for f in sent if f.done() and f.result().status_code == 503)


def answers(sent: list[Future[httpx.Response]]) -> Counter[tuple[int, str, str]]:
    """The answers by status, content type and code (``accepted`` for a task)."""
    got = [f.result() for f in sent]
    return Counter(
        (a.status_code, a.headers["content-type"], a.json().get("code", "accepted")) for a in got
    )


def test_keys_not_yet_verified_hold_only_their_tenants_share_and_another_tenant_is_served(
    api: ServedApp, make_key: KeyMaker, engine: Engine, settings: Settings
) -> None:
    """Three fresh keys of one tenant, eight sync waits each, all in before any key is
    verified (the test holds the key table's lock meanwhile): 20 come in, the process's
    bound. Once the keys are verified, eight stay; before, each key held a share of its own
    (20 held, the process full, the other tenant's list 503)."""
    tenant, first = make_key()
    tokens = [first] + [make_key(tenant=tenant)[1] for _ in range(2)]
    _, victim = make_key()
    with ThreadPoolExecutor(3 * SHARE) as threads:
        with holding_key_lookups(settings):
            sent = [threads.submit(sync_submit, api, t) for t in tokens for _ in range(SHARE)]
            eventually(
                lambda: counts_in(api)[0] + refused(sent),
                "every wait in the API or refused at its door",
                until=lambda n: n == 3 * SHARE,
            )
            before = counts_in(api)
        eventually(
            lambda: count_tasks(engine, tenant) + refused(sent),
            "every wait let in or refused",
            until=lambda n: n == 3 * SHARE,
        )
        held = count_tasks(engine, tenant)
        with client_for(api, victim) as other:
            seen = other.get("/tasks?limit=1").status_code
        during = counts_in(api)
    print(f"counted before the keys were verified: {before}; after: {during}")
    print(f"tasks let in: {held}; the other tenant's list: {seen}")
    print(f"the 24 answers: {answers(sent)}")
    assert before[0] == 20
    assert held == SHARE
    assert seen == 200
    assert during == (SHARE, {tenant: SHARE})  # the other's list had been answered
    assert answers(sent) == Counter(
        {
            (202, "application/json", "accepted"): SHARE,
            (503, "application/problem+json", "overloaded"): 2 * SHARE,
        }
    )
    assert counts_in(api) == (0, {})  # each left the count it was in when answered


def test_one_fresh_key_holds_one_share_not_one_before_and_one_after_it_is_verified(
    api: ServedApp, make_key: KeyMaker, engine: Engine
) -> None:
    """Eight sync waits with a key the process has not seen, then eight more once it has:
    before, the first eight counted under the key id and the next under the tenant (16)."""
    tenant, token = make_key()
    with ThreadPoolExecutor(2 * SHARE) as threads:
        first = [threads.submit(sync_submit, api, token) for _ in range(SHARE)]
        eventually(
            lambda: count_tasks(engine, tenant) + refused(first),
            "the first eight in",
            until=lambda n: n == SHARE,
        )
        second = [threads.submit(sync_submit, api, token) for _ in range(SHARE)]
        eventually(
            lambda: count_tasks(engine, tenant) + refused(first + second),
            "the next eight let in or refused",
            until=lambda n: n == 2 * SHARE,
        )
        held = count_tasks(engine, tenant)
    print(f"tasks let in: {held}; the 16 answers: {answers(first + second)}")
    assert held == SHARE
    assert answers(second) == Counter({(503, "application/problem+json", "overloaded"): SHARE})
    assert counts_in(api) == (0, {})
