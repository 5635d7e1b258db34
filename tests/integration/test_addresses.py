"""Addresses with real workers: a target pins a version, channels split traffic, a revoked
version gets none, a hint reaches its instance while it is ready, and a card's ``tenants``
hide it from everyone else (issue 16).

Workers here serve ``test.addr`` (agent ``test-addr``), each as the version its environment
names; the session's worker does not consume it."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import Engine, func, select

from api.app import create_app
from broker.db.models import tasks_table as tasks
from broker.registry import leases, revocations
from broker.registry.model import LEASE_PREFIX, card_queue, lease_key, live_key
from broker.settings import Settings
from broker.tasks.dispatch import Dispatcher, send_run
from broker.tenancy import key_store
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.rows import a_task_row
from tests.integration.stack import (
    CeleryProcess,
    ServedApp,
    celery_command,
    consumed_queues,
    start_worker,
    submit_many,
    wait_for_task,
)

FINAL = {"succeeded", "failed", "cancelled", "expired"}
CAPABILITY = "test.addr"


def start_version(
    settings: Settings, log_dir: Path, version: str, name: str, tenants: str = ""
) -> CeleryProcess:
    """A worker of test-addr ``version``; ``tenants`` (comma-separated): its card's."""
    stamp = str(time.monotonic_ns())[-6:]
    return start_worker(
        settings,
        CAPABILITY,
        f"{name}-{stamp}",
        log_dir,
        concurrency=2,
        env={"REACH_TEST_ADDR_VERSION": version, "REACH_TEST_ADDR_TENANTS": tenants},
    )


@pytest.fixture(scope="module")
def admin(api: ServedApp, engine: Engine) -> Iterator[httpx.Client]:
    _, token = key_store.create_key(engine, f"ops-{uuid.uuid4().hex[:8]}", ["*"], is_admin=True)
    with client_for(api, token) as http:
        yield http


@pytest.fixture
def caller(api: ServedApp, make_key: KeyMaker) -> Iterator[httpx.Client]:
    tenant, token = make_key()
    with client_for(api, token) as http:
        http.headers["X-Test-Tenant"] = tenant
        yield http


def tenant_of(http: httpx.Client) -> str:
    return http.headers["X-Test-Tenant"]


def live_instance(admin: httpx.Client, version: str, prefix: str) -> str:
    """The name of the live instance serving ``version`` whose name starts with ``prefix``."""

    def find() -> str | None:
        for view in admin.get("/agents/test-addr").json()["instances"]:
            if view["instance"].startswith(prefix) and view["state"] == "ready":
                return str(view["instance"])
        return None

    return str(eventually(find, f"a ready {prefix} instance of test-addr {version}"))


def run(http: httpx.Client, **envelope: Any) -> dict[str, Any]:
    answer = http.post("/tasks", json={"capability": CAPABILITY, "payload": {}, **envelope})
    assert answer.status_code == 202, answer.text
    return wait_for_task(http, answer.json()["task_id"], FINAL)


def without_trace(body: dict[str, Any]) -> dict[str, Any]:
    """A problem without what differs on every request: its trace id and its path."""
    return {k: v for k, v in body.items() if k not in ("trace_id", "instance")}


# --- hint (two instances of one version, started for this test alone) ------------------------


@contextmanager
def ready_instances(
    admin: httpx.Client, settings: Settings, log_dir: Path, *names: str
) -> Iterator[list[tuple[CeleryProcess, str]]]:
    """A worker of test-addr 1.0.0 for each name, once ready: (its process, its instance)."""
    with ExitStack() as stack:
        started = []
        for name in names:
            process = start_version(settings, log_dir, "1.0.0", name)
            stack.callback(process.stop)
            started.append(process)
        yield [(p, live_instance(admin, "1.0.0", n)) for p, n in zip(started, names, strict=True)]


