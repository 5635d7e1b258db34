"""What the registry keeps of instances that are gone, and what reading an agent costs.

Every worker name ever used (a pod restarted under a new host name) and every remote agent
ever registered kept its row, listed offline forever; ``GET /agents/{id}`` read every row and
every lease of them all, without a token."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import kombu
import pytest
import redis
from sqlalchemy import Engine, event, func, select, update

from api.app import create_app
from broker.db.engines import sync_engine
from broker.db.models import agent_instances_table as instances
from broker.registry import leases, retention
from broker.registry.model import OFFLINE, READY, CardRef, Lease
from broker.settings import Settings
from broker.tenancy import key_store
from reach import localservices, migrate
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import CeleryProcess, ServedApp
from tests.integration.test_capacity import stack_for

__all__ = ["stack_for"]  # a fixture of test_capacity's, used here
DAY_S = 86400.0


def _lease(instance: str, agent_id: str = "echo-agent", ttl_s: float = 60) -> Lease:
    return Lease(
        instance=instance,
        state=READY,
        heartbeat_at=time.time(),
        started_at=time.time(),
        lease_ttl_s=ttl_s,
        hostname="host",
        pid=1,
        cards=(CardRef(agent_id, "1.0.0", "echo"),),
    )


def _record(engine: Engine, lease: Lease, state: str, seen_ago_s: float) -> None:
    """The instance's row as ``leases.record_instance`` writes it, last seen that long ago."""
    leases.record_instance(engine, lease, state)
    seen = datetime.now(UTC) - timedelta(seconds=seen_ago_s)
    with engine.begin() as conn:
        conn.execute(
            update(instances)
            .where(instances.c.instance == lease.instance)
            .values(last_seen_at=seen)
        )


def _kept(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(select(instances.c.instance)).scalars())


def test_the_janitor_deletes_instances_not_seen_for_the_retention_and_keeps_live_ones(
    own_engine: Engine, own_redis: str
) -> None:
    client = redis.Redis.from_url(own_redis)
    # Given instances last recorded two days ago: 25 stopped, one killed with -9 (its row
    # still says ready, its lease expired), one running all along (its lease is there)
    stopped = [f"stopped-{n}@old-pod" for n in range(25)]
    for name in stopped:
        _record(own_engine, _lease(name), OFFLINE, 2 * DAY_S)
    _record(own_engine, _lease("killed@old-pod"), READY, 2 * DAY_S)
    running = _lease("running@pod")
    _record(own_engine, running, READY, 2 * DAY_S)
    leases.renew(client, running)
    # ... and one stopped an hour ago; each with its own queue declared, as a worker does
    _record(own_engine, _lease("stopped@new-pod"), OFFLINE, 3600)
    names = ["killed@old-pod", "running@pod", "stopped@new-pod"]
    queues = {name: _lease(name).cards[0].instance_queue(name) for name in names}
    _declare(own_redis, list(queues.values()))
    assert all(_bound(client, q) == 2 for q in queues.values())

    # When one janitor run with a retention of a day deletes in batches of 10
    removed = retention.purge_gone(own_engine, client, retention_s=DAY_S, batch=10, budget_s=60)

    # Expect the stopped and the killed ones gone, the running and the recent ones kept
    assert removed == 26
    assert _kept(own_engine) == {"running@pod", "stopped@new-pod"}
    # ... and the running one seen now: its retention counts from today, should it die
    with own_engine.connect() as conn:
        seen = conn.execute(
            select(instances.c.last_seen_at).where(instances.c.instance == "running@pod")
        ).scalar_one()
    assert datetime.now(UTC) - seen < timedelta(hours=1)
    # ... and the kombu bindings of the killed one's queue gone with it, the others' kept
    bound = {name: _bound(client, q) for name, q in queues.items()}
    assert bound == {"killed@old-pod": 0, "running@pod": 2, "stopped@new-pod": 2}
    client.close()


def _bound(client: redis.Redis, queue: str) -> int:
    """How many of the keys kombu keeps a queue's binding in are there (of two)."""
    return len(list(client.scan_iter(match=f"_kombu.binding*.{queue}")))


def test_the_janitor_keeps_the_bindings_of_a_worker_started_again_under_a_gone_name(
    own_engine: Engine, own_redis: str
) -> None:
    client = redis.Redis.from_url(own_redis)
    # Given an instance last seen two days ago, whose queue was declared
    lease = _lease("restarted@pod")
    _record(own_engine, lease, OFFLINE, 2 * DAY_S)
    queue = lease.cards[0].instance_queue(lease.instance)
    _declare(own_redis, [queue])

    # When a worker starts again under its name as the janitor deletes its row: it declares
    # its queue and writes its lease (its row comes later, once the janitor's delete is done)
    def restart(conn: Any) -> None:
        _declare(own_redis, [queue])
        leases.renew(client, lease)

    event.listen(own_engine, "commit", restart, once=True)
    removed = retention.purge_gone(own_engine, client, retention_s=DAY_S, batch=10, budget_s=60)

    # Expect the row deleted (the worker writes its own), and the live worker's bindings kept
    assert removed == 1
    assert _bound(client, queue) == 2
    client.close()


def _declare(url: str, queues: list[str]) -> None:
    """Declare each queue as a Celery worker consuming it does (its exchange named after it)."""
    with kombu.Connection(url) as conn:
        channel = conn.default_channel
        for queue in queues:
            kombu.Queue(queue, kombu.Exchange(queue), routing_key=queue)(channel).declare()


