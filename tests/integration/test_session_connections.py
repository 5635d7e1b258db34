"""One tenant's session and webhook requests cannot take the API's pool of Postgres
connections from the others: its session and webhook creates, its submits into one session
and its session lists wait their turn in the API process without a connection.

Given a lock in Postgres that the test holds (another API process creating a session of the
tenant, submitting into the session, or a slow list), when one tenant sends more such
requests at once than the pool has connections (20 + 10), I expect at most one of the API's
backends to wait for that lock, and another tenant's request to be answered meanwhile.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy import make_url

from api.app import create_app
from api.middleware import WaitingLimit
from broker.settings import Settings
from reach.localservices import libpq_url
from tests.eventually import eventually
from tests.integration.activity import at_once
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import CeleryProcess, ServedApp

AT_ONCE = 40  # more than the API's pool holds (20 + 10 overflow)
ECHO = {"capability": "echo", "payload": {}, "queue_if_unavailable": True}
Send = Callable[[httpx.Client], httpx.Response]


API_NAME = "crowded-api"  # the application_name of the test's API's connections
# The backends of the test's API (by that name) waiting for a lock; the workers' are not.
WAITING_FOR_A_LOCK = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
    " AND application_name = 'crowded-api' AND wait_event_type = 'Lock'"
)


@pytest.fixture
def api(settings: Settings, own_redis: str, worker: CeleryProcess) -> Iterator[ServedApp]:
    """An API of the test's own (its pool is the one the crowd may exhaust), on a Redis db of
    its own: the session worker has advertised ``echo``'s card; nobody serves it on this db,
    so its tasks wait in the queue."""
    with crowded_api(settings, own_redis) as served:
        yield served


@contextlib.contextmanager
def crowded_api(settings: Settings, own_redis: str, **update: Any) -> Iterator[ServedApp]:
    """``api``'s API, with ``update`` to its settings."""
    named = make_url(settings.database_url).update_query_dict({"application_name": API_NAME})
    database_url = named.render_as_string(hide_password=False)
    own = settings.model_copy(
        update={"redis_url": own_redis, "database_url": database_url, **update}
    )
    with ServedApp(create_app(own)) as served:
        yield served


@contextlib.contextmanager
def holding(settings: Settings, statement: str, params: tuple[Any, ...]) -> Iterator[None]:
    """A transaction of the test's own that holds the lock ``statement`` takes."""
    with psycopg.connect(libpq_url(settings.database_url)) as conn:
        conn.execute(statement, params)
        yield
        conn.rollback()


def waiting_in_api(api: ServedApp, tenant: str) -> int:
    """The tenant's requests the API holds now (``WaitingLimit``'s count)."""
    app: Any = api.server.config.app
    layer: Any = app.middleware_stack
    while not isinstance(layer, WaitingLimit):
        layer = layer.app
    return layer.by_tenant.get(tenant, 0)


def crowd(
    api: ServedApp,
    settings: Settings,
    one: tuple[str, str, Send],
    other: tuple[str, Send],
    lock: tuple[str, tuple[Any, ...]],
) -> tuple[list[int], int, list[int]]:
    """``one`` tenant's request (tenant, token, send) sent AT_ONCE times while the test holds
    ``lock`` (a statement and its parameters); once every one of them is in the API and one
    waits for the lock, the ``other`` tenant's (token, send). The crowd's statuses, the
    other's, and how many backends were seen waiting for a lock, sampled throughout."""
    tenant, token, send = one

    def sent(_: int) -> int:
        with client_for(api, token) as http:
            return send(http).status_code

    with (
        at_once(settings, WAITING_FOR_A_LOCK) as seen,
        ThreadPoolExecutor(AT_ONCE) as threads,
    ):
        with holding(settings, *lock):
            answers = [threads.submit(sent, i) for i in range(AT_ONCE)]
            eventually(lambda: waiting_in_api(api, tenant) == AT_ONCE, "the crowd to be in the API")
            eventually(lambda: seen and seen[-1] >= 1, "one of the crowd to wait for the lock")
            with client_for(api, other[0]) as http:
                answered = other[1](http).status_code
        statuses = [answer.result() for answer in answers]
    return statuses, answered, seen


def new_session(api: ServedApp, token: str) -> str:
    with client_for(api, token) as http:
        answer = http.post("/sessions", json={"state": {"n": 0}})
    assert answer.status_code == 201, answer.text
    session_id: str = answer.json()["session_id"]
    return session_id