def test_a_hinted_instance_takes_the_task_while_ready_and_another_once_it_drained(
    admin: httpx.Client, caller: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    with ready_instances(admin, settings, log_dir, "hint-a", "hint-b") as [(_, hinted), (_, other)]:
        # Given two ready instances, when ten tasks name one of them as their hint
        ran_on = {run(caller, hint=hinted)["agent"]["instance"] for _ in range(10)}
        # Then that instance ran every one of them (unhinted, both would have)
        assert ran_on == {hinted}
        # When the hinted instance is drained
        assert admin.post(f"/agents/test-addr/instances/{hinted}/drain").status_code == 202
        eventually(
            lambda: all(
                i["state"] != "ready"
                for i in admin.get("/agents/test-addr").json()["instances"]
                if i["instance"] == hinted
            ),
            "the hinted instance to stop being ready",
        )
        # Then the same hint is served by the other one
        ran_on = {run(caller, hint=hinted)["agent"]["instance"] for _ in range(5)}
        assert ran_on == {other}
        # And a hint naming no instance at all is the usual choice
        assert run(caller, hint="nobody@nowhere")["agent"]["instance"] == other


def test_a_task_hinted_to_an_instance_that_stops_being_ready_moves_to_its_cards_queue(
    admin: httpx.Client,
    caller: httpx.Client,
    settings: Settings,
    log_dir: Path,
    engine: Engine,
    redis_url: str,
) -> None:
    """An instance whose readiness fails stops taking from its queues, its own too: what was
    hinted to it waited for its readiness to come back, however long, while another instance
    of its card was ready."""
    with ready_instances(admin, settings, log_dir, "hint-paused", "hint-ready") as found:
        [(_, hinted), (_, other)] = found
        # Given a task waiting in the hinted instance's own queue (its message not yet taken)
        task_id = a_task_row(engine, tenant="t-hinted", capability=CAPABILITY)
        with engine.begin() as conn:
            own = f"{card_queue(CAPABILITY, 'test-addr', '1.0.0')}@{hinted}"
            conn.execute(tasks.update().where(tasks.c.id == task_id).values(queue=own))
        # When the instance finds itself not ready
        with redis.Redis.from_url(redis_url) as client:
            leases.mark_not_ready(client, hinted, CAPABILITY, for_s=60)
        # Then the task goes to its card's queue, and the ready instance runs it
        with engine.connect() as conn:
            done = eventually(
                lambda: conn.execute(
                    select(tasks.c.status, tasks.c.instance).where(
                        tasks.c.id == task_id, tasks.c.status == "succeeded"
                    )
                ).first(),
                "the hinted task run elsewhere",
            )
        assert done.instance == other


def test_a_task_hinted_to_an_instance_that_died_moves_to_its_cards_queue(
    admin: httpx.Client,
    caller: httpx.Client,
    settings: Settings,
    log_dir: Path,
    engine: Engine,
    system_beat: CeleryProcess,  # the sweeper
) -> None:
    with ready_instances(admin, settings, log_dir, "hint-dead", "hint-alive") as found:
        [(doomed, hinted), (_, other)] = found
        # Given the hinted instance killed while its lease still says ready
        doomed.kill_hard()
        answer = caller.post(
            "/tasks", json={"capability": CAPABILITY, "payload": {}, "hint": hinted}
        )
        assert answer.status_code == 202, answer.text
        task_id = answer.json()["task_id"]
        # (routed to its own queue: the lease had not expired yet)
        with engine.connect() as conn:
            queue = conn.scalar(select(tasks.c.queue).where(tasks.c.id == uuid.UUID(task_id)))
        assert queue is not None and queue.endswith(hinted)
        # Then the sweeper moves it to its card's queue once the lease is gone, and it runs there
        done = wait_for_task(caller, task_id, FINAL)
        assert done["status"] == "succeeded"
        assert done["agent"]["instance"] == other


# --- two versions, for the rest of the module --------------------------------------------------


@pytest.fixture(scope="module")
def versions(settings: Settings, log_dir: Path, admin: httpx.Client) -> Iterator[dict[str, str]]:
    """A worker of test-addr 1.0.0 and one of 2.0.0: version -> instance."""
    one = start_version(settings, log_dir, "1.0.0", "v1")
    two = start_version(settings, log_dir, "2.0.0", "v2")
    try:
        yield {
            "1.0.0": live_instance(admin, "1.0.0", "v1-"),
            "2.0.0": live_instance(admin, "2.0.0", "v2-"),
        }
    finally:
        one.stop()
        two.stop()


def test_a_target_runs_on_the_version_it_names(
    versions: dict[str, str], caller: httpx.Client
) -> None:
    tenant = tenant_of(caller)
    for target, version in [
        ("test-addr@2.0.0", "2.0.0"),
        ("test-addr@1.0.0", "1.0.0"),
        (f"agent://{tenant}/test-addr@2.0.0", "2.0.0"),
    ]:
        ran = Counter(run(caller, target=target)["agent"]["version"] for _ in range(6))
        assert ran == {version: 6}, target


@pytest.fixture(scope="module")
def unlimited_api(settings: Settings) -> Iterator[ServedApp]:
    """An API whose rate limit a thousand submits at once do not reach."""
    unlimited = settings.model_copy(update={"rate_limit_per_s": 1e6, "rate_limit_burst": 10**6})
    with ServedApp(create_app(unlimited)) as served:
        yield served


def test_channel_weights_split_a_thousand_tasks_within_the_noise(
    versions: dict[str, str],
    admin: httpx.Client,
    caller: httpx.Client,
    unlimited_api: ServedApp,
    engine: Engine,
) -> None:
    # Given a stable channel sending 90 % to 1.0.0 and 10 % to 2.0.0
    body = {"versions": {"1.0.0": 90, "2.0.0": 10}}
    answer = admin.put("/agents/test-addr/channels/stable", json=body)
    assert answer.status_code == 200, answer.text
    assert admin.get("/agents/test-addr").json()["channels"]["stable"]["versions"] == {
        "1.0.0": 90.0,
        "2.0.0": 10.0,
    }
    try:
        # When a thousand untargeted tasks are submitted
        n = 1000
        token = caller.headers["Authorization"].split()[1]
        envelopes: list[dict[str, object]] = [
            {"capability": CAPABILITY, "payload": {}} for _ in range(n)
        ]
        answers = asyncio.run(submit_many(unlimited_api, token, envelopes, concurrency=16))
        assert {a.status_code for a in answers} == {202}
        tenant = tenant_of(caller)
        done = select(func.count()).where(tasks.c.tenant == tenant, tasks.c.status == "succeeded")
        with engine.connect() as conn:
            eventually(
                lambda: conn.execute(done).scalar_one() == n, "all to succeed", timeout_s=120
            )
            ran = conn.execute(
                select(tasks.c.agent_version, tasks.c.queue, func.count())
                .where(tasks.c.tenant == tenant)
                .group_by(tasks.c.agent_version, tasks.c.queue)
            ).all()
    finally:
        assert admin.delete("/agents/test-addr/channels/stable").status_code == 204
    # Then each went to its version's queue and ran there, and 2.0.0 got 10 % within
    # 5 standard deviations of the binomial (sd = 9.5 tasks: 53 to 147)
    assert {(v, q) for v, q, _ in ran} <= {
        (v, card_queue(CAPABILITY, "test-addr", v)) for v in ("1.0.0", "2.0.0")
    }
    by_version = Counter({v: c for v, _, c in ran})
    sd = math.sqrt(n * 0.1 * 0.9)
    assert abs(by_version["2.0.0"] - n * 0.1) < 5 * sd, by_version


def test_a_canary_channel_target_routes_by_its_own_weights(
    versions: dict[str, str], admin: httpx.Client, caller: httpx.Client
) -> None:
    body = {"versions": {"2.0.0": 1}}
    assert admin.put("/agents/test-addr/channels/canary", json=body).status_code == 200
    ran = Counter(run(caller, target="test-addr@canary")["agent"]["version"] for _ in range(6))
    assert ran == {"2.0.0": 6}
    missing = caller.post(
        "/tasks", json={"capability": CAPABILITY, "payload": {}, "target": "test-addr@beta"}
    )
    assert missing.status_code == 404
    assert missing.json()["code"] == "channel_not_found"


def test_a_revoked_version_gets_no_traffic_and_its_lease_drops_it(
    versions: dict[str, str], admin: httpx.Client, caller: httpx.Client, redis_url: str
) -> None:
    # Given a canary channel that still names 2.0.0
    assert admin.put(
        "/agents/test-addr/channels/canary", json={"versions": {"1.0.0": 1, "2.0.0": 1}}
    ).is_success
    # When 2.0.0 is revoked
    answer = admin.post("/agents/test-addr/versions/2.0.0/revoke")
    assert answer.status_code == 200, answer.text
    assert answer.json()["lifecycle"] == "revoked"
    again = admin.post("/agents/test-addr/versions/2.0.0/revoke")
    assert again.json()["revoked_at"] == answer.json()["revoked_at"]
    # Then its instance's lease no longer lists it
    client = redis.Redis.from_url(redis_url)

    def versions_in_lease() -> set[str]:
        raw = client.get(lease_key(versions["2.0.0"]))
        return {c["version"] for c in json.loads(raw)["cards"]} if raw else set()

    eventually(lambda: "2.0.0" not in versions_in_lease(), "the lease to drop 2.0.0")
    # And no route picks it: untargeted, through a channel, or pinned (410)
    ran = Counter(run(caller)["agent"]["version"] for _ in range(20))
    ran += Counter(run(caller, target="test-addr@canary")["agent"]["version"] for _ in range(10))
    assert ran == {"1.0.0": 30}
    pinned = caller.post(
        "/tasks", json={"capability": CAPABILITY, "payload": {}, "target": "test-addr@2.0.0"}
    )
    assert pinned.status_code == 410
    assert pinned.json()["code"] == "version_revoked"
    # And /agents shows it revoked, and no channel may name it any more
    agent = caller.get("/agents/test-addr").json()
    lifecycle = {v["version"]: v["lifecycle"] for v in agent["versions"]}
    assert lifecycle["2.0.0"] == "revoked"
    assert {c["lifecycle"] for c in agent["cards"] if c["version"] == "2.0.0"} == {"revoked"}
    listed = next(a for a in admin.get("/agents").json()["agents"] if a["agent_id"] == "test-addr")
    assert {v["version"]: v["lifecycle"] for v in listed["versions"]}["2.0.0"] == "revoked"
    refused = admin.put("/agents/test-addr/channels/stable", json={"versions": {"2.0.0": 1}})
    assert refused.status_code == 422
    assert refused.json()["code"] == "channel_invalid"


def test_a_revocation_outlives_a_redis_that_lost_it(
    versions: dict[str, str],
    admin: httpx.Client,
    settings: Settings,
    log_dir: Path,
    redis_url: str,
) -> None:
    # Given 2.0.0 revoked, and Redis's copy of the revocation lost
    assert admin.post("/agents/test-addr/versions/2.0.0/revoke").status_code == 200
    client = redis.Redis.from_url(redis_url)
    client.srem(revocations.REVOKED_KEY, revocations.member("test-addr", "2.0.0"))
    # When a worker of 2.0.0 starts
    late = start_version(settings, log_dir, "2.0.0", "v2late")
    try:
        # Then it reads the revocation from Postgres and its lease never offers 2.0.0
        def its_lease() -> dict[str, Any] | None:
            keys = client.keys(f"{LEASE_PREFIX}v2late-*")
            raw = client.get(keys[0]) if keys else None
            return json.loads(raw) if raw else None

        lease = eventually(its_lease, "the late worker's lease")
        assert lease["cards"] == []
        assert "test-addr test.addr is revoked" in late.log_path.read_text()
        assert lease["instance"] not in redis_members(client, live_key(CAPABILITY))
    finally:
        late.stop()


def redis_members(client: redis.Redis, key: str) -> set[str]:
    return {m.decode() for m in client.zrange(key, 0, -1)}


# --- targets that cannot be used ---------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    ["test-addr", "test-addr@", "Test-addr@1.0.0", "test-addr@Canary", "agent://x", 7, ""],
)
def test_a_malformed_target_is_422(caller: httpx.Client, target: object) -> None:
    answer = caller.post("/tasks", json={"capability": CAPABILITY, "payload": {}, "target": target})
    assert answer.status_code == 422
    assert answer.json()["code"] in ({"envelope_invalid"} if target == 7 else {"target_invalid"})