def test_beats_janitor_deletes_an_instance_row_older_than_the_retention(
    engine: Engine, settings: Settings, system_beat: CeleryProcess
) -> None:
    # Given a worker name last seen two days ago, and one seen just now
    suffix = secrets.token_hex(4)
    old, new = f"old-{suffix}@gone-pod", f"new-{suffix}@pod"
    _record(engine, _lease(old), OFFLINE, 2 * DAY_S)
    _record(engine, _lease(new), OFFLINE, 1)
    # When beat's janitor runs (every half second here), expect the old one deleted
    eventually(lambda: old not in _kept(engine), "the janitor to delete the old instance")
    assert new in _kept(engine)


@dataclass
class InstanceReads:
    """How many ``agent_instances`` rows each statement of the API returned."""

    rows: list[tuple[str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FROM agent_instances" in statement:
            with self.lock:
                self.rows.append((statement, cursor.rowcount))


@pytest.fixture
def crowded(
    services: localservices.Services, settings: Settings, own_redis: str
) -> Iterator[tuple[ServedApp, Engine, InstanceReads]]:
    """An API on a database of its own, whose reads of instance rows are counted."""
    name = f"reach_instances_{secrets.token_hex(3)}"
    url = localservices.create_database(services.database_url, name)
    migrate.upgrade(url)
    # The system gauges read every instance when the API starts, and then not within the test
    update = {"database_url": url, "redis_url": own_redis, "metrics_refresh_s": 3600}
    local = settings.model_copy(update=update)
    engine = sync_engine(local)
    app = create_app(local)
    reads = InstanceReads()
    event.listen(app.state.services.engine.sync_engine, "after_cursor_execute", reads.record)
    try:
        with ServedApp(app) as served:
            yield served, engine, reads
    finally:
        engine.dispose()
        localservices.drop_database(services.database_url, name)


def test_an_agents_page_reads_only_its_own_instances_among_thousands(
    crowded: tuple[ServedApp, Engine, InstanceReads], own_redis: str
) -> None:
    api, engine, reads = crowded
    client = redis.Redis.from_url(own_redis)
    # Given 3,000 offline instances of other agents, and two of "mine": one live, one gone
    leases.advertise_cards(engine, [_card("mine"), _card("other")])
    with engine.begin() as conn:
        conn.execute(
            instances.insert(),
            [_row(f"other-{n}@pod-{n}", "other") for n in range(3000)],
        )
    live = _lease("mine-live@pod", agent_id="mine")
    _record(engine, live, READY, 0)
    leases.renew(client, live)
    _record(engine, _lease("mine-gone@pod", agent_id="mine"), OFFLINE, 60)
    _, token = key_store.create_key(engine, "ops", ["*"], is_admin=True)

    # When an operator reads the agent
    before = len(reads.rows)
    with client_for(api, token) as http:
        page = http.get("/agents/mine")

    # Expect its own two instances, in their states, and only their rows read
    assert page.status_code == 200
    states = {i["instance"]: i["state"] for i in page.json()["instances"]}
    assert states == {"mine-live@pod": READY, "mine-gone@pod": OFFLINE}
    assert [count for _, count in reads.rows[before:]] == [2]
    client.close()


def _card(agent_id: str) -> dict[str, Any]:
    return {
        "agent_id": agent_id,
        "version": "1.0.0",
        "capability": "echo",
        "schema_version": 1,
        "tenants": None,
    }


def _row(instance: str, agent_id: str) -> dict[str, Any]:
    now = datetime.now(UTC)
    return {
        "instance": instance,
        "hostname": "pod",
        "pid": 1,
        "state": OFFLINE,
        "cards": [{"agent_id": agent_id, "version": "1.0.0", "capability": "echo"}],
        "lease_ttl_s": 30.0,
        "started_at": now,
        "last_seen_at": now,
        "stopped_at": now,
    }


def test_the_agent_reads_take_a_rate_token(stack_for: Any, make_key: KeyMaker) -> None:
    # Given a tenant with a burst of two tokens that come back once in 1,000 s
    api = stack_for(rate_limit_per_s=0.001, rate_limit_burst=2)
    _, token = make_key()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}) as http:
        # When it reads the agents three times, expect the third refused
        listed = [http.get("/agents") for _ in range(2)]
        one = http.get("/agents/echo-agent")
    assert [a.status_code for a in listed] == [200, 200]
    assert (one.status_code, one.json()["code"]) == (429, "rate_limited")

    # ... and a single agent's page takes one as well
    _, other = make_key()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {other}"}) as http:
        pages = [http.get("/agents/echo-agent").status_code for _ in range(3)]
    assert pages[2] == 429


def test_an_instances_row_is_stamped_by_postgress_clock_not_its_hosts(
    own_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper and the janitor compare ``last_seen_at`` with Postgres's ``now()``: stamped
    by a host whose clock ran ten minutes ahead, a worker killed with -9 kept its tasks
    running for those ten minutes past its lease."""

    class AheadClock(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> AheadClock:
            return cls.fromtimestamp(time.time() + 600, tz)

    # Given a host whose clock is ten minutes ahead of Postgres's
    monkeypatch.setattr(leases, "datetime", AheadClock)
    # When its worker records its row, and then stops
    lease = _lease("ahead@pod")

    def in_the_future(column: Any) -> bool:
        query = select(column > func.now()).where(instances.c.instance == lease.instance)
        with own_engine.connect() as conn:
            return bool(conn.execute(query).scalar_one())

    leases.record_instance(own_engine, lease, READY)
    seen_ahead = in_the_future(instances.c.last_seen_at)
    leases.record_instance(own_engine, lease, OFFLINE)
    stopped_ahead = in_the_future(instances.c.stopped_at)
    # Then neither is in Postgres's future
    assert (seen_ahead, stopped_ahead) == (False, False)