def test_one_tenants_session_creates_wait_for_its_lock_on_one_connection(
    api: ServedApp, settings: Settings, make_key: KeyMaker
) -> None:
    """A create takes the tenant's lock in Postgres (so the limit of live sessions holds);
    each waiter held a pooled connection while it waited, so one tenant's creates held all
    of them, and every other tenant's requests waited for the pool (503 after 15 s)."""
    # Given two tenants, and another process creating a session of the first (its lock held)
    tenant, token = make_key()
    _, other_token = make_key()
    new_session(api, token)
    # When the first creates 40 sessions at once, and the other one meanwhile
    statuses, answered, seen = crowd(
        api,
        settings,
        (tenant, token, lambda http: http.post("/sessions", json={"state": {"n": 1}})),
        (other_token, lambda http: http.post("/sessions")),
        ("SELECT pg_advisory_lock(hashtext('sess:' || %s))", (tenant,)),
    )
    # Then the other is answered while the crowd waits, which holds one backend at the lock
    assert (answered, max(seen)) == (201, 1), Counter(seen).most_common(5)
    # And once the lock is free, every create of the crowd is answered
    assert statuses == [201] * AT_ONCE


def test_one_tenants_webhook_creates_wait_for_its_lock_on_one_connection(
    settings: Settings, own_redis: str, make_key: KeyMaker
) -> None:
    """A webhook's creation takes the tenant's lock in Postgres too (so the limit of webhooks
    holds), and each waiter held a pooled connection while it waited, as session creates
    did."""
    # Given two tenants, an API that vets this many callback hosts of a tenant at once, and
    # another process creating a webhook of the first (its lock held)
    tenant, token = make_key()
    _, other_token = make_key()
    hook = {"url": "http://127.0.0.1:9/hook", "events": ["task.succeeded"]}
    with crowded_api(settings, own_redis, dns_lookups_per_tenant=AT_ONCE) as api:
        # When the first creates 40 webhooks at once, and the other creates one meanwhile
        statuses, answered, seen = crowd(
            api,
            settings,
            (tenant, token, lambda http: http.post("/webhooks", json=hook)),
            (other_token, lambda http: http.post("/webhooks", json=hook)),
            ("SELECT pg_advisory_lock(hashtext('wh:' || %s))", (tenant,)),
        )
    # Then the other is answered while the crowd waits, which holds one backend at the lock
    assert (answered, max(seen)) == (201, 1), Counter(seen).most_common(5)
    # And once the lock is free, every create of the crowd is answered
    assert statuses == [201] * AT_ONCE


def test_submits_into_one_session_wait_for_its_row_on_one_connection(
    api: ServedApp, settings: Settings, make_key: KeyMaker
) -> None:
    """A session's task takes the session's next turn with its row locked (``turns``); each
    waiting submit held a pooled connection, so one session's submits held all of them."""
    # Given a session of one tenant whose row another process holds (a submit into it)
    tenant, token = make_key()
    _, other_token = make_key()
    session_id, others = new_session(api, token), new_session(api, other_token)
    # When the tenant submits 40 tasks into it at once, and another tenant into its own
    statuses, answered, seen = crowd(
        api,
        settings,
        (tenant, token, lambda http: http.post("/tasks", json={**ECHO, "session_id": session_id})),
        (other_token, lambda http: http.post("/tasks", json={**ECHO, "session_id": others})),
        ("SELECT 1 FROM sessions WHERE id = %s FOR UPDATE", (session_id,)),
    )
    # Then the other tenant's task is accepted while one backend waits for the row
    assert (answered, max(seen)) == (202, 1), Counter(seen).most_common(5)
    # And every submit of the crowd is accepted once it is free
    assert statuses == [202] * AT_ONCE


@pytest.mark.parametrize(
    ("path", "table"),
    [("/sessions", "sessions"), ("/sessions/{session_id}/revisions", "session_revisions")],
)
def test_one_tenants_session_lists_run_one_at_a_time(
    api: ServedApp, settings: Settings, make_key: KeyMaker, path: str, table: str
) -> None:
    """A session list's byte budget measures each candidate's state (up to 256 KiB of JSON):
    one tenant's lists each took a backend at once, as its task lists did, until none was
    left. Now a tenant's lists run one at a time per API process, as its task lists do."""
    # Given a tenant's session, and a table its lists read held by another (a slow list)
    tenant, token = make_key()
    _, other_token = make_key()
    session_id = new_session(api, token)
    # When the tenant lists 40 times at once, and another tenant lists its tasks meanwhile
    statuses, answered, seen = crowd(
        api,
        settings,
        (tenant, token, lambda http: http.get(path.format(session_id=session_id))),
        (other_token, lambda http: http.get("/tasks")),
        (f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE", ()),
    )
    # Then the other is answered, while one of the tenant's lists waits in Postgres
    assert (answered, max(seen)) == (200, 1), Counter(seen).most_common(5)
    assert statuses == [200] * AT_ONCE