def test_an_address_never_reaches_across_tenants(caller: httpx.Client) -> None:
    def submit(target: str) -> httpx.Response:
        return caller.post(
            "/tasks", json={"capability": CAPABILITY, "payload": {}, "target": target}
        )

    foreign = submit("agent://someone-else/test-addr@1.0.0")
    missing = submit("nobody-at-all@1.0.0")
    assert foreign.status_code == missing.status_code == 404
    assert foreign.json()["code"] == "agent_not_found"
    assert without_trace(foreign.json()) == without_trace(missing.json())


# --- visibility --------------------------------------------------------------------------------


def test_a_hidden_agent_is_404_to_other_tenants_exactly_like_a_missing_one(
    caller: httpx.Client, admin: httpx.Client, make_key: KeyMaker, api: ServedApp
) -> None:
    # Given test-hidden, whose card names only the tenant hidden-owner
    assert caller.get("/agents/test-hidden").status_code == 404
    hidden = caller.get("/agents/test-hidden").json()
    missing = caller.get("/agents/no-such-agent").json()
    assert without_trace(hidden) == without_trace(missing)
    listed = {a["agent_id"] for a in caller.get("/agents").json()["agents"]}
    assert "test-hidden" not in listed and "test-addr" in listed
    shown = {c["capability"] for c in caller.get("/capabilities").json()["capabilities"]}
    assert "test.hidden" not in shown and CAPABILITY in shown

    def submit(target: str) -> httpx.Response:
        return caller.post(
            "/tasks", json={"capability": "test.hidden", "payload": {}, "target": target}
        )

    by_hidden, by_missing = submit("test-hidden@1.0.0"), submit("no-such-agent@1.0.0")
    assert by_hidden.status_code == by_missing.status_code == 404
    assert without_trace(by_hidden.json()) == without_trace(by_missing.json())

    # The tenant it names sees it (without the list of tenants), and so do operators
    _, token = make_key(tenant="hidden-owner")
    with client_for(api, token) as owner:
        card = owner.get("/agents/test-hidden").json()["cards"][0]
        assert card["capability"] == "test.hidden" and "tenants" not in card
        assert "test.hidden" in {
            c["capability"] for c in owner.get("/capabilities").json()["capabilities"]
        }
        # a target it may use: nothing serves it live, so 503 (not 404)
        answer = owner.post(
            "/tasks",
            json={"capability": "test.hidden", "payload": {}, "target": "test-hidden@1.0.0"},
        )
        assert answer.status_code == 503
        assert answer.json()["code"] == "no_agent_available"
    assert admin.get("/agents/test-hidden").json()["cards"][0]["tenants"] == ["hidden-owner"]


def test_an_instance_and_a_channel_of_private_versions_are_shown_only_to_their_tenants(
    versions: dict[str, str],
    caller: httpx.Client,
    admin: httpx.Client,
    make_key: KeyMaker,
    api: ServedApp,
    settings: Settings,
    log_dir: Path,
) -> None:
    # Given test-addr 3.0.0, only for hidden-owner, on an instance of its own, in a channel
    # of its own and in one shared with the public 1.0.0
    private = start_version(settings, log_dir, "3.0.0", "v3", tenants="hidden-owner")
    try:
        instance = live_instance(admin, "3.0.0", "v3-")
        started_at = next(
            i["started_at"]
            for i in admin.get("/agents/test-addr").json()["instances"]
            if i["instance"] == instance
        )
        for channel, weights in [
            ("owner-canary", {"3.0.0": 1}),
            ("mixed", {"1.0.0": 1, "3.0.0": 1}),
        ]:
            answer = admin.put(f"/agents/test-addr/channels/{channel}", json={"versions": weights})
            assert answer.status_code == 200, answer.text
        # Then another tenant is shown neither the instance nor the private channel, and of
        # the shared channel only the public version
        for shown in (caller.get("/agents/test-addr").json(), agent_listed(caller, "test-addr")):
            assert {v["version"] for v in shown["versions"]} == {"1.0.0", "2.0.0"}
            assert shown["live_instances"] >= 1  # v1
            assert started_at not in {i["started_at"] for i in shown["instances"]}
            assert "owner-canary" not in shown["channels"]
            assert shown["channels"]["mixed"]["versions"] == {"1.0.0": 1.0}
        # While the tenant it names, and the operators, are shown all of it
        _, token = make_key(tenant="hidden-owner")
        with client_for(api, token) as owner:
            mine = owner.get("/agents/test-addr").json()
        everything = admin.get("/agents/test-addr").json()
        for shown in (mine, everything):
            assert started_at in {i["started_at"] for i in shown["instances"]}
            assert shown["channels"]["owner-canary"]["versions"] == {"3.0.0": 1.0}
            assert shown["channels"]["mixed"]["versions"] == {"1.0.0": 1.0, "3.0.0": 1.0}
        assert all("_serves" not in i for s in (mine, everything) for i in s["instances"])
    finally:
        for channel in ("owner-canary", "mixed"):
            admin.delete(f"/agents/test-addr/channels/{channel}")
        private.stop()


def test_a_private_versions_worker_runs_no_other_tenants_task_whatever_queue_brings_it(
    versions: dict[str, str],
    admin: httpx.Client,
    make_key: KeyMaker,
    api: ServedApp,
    settings: Settings,
    log_dir: Path,
    engine: Engine,
) -> None:
    # Given test-addr 9.0.0, private to one tenant, started with -Q test.addr as any worker,
    # beside the public 1.0.0 (and 2.0.0) of the module
    owner, _ = make_key()
    stranger, token = make_key()
    private = start_version(settings, log_dir, "9.0.0", "v9", tenants=owner)
    dispatcher = Dispatcher(settings)
    try:
        instance = live_instance(admin, "9.0.0", "v9-")
        own_queue = card_queue(CAPABILITY, "test-addr", "9.0.0")
        # Then it does not take from the capability's queue, where any tenant's task may wait
        assert consumed_queues(settings)[instance] == {own_queue, f"{own_queue}@{instance}"}

        def sent(tenant: str, queue: str) -> uuid.UUID:
            task_id = a_task_row(engine, tenant=tenant, capability=CAPABILITY)
            send_run(dispatcher.app, task_id, queue, trace_id=uuid.uuid4().hex, tenant=tenant)
            return task_id

        with client_for(api, token) as http:
            # And a stranger's task on its card's queue (its tenants changed after routing)
            # fails there, never run and no agent shown, while its owner's runs
            refused, owned = sent(stranger, own_queue), sent(owner, own_queue)
            failed = wait_for_task(http, str(refused), FINAL)
            assert (failed["status"], failed["error"]["code"]) == ("failed", "agent_not_found")
            assert failed["agent"] is None
        assert task_row(engine, owned, FINAL)["agent_version"] == "9.0.0"
        # And told to consume the capability's queue after all (an operator's broadcast
        # add_consumer), it still runs none of a stranger's tasks: each goes back to the
        # queue until a public version takes it
        celery_command(settings, "control", "add_consumer", CAPABILITY, "-d", instance)
        eventually(lambda: CAPABILITY in consumed_queues(settings)[instance], "the new consumer")
        strangers = [sent(stranger, CAPABILITY) for _ in range(12)]
        ran_by = Counter(task_row(engine, t, FINAL)["agent_version"] for t in strangers)
        assert set(ran_by) <= {"1.0.0", "2.0.0"} and sum(ran_by.values()) == 12
        assert "of a tenant this card does not admit; put back" in private.output()
    finally:
        dispatcher.close()
        private.stop()


def task_row(engine: Engine, task_id: uuid.UUID, statuses: set[str]) -> dict[str, Any]:
    """The task's row once its status is one of ``statuses``."""

    def read() -> dict[str, Any] | None:
        with engine.connect() as conn:
            row = conn.execute(select(tasks).where(tasks.c.id == task_id)).first()
        return dict(row._mapping) if row is not None and row.status in statuses else None

    return eventually(read, f"task {task_id} in one of {sorted(statuses)}")


def agent_listed(http: httpx.Client, agent_id: str) -> dict[str, Any]:
    """The agent as ``GET /agents`` lists it to this key."""
    return next(a for a in http.get("/agents").json()["agents"] if a["agent_id"] == agent_id)


# --- who may set channels and revoke -------------------------------------------------------------


def test_only_operators_set_channels_and_revoke_and_bad_input_is_4xx(
    caller: httpx.Client, admin: httpx.Client
) -> None:
    body = {"versions": {"1.0.0": 1}}
    for answer in (
        caller.put("/agents/test-addr/channels/stable", json=body),
        caller.delete("/agents/test-addr/channels/stable"),
        caller.post("/agents/test-addr/versions/1.0.0/revoke"),
    ):
        assert answer.status_code == 403
        assert answer.json()["code"] == "admin_required"
    for path, sent, status, code in [
        ("/agents/test-addr/channels/Bad", body, 422, "channel_invalid"),
        ("/agents/test-addr/channels/1.0", body, 422, "channel_invalid"),
        ("/agents/test-addr/channels/beta", {"versions": {"1.0.0": -1}}, 422, "channel_invalid"),
        ("/agents/test-addr/channels/beta", {"versions": {"9.9.9": 1}}, 422, "channel_invalid"),
        ("/agents/test-addr/channels/beta", {"weights": {}}, 422, "channel_invalid"),
        ("/agents/no-such-agent/channels/beta", body, 404, "agent_not_found"),
    ]:
        answer = admin.put(path, json=sent)
        assert (answer.status_code, answer.json()["code"]) == (status, code), path
    gone = admin.delete("/agents/test-addr/channels/never-set")
    assert (gone.status_code, gone.json()["code"]) == (404, "channel_not_found")
    unknown = admin.post("/agents/test-addr/versions/9.9.9/revoke")
    assert (unknown.status_code, unknown.json()["code"]) == (404, "version_not_found")


def test_a_task_one_instance_refuses_goes_to_another_of_its_version_that_admits_it(
    versions: dict[str, str],
    admin: httpx.Client,
    make_key: KeyMaker,
    api: ServedApp,
    settings: Settings,
    log_dir: Path,
    engine: Engine,
) -> None:
    """While a change of a version's ``tenants`` rolls out, its instances disagree: one that
    refused a task on the card's queue failed it, though another would run it."""
    # Given two instances of test-addr 9.1.0, one private to the owner, one to both tenants
    owner, _ = make_key()
    stranger, _ = make_key()
    narrow = start_version(settings, log_dir, "9.1.0", "narrow", tenants=owner)
    wide = start_version(settings, log_dir, "9.1.0", "wide", tenants=f"{owner},{stranger}")
    dispatcher = Dispatcher(settings)
    try:
        live_instance(admin, "9.1.0", "narrow-")
        live_instance(admin, "9.1.0", "wide-")
        own_queue = card_queue(CAPABILITY, "test-addr", "9.1.0")
        # When the stranger's tasks reach the card's queue, which both take from
        strangers = []
        for _ in range(10):
            task_id = a_task_row(engine, tenant=stranger, capability=CAPABILITY)
            send_run(dispatcher.app, task_id, own_queue, trace_id=uuid.uuid4().hex, tenant=stranger)
            strangers.append(task_id)
        # Then each runs on the instance that admits it, none failed
        ran = [task_row(engine, t, FINAL) for t in strangers]
        assert {(r["status"], (r["instance"] or "").split("-")[0]) for r in ran} == {
            ("succeeded", "wide")
        }
    finally:
        narrow.stop()
        wide.stop()
