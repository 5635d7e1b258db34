"""Delivery guarantees with real processes: idempotency, retries, deadlines, cancellation,
back-pressure, and nothing lost when workers die or the broker forgets."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from sqlalchemy import Engine, func, select, text

from api.app import create_app
from broker.db.models import tasks_table
from broker.settings import Settings
from broker.tasks import events
from broker.tasks.dispatch import Dispatcher, redis_lists, send_run
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for, count_tasks
from tests.integration.rows import a_task_row
from tests.integration.stack import CeleryProcess, ServedApp, start_worker, wait_for_task

FINAL = {"succeeded", "failed", "cancelled", "expired"}


def deadline_of(engine: Engine, task_id: str) -> datetime:
    query = select(tasks_table.c.deadline_at).where(tasks_table.c.id == uuid.UUID(task_id))
    with engine.connect() as conn:
        deadline_at: datetime = conn.execute(query).scalar_one()
    return deadline_at


def runs(redis_url: str, task_id: str) -> int:
    return int(redis.Redis.from_url(redis_url).get(f"reach:test:runs:{task_id}") or 0)


# -- idempotency ------------------------------------------------------------------------


def test_100_concurrent_submits_with_one_key_make_one_task(
    api: ServedApp, tenant: tuple[str, str], engine: Engine, worker: CeleryProcess
) -> None:
    async def submit_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=api.url,
            timeout=60,
            headers={"Authorization": f"Bearer {tenant[1]}", "Idempotency-Key": "order-1"},
        ) as http:
            return await asyncio.gather(
                *(
                    http.post("/tasks", json={"capability": "echo", "payload": {"o": 1}})
                    for _ in range(100)
                )
            )

    responses = asyncio.run(submit_all())
    assert {r.status_code for r in responses} == {202}
    assert len({r.json()["task_id"] for r in responses}) == 1
    assert sum("idempotent-replayed" not in r.headers for r in responses) == 1
    assert count_tasks(engine, tenant[0]) == 1


# -- retries ----------------------------------------------------------------------------


def test_a_retryable_failure_runs_again_until_it_succeeds(client: httpx.Client) -> None:
    task = client.post(
        "/tasks", json={"capability": "test.flaky", "payload": {"fail_times": 2}}
    ).json()
    done = wait_for_task(client, task["task_id"], FINAL)
    assert done["status"] == "succeeded"
    assert done["attempts"] == 3
    assert done["result"] == {"attempt": 3}
    assert done["error"] is None


def test_a_retry_asked_for_after_a_delay_given_as_text_runs_again(client: httpx.Client) -> None:
    """``Retryable(delay_s="0.05")`` (a ``Retry-After`` passed on as it came) raised after
    the run: the task was left running, then ended ``worker_lost``, never retried."""
    payload = {"fail_times": 1, "delay_s": "0.05"}
    task = client.post("/tasks", json={"capability": "test.flaky", "payload": payload}).json()
    done = wait_for_task(client, task["task_id"], FINAL)
    assert (done["status"], done["attempts"], done["result"]) == ("succeeded", 2, {"attempt": 2})


def test_a_copy_of_a_retrys_message_does_not_cut_its_back_off_short(
    client: httpx.Client,
    engine: Engine,
    settings: Settings,
    tenant: tuple[str, str],
    worker: CeleryProcess,
) -> None:
    """A sweep's copy of a countdown a busy prefork worker held (or any redelivery) was
    claimed at once, and the agent's next attempt came with no wait at all."""
    # Given a task whose agent failed it and asked for 3 s before the next attempt
    payload = {"fail_times": 1, "delay_s": 3}
    task_id = client.post("/tasks", json={"capability": "test.flaky", "payload": payload}).json()[
        "task_id"
    ]
    row = select(tasks_table).where(tasks_table.c.id == uuid.UUID(task_id))

    def waiting_for_its_retry() -> bool:
        with engine.connect() as conn:
            found = conn.execute(row).one()
        return found.status == "queued" and found.attempts == 1

    eventually(waiting_for_its_retry, "the first attempt failed, the retry waiting")
    # When a copy of its message comes at once
    dispatcher = Dispatcher(settings)
    try:
        send_run(dispatcher.app, task_id, "test.flaky", trace_id=uuid.uuid4().hex, tenant=tenant[0])
        done = wait_for_task(client, task_id, FINAL)
    finally:
        dispatcher.close()
    # Then the second attempt started once its retry was due, and it ran once
    assert (done["status"], done["attempts"], done["result"]) == ("succeeded", 2, {"attempt": 2})
    with engine.connect() as conn:
        found = conn.execute(row).one()
    assert found.started_at >= found.retry_at


def test_retries_stop_at_the_envelopes_max_attempts(client: httpx.Client) -> None:
    task = client.post(
        "/tasks", json={"capability": "test.flaky", "max_attempts": 2, "payload": {"fail_times": 9}}
    ).json()
    done = wait_for_task(client, task["task_id"], FINAL)
    assert done["status"] == "failed"
    assert done["attempts"] == 2
    assert done["error"]["code"] == "upstream_busy"
    assert done["error"]["retryable"] is True


def test_a_transient_error_is_retried_up_to_the_cards_limit(client: httpx.Client) -> None:
    task = client.post(
        "/tasks", json={"capability": "test.flaky-io", "max_attempts": 9, "payload": {}}
    ).json()
    done = wait_for_task(client, task["task_id"], FINAL)
    assert done["status"] == "failed"
    assert done["attempts"] == 2  # the card allows 2
    assert done["error"]["code"] == "transient_error"


def test_a_non_retryable_failure_fails_at_once(client: httpx.Client) -> None:
    task = client.post(
        "/tasks", json={"capability": "echo", "max_attempts": 5, "payload": {"fail": "bad_input"}}
    ).json()
    done = wait_for_task(client, task["task_id"], FINAL)
    assert (done["status"], done["attempts"]) == ("failed", 1)
    assert done["error"]["code"] == "bad_input"
    assert done["error"]["retryable"] is False


# -- deadlines --------------------------------------------------------------------------


def test_a_task_not_started_before_its_deadline_expires_without_running(
    client: httpx.Client,
    settings: Settings,
    log_dir: Path,
    engine: Engine,
    system_beat: CeleryProcess,
) -> None:
    response = client.post(
        "/tasks",
        json={
            "capability": "test.late",
            "payload": {},
            "queue_if_unavailable": True,
            "deadline_ms": 300,
        },
    )
    task_id = response.json()["task_id"]
    deadline_at = deadline_of(engine, task_id)
    eventually(lambda: datetime.now(UTC) > deadline_at, "its deadline past, nobody serving")
    late = start_worker(settings, "test.late", "late-deadline", log_dir)
    try:
        done = wait_for_task(client, task_id, FINAL)
    finally:
        late.stop()
    assert done["status"] == "expired"
    assert done["error"]["code"] == "deadline_exceeded"
    assert done["started_at"] is None


def test_a_handler_past_its_deadline_is_stopped_and_expired(
    client: httpx.Client, redis_url: str
) -> None:
    task = client.post(
        "/tasks",
        # Long enough that a busy CI worker still claims it in time: a claim after the
        # deadline ends it `deadline_exceeded` without running, which is another test's case.
        json={"capability": "test.stubborn", "deadline_ms": 3000, "payload": {"sleep_s": 10}},
    ).json()
    done = wait_for_task(client, task["task_id"], FINAL)
    assert done["started_at"] is not None
    assert done["status"] == "expired"
    assert done["error"]["code"] == "timeout"
    # Stopped at the deadline, not run to its end and ended late
    assert slept(redis_url, task["task_id"]) == "SoftTimeLimit"


def test_a_handler_past_its_cards_timeout_is_stopped_and_expired(
    client: httpx.Client, redis_url: str
) -> None:
    task = client.post("/tasks", json={"capability": "test.short-fuse", "payload": {}}).json()
    done = wait_for_task(client, task["task_id"], FINAL)
    assert (done["status"], done["error"]["code"]) == ("expired", "timeout")
    assert slept(redis_url, task["task_id"]) == "SoftTimeLimit"


def slept(redis_url: str, task_id: str) -> str | None:
    """How the test handler's sleep ended: ``finished`` or the exception that stopped it."""
    value = redis.Redis.from_url(redis_url).get(f"reach:test:slept:{task_id}")
    return None if value is None else value.decode()


def test_the_hard_limit_stays_below_the_redis_visibility_timeout() -> None:
    from broker.tasks.dispatch import VISIBILITY_TIMEOUT_S
    from workers.application import hard_time_limit_s
    from workers.sdk.agent import AgentRegistry

    registry = AgentRegistry()
    registry.capability("slow.one", agent_id="slow", timeout_s=600)(lambda ctx, p: p)
    assert hard_time_limit_s(Settings(), registry) < VISIBILITY_TIMEOUT_S
    registry.capability("slow.two", agent_id="slower", timeout_s=VISIBILITY_TIMEOUT_S)(
        lambda ctx, p: p
    )
    with pytest.raises(RuntimeError, match="visibility timeout"):
        hard_time_limit_s(Settings(), registry)


# -- cancellation -----------------------------------------------------------------------


def test_cancelling_a_queued_task_means_it_never_runs(
    client: httpx.Client, settings: Settings, log_dir: Path
) -> None:
    task_id = client.post(
        "/tasks", json={"capability": "test.late", "payload": {}, "queue_if_unavailable": True}
    ).json()["task_id"]
    cancelled = client.post(f"/tasks/{task_id}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled"
    late = start_worker(settings, "test.late", "late-cancel", log_dir)
    try:
        eventually(
            lambda: "skipped" in late.output() or "not queued" in late.output(),
            "the worker to skip the cancelled task",
        )
    finally:
        late.stop()
    task = client.get(f"/tasks/{task_id}").json()
    assert (task["status"], task["started_at"]) == ("cancelled", None)


def test_a_running_task_is_told_and_ends_cancelled(
    client: httpx.Client, redis_url: str, worker: CeleryProcess
) -> None:
    task_id = client.post(
        "/tasks", json={"capability": "test.sleepy", "payload": {"sleep_s": 20}}
    ).json()["task_id"]
    eventually(lambda: client.get(f"/tasks/{task_id}").json()["status"] == "running", "running")
    assert client.post(f"/tasks/{task_id}/cancel").json()["status"] == "cancelled"
    events = client.get(f"/tasks/{task_id}/events").text
    assert "event: cancelled" in events
    # The handler sees ctx.cancelled and returns; its result changes nothing
    returned = f"reach.run[{task_id}] succeeded in"
    eventually(lambda: returned in worker.output(), "the handler returned")
    [line] = [line for line in worker.output().splitlines() if returned in line]
    assert "'skipped'" in line
    assert client.get(f"/tasks/{task_id}").json()["status"] == "cancelled"
    assert runs(redis_url, task_id) == 1


def test_a_cancellable_agent_is_stopped_and_the_worker_serves_on(
    client: httpx.Client, redis_url: str, worker: CeleryProcess
) -> None:
    # Given a cancellable agent that ignores cancellation, running in a pool process
    task_id = client.post(
        "/tasks", json={"capability": "test.stubborn", "payload": {"sleep_s": 30}}
    ).json()["task_id"]
    pid = eventually(
        lambda: redis.Redis.from_url(redis_url).get(f"reach:test:pid:{task_id}"),
        "the handler to start and record its process",
    )
    assert client.get(f"/tasks/{task_id}").json()["status"] == "running"
    # When it is cancelled
    assert client.post(f"/tasks/{task_id}/cancel").json()["status"] == "cancelled"
    # Then the worker terminates this task's run, and the process running its handler is gone
    eventually(
        lambda: f"Terminating {task_id}" in worker.output(),
        "the worker to terminate this task's run",
    )
    eventually(lambda: not alive(int(pid)), "the handler's process to end")
    assert f"reach.run[{task_id}] succeeded" not in worker.output()
    # And the worker serves on: as many tasks as it has processes, and more, all succeed
    concurrency = int(worker.args[worker.args.index("-c") + 1])
    after = [
        client.post("/tasks", json={"capability": "echo", "payload": {"next": i}}).json()
        for i in range(2 * concurrency)
    ]
    for task in after:
        assert wait_for_task(client, task["task_id"], FINAL)["status"] == "succeeded"
    # And the stopped task stays cancelled, its handler started once and never again
    assert client.get(f"/tasks/{task_id}").json()["status"] == "cancelled"
    assert runs(redis_url, task_id) == 1
    assert f"reach.run[{task_id}] succeeded" not in worker.output()


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_cancelling_a_final_task_is_409_and_a_foreign_one_404(
    client: httpx.Client, api: ServedApp, make_key: KeyMaker
) -> None:
    task_id = client.post("/tasks", json={"capability": "echo", "payload": {}}).json()["task_id"]
    wait_for_task(client, task_id, FINAL)
    again = client.post(f"/tasks/{task_id}/cancel")
    assert (again.status_code, again.json()["code"]) == (409, "task_final")
    _, stranger = make_key()
    with client_for(api, stranger) as http:
        assert http.post(f"/tasks/{task_id}/cancel").status_code == 404


# -- back-pressure ----------------------------------------------------------------------


@pytest.fixture
def strict_api(settings: Settings, worker: CeleryProcess) -> Iterator[ServedApp]:
    # One tenant may fill these queues: these tests are of the rate and the depth bound.
    tight = settings.model_copy(
        update={
            "rate_limit_per_s": 2,
            "rate_limit_burst": 3,
            "max_queue_depth": 3,
            "max_queue_share": 1.0,
        }
    )
    app = create_app(tight)
    # Depths read from the broker on every submit (in service: at most once a second), so
    # each submit below sees the ones before it
    app.state.services.queue_bound.refresh_s = 0
    app.state.services.queue_bound.stale_s = 0
    with ServedApp(app) as served:
        yield served


def test_a_tenant_over_its_rate_gets_429_and_others_do_not(
    strict_api: ServedApp, make_key: KeyMaker, engine: Engine
) -> None:
    flooder, flood_key = make_key()
    calm, calm_key = make_key()
    with client_for(strict_api, flood_key) as http:
        codes = [http.post("/tasks", json={"capability": "echo", "payload": {}}) for _ in range(10)]
    limited = [r for r in codes if r.status_code == 429]
    assert limited and limited[0].json()["code"] == "rate_limited"
    assert int(limited[0].headers["retry-after"]) >= 1
    assert count_tasks(engine, flooder) == sum(r.status_code == 202 for r in codes) <= 4
    with client_for(strict_api, calm_key) as http:
        assert http.post("/tasks", json={"capability": "echo", "payload": {}}).status_code == 202
    assert count_tasks(engine, calm) == 1


def test_a_full_queue_gets_503_overloaded_without_using_the_idempotency_key(
    strict_api: ServedApp, make_key: KeyMaker, engine: Engine
) -> None:
    tenants = [make_key() for _ in range(5)]  # one request each: no rate limit in the way
    answers = []
    for _, key in tenants:
        with client_for(strict_api, key) as http:
            answers.append(
                http.post(
                    "/tasks",
                    json={
                        "capability": "test.nobody-fills",  # its queue empty until now
                        "payload": {},
                        "queue_if_unavailable": True,
                        "idempotency_key": "k-1",
                    },
                )
            )
    refused = [a for a in answers if a.status_code == 503]
    assert refused and refused[0].json()["code"] == "overloaded"
    assert "retry-after" in refused[0].headers
    assert sum(a.status_code == 202 for a in answers) == 3
    refused_tenant = tenants[answers.index(refused[0])][0]
    assert count_tasks(engine, refused_tenant) == 0  # the key k-1 is still free for it


def test_a_tenant_holding_its_share_of_a_queue_gets_429_and_another_still_gets_in(
    settings: Settings, make_key: KeyMaker, engine: Engine
) -> None:
    shared = settings.model_copy(update={"max_queue_depth": 4, "max_queue_share": 0.5})
    app = create_app(shared)
    app.state.services.queue_bound.refresh_s = 0  # each submit sees the ones before it
    app.state.services.queue_bound.stale_s = 0
    hog, hog_key = make_key()
    other, other_key = make_key()

    def submit(served: ServedApp, key: str, n: int) -> httpx.Response:
        document = {
            "capability": "test.nobody-shares",  # its queue empty until now, and not consumed
            "payload": {},
            "queue_if_unavailable": True,
            "idempotency_key": f"k-{n}",
        }
        with client_for(served, key) as http:
            return http.post("/tasks", json=document)

    with ServedApp(app) as served:
        hogged = [submit(served, hog_key, n) for n in range(4)]
        others = [submit(served, other_key, n) for n in range(3)]
    # The hog got the queue's share (2 of 4), then 429 with nothing written
    assert [a.status_code for a in hogged] == [202, 202, 429, 429]
    assert hogged[2].json()["code"] == "too_many_queued"
    assert int(hogged[2].headers["retry-after"]) >= 1
    assert count_tasks(engine, hog) == 2
    # The other tenant filled the rest of the queue, then met its bound
    assert [a.status_code for a in others] == [202, 202, 503]
    assert others[2].json()["code"] == "overloaded"
    assert count_tasks(engine, other) == 2


def test_a_tenants_waiting_session_turns_count_in_its_share_of_a_quiet_queue(
    settings: Settings, make_key: KeyMaker, engine: Engine, redis_url: str
) -> None:
    """A turn waiting for the turn before it holds no message (its worker drops the one its
    submit sent), so the queue looks empty however many wait. Uncounted, a tenant parked
    more than its share there and let them go together by cancelling the turns before them:
    the queue went past its bound and every other tenant's submit to it was refused 503."""
    shared = settings.model_copy(update={"max_queue_depth": 4, "max_queue_share": 0.5})
    app = create_app(shared)
    app.state.services.queue_bound.refresh_s = 0  # each submit sees the ones before it
    app.state.services.queue_bound.stale_s = 0
    broker = redis.Redis.from_url(redis_url)
    parked = redis_lists("test.nobody-parks")  # its queue empty until now, and not consumed
    hog, hog_key = make_key()
    _, other_key = make_key()
    firsts, seconds = [], []
    with ServedApp(app) as served, client_for(served, hog_key) as http:
        for n in range(3):
            session_id = http.post("/sessions", json={}).json()["session_id"]
            for capability, answers in (
                (f"test.nobody-first-{n % 2}", firsts),  # its turn waits here, first
                ("test.nobody-parks", seconds),  # so this one waits for it
            ):
                envelope = {"capability": capability, "payload": {}, "session_id": session_id}
                answers.append(http.post("/tasks", json={**envelope, "queue_if_unavailable": True}))
            broker.delete(*parked)  # as a worker drops a turn's message while the turn waits
        # When the hog's turns before its waiting ones are cancelled
        for first in firsts:
            assert http.post(f"/tasks/{first.json()['task_id']}/cancel").status_code == 200
        released = sum(int(broker.llen(key)) for key in parked)
        with client_for(served, other_key) as other:
            theirs = other.post(
                "/tasks",
                json={
                    "capability": "test.nobody-parks",
                    "payload": {},
                    "queue_if_unavailable": True,
                },
            )
    broker.delete(*parked)
    # Then the hog parked its share (2 of 4) and no more, though the queue held none
    assert [a.status_code for a in firsts] == [202, 202, 202]
    assert [a.status_code for a in seconds] == [202, 202, 429], seconds[2].text
    assert seconds[2].json()["code"] == "too_many_queued"
    assert count_tasks(engine, hog) == 5
    # and the other tenant still got in once they were let go
    assert released == 2
    assert theirs.status_code == 202, theirs.text


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_tenant_past_its_fair_slice_of_a_queue_waits_behind_another_tenants_tasks(
    pool: str, settings: Settings, make_key: KeyMaker, engine: Engine, log_dir: Path
) -> None:
    capability = f"test.fair-{pool}"  # no worker takes from its queue until all are in
    app = create_app(settings.model_copy(update={"queue_fair_slice": 3}))
    app.state.services.queue_bound.refresh_s = 0  # each submit sees the ones before it
    app.state.services.queue_bound.stale_s = 0
    hog, hog_key = make_key()
    calm, calm_key = make_key()
    document = {"capability": capability, "payload": {}, "queue_if_unavailable": True}
    with ServedApp(app) as served:
        with client_for(served, hog_key) as http:
            hogs = [http.post("/tasks", json=document) for _ in range(8)]
        with client_for(served, calm_key) as http:
            calms = [http.post("/tasks", json=document) for _ in range(2)]
    assert [a.status_code for a in hogs + calms] == [202] * 10
    ids = [uuid.UUID(a.json()["task_id"]) for a in hogs + calms]
    mine = tasks_table.c.id.in_(ids)

    def succeeded() -> int:
        with engine.connect() as conn:
            done = select(func.count()).where(mine, tasks_table.c.status == "succeeded")
            return int(conn.execute(done).scalar_one())

    worker = start_worker(settings, capability, f"fair-{pool}", log_dir, concurrency=1, pool=pool)
    try:
        eventually(lambda: succeeded() == 10, "all ten succeeded")
    finally:
        worker.stop()
    with engine.connect() as conn:
        ran = conn.execute(
            select(tasks_table.c.tenant).where(mine).order_by(tasks_table.c.started_at)
        ).scalars()
        order = [{hog: "hog", calm: "calm"}[tenant] for tenant in ran]
    # The hog's first three went in before the queue held its slice of 3; then the calm
    # tenant's two go before the hog's other five (first come, first served: after them all)
    assert order == ["hog"] * 3 + ["calm"] * 2 + ["hog"] * 5


# -- nothing lost -----------------------------------------------------------------------


@pytest.fixture
def crash_worker(settings: Settings, log_dir: Path) -> Iterator[list[CeleryProcess]]:
    """Workers for the slow and poison capabilities, started by the test, all stopped after."""
    started: list[CeleryProcess] = []
    yield started
    for process in started:
        process.stop()


def start_crash_worker(
    settings: Settings, log_dir: Path, started: list[CeleryProcess], name: str
) -> CeleryProcess:
    process = start_worker(
        settings,
        "test.slow-idem,test.slow-once,test.poison,echo",
        f"{name}-{uuid.uuid4().hex[:6]}",
        log_dir,
        concurrency=2,
    )
    started.append(process)
    return process


def test_kill_9_mid_task_reruns_an_idempotent_task_and_never_a_non_idempotent_one(
    client: httpx.Client,
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    crash_worker: list[CeleryProcess],
    system_beat: CeleryProcess,
) -> None:
    doomed = start_crash_worker(settings, log_dir, crash_worker, "doomed")
    idem = client.post(
        "/tasks", json={"capability": "test.slow-idem", "payload": {"sleep_s": 3}}
    ).json()["task_id"]
    once = client.post(
        "/tasks", json={"capability": "test.slow-once", "payload": {"sleep_s": 3}}
    ).json()["task_id"]
    eventually(lambda: runs(redis_url, idem) == 1 and runs(redis_url, once) == 1, "both started")
    doomed.kill_hard()
    start_crash_worker(settings, log_dir, crash_worker, "rescuer")

    lost = wait_for_task(client, once, FINAL)
    assert (lost["status"], lost["error"]["code"]) == ("failed", "worker_lost")
    redone = wait_for_task(client, idem, FINAL)
    assert redone["status"] == "succeeded"
    assert redone["attempts"] == 2
    assert runs(redis_url, idem) == 2  # ran again after the crash, completed once
    assert runs(redis_url, once) == 1  # never twice


def signal_family(process: CeleryProcess, signum: int) -> None:
    """``signum`` to the worker and every process under it."""
    for pid in [process.pid, *(c.pid for c in psutil.Process(process.pid).children(True))]:
        os.kill(pid, signum)


def test_a_late_write_of_an_attempt_taken_for_lost_changes_nothing(
    client: httpx.Client,
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    crash_worker: list[CeleryProcess],
    system_beat: CeleryProcess,  # the reaper
) -> None:
    """A worker that stops answering (paused, or cut off from Redis) loses its lease, and the
    reaper gives its idempotent task to another worker. When the first one wakes, its
    attempt is stale: its outcome must not end the task the second attempt is running, and
    its progress and outputs must not reach the task or its stream."""
    capability = "test.stale-attempt"
    stale = start_worker(settings, capability, f"stale-{uuid.uuid4().hex[:6]}", log_dir)
    crash_worker.append(stale)
    task_id = client.post(
        "/tasks", json={"capability": capability, "payload": {"first_s": 2, "later_s": 6}}
    ).json()["task_id"]
    eventually(lambda: runs(redis_url, task_id) == 1, "the first attempt to start")
    # Given the first attempt's worker paused until the reaper requeues its task, and the
    # second attempt running on another worker
    signal_family(stale, signal.SIGSTOP)
    try:
        fresh = start_worker(settings, capability, f"fresh-{uuid.uuid4().hex[:6]}", log_dir)
        crash_worker.append(fresh)
        eventually(lambda: runs(redis_url, task_id) == 2, "the second attempt to start", 30)
    finally:
        signal_family(stale, signal.SIGCONT)
    # When the first attempt wakes, reports progress and an output, and fails, while the
    # second is still running
    stale_done = f"reach:test:stale-done:{task_id}"
    eventually(lambda: redis.Redis.from_url(redis_url).exists(stale_done), "the stale failure")
    running = client.get(f"/tasks/{task_id}").json()
    assert (running["status"], running["progress"]) == (
        "running",
        {"percent": 10, "message": "attempt 2 began"},
    )
    # Then the task is the second attempt's: running, then succeeded
    done = wait_for_task(client, task_id, FINAL)
    assert (done["status"], done["error"], done["result"]) == ("succeeded", None, {"attempt": 2})
    assert done["attempts"] == 2
    assert done["agent"]["instance"].startswith("fresh-")
    # And its stream holds each attempt's own events, the stale attempt's late ones refused
    log = events.read_log_sync(redis.Redis.from_url(redis_url), task_id)
    reported = [
        e.data["message"] if e.type == "progress" else e.data
        for e in log
        if e.type in ("progress", "output")
    ]
    assert reported == [
        "attempt 1 began",
        {"attempt": 1, "at": "start"},
        "attempt 2 began",
        {"attempt": 2, "at": "start"},
    ]
    assert log[-1].type == "succeeded"


def test_a_poison_task_fails_after_its_attempts_and_the_queue_keeps_flowing(
    client: httpx.Client,
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    crash_worker: list[CeleryProcess],
    system_beat: CeleryProcess,
) -> None:
    start_crash_worker(settings, log_dir, crash_worker, "poisoned")
    poison = client.post("/tasks", json={"capability": "test.poison", "payload": {}}).json()[
        "task_id"
    ]
    others = [
        client.post("/tasks", json={"capability": "echo", "payload": {"i": i}}).json()["task_id"]
        for i in range(5)
    ]
    done = wait_for_task(client, poison, FINAL, timeout_s=60)
    assert (done["status"], done["error"]["code"]) == ("failed", "worker_lost")
    assert runs(redis_url, poison) == 2  # the card allows 2 attempts, then no more
    assert {wait_for_task(client, t, FINAL)["status"] for t in others} == {"succeeded"}


def test_a_task_accepted_but_never_published_is_swept_and_runs(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str], system_beat: CeleryProcess
) -> None:
    # Given a row the API committed before dying, without publishing its message
    task_id = a_task_row(
        engine, tenant=tenant[0], payload={"swept": True}, age=timedelta(minutes=1)
    )
    # Then the sweeper publishes it again and it runs
    done = wait_for_task(client, str(task_id), FINAL)
    assert (done["status"], done["result"]) == ("succeeded", {"swept": True})


def test_another_tenants_backlog_does_not_hide_a_lost_task_from_the_sweeper(
    client: httpx.Client, engine: Engine, tenant: tuple[str, str], system_beat: CeleryProcess
) -> None:
    # Given another tenant with more stale queued tasks than a sweep's batch (1,000), all
    # older than ours, on a capability nobody serves
    hog = f"hog-{uuid.uuid4().hex[:8]}"
    queued_rows(engine, tenant=hog, capability="test.nobody-sweeps", count=1100, age_s=600)
    try:
        # When our task's message is lost
        task_id = a_task_row(
            engine, tenant=tenant[0], payload={"behind": "a backlog"}, age=timedelta(minutes=1)
        )
        # Then the sweeper still publishes it again and it runs
        done = wait_for_task(client, str(task_id), FINAL, timeout_s=60)
    finally:
        with engine.begin() as conn:
            conn.execute(tasks_table.delete().where(tasks_table.c.tenant == hog))
    assert (done["status"], done["result"]) == ("succeeded", {"behind": "a backlog"})


def test_a_lost_task_in_a_queue_where_other_messages_wait_is_published_again(
    engine: Engine, settings: Settings, tenant: tuple[str, str], system_beat: CeleryProcess
) -> None:
    """The sweeper took a queue holding messages to hold the lost task's too: a tenant
    keeping a queue busy delayed another's lost task until the queue drained."""
    queue = f"test.busy-{uuid.uuid4().hex[:8]}"
    dispatcher = Dispatcher(settings)
    broker = redis.Redis.from_url(settings.celery_broker_url)
    task_id = None
    try:
        # Given a queue nobody serves, where another task's message waits
        waiting = uuid.uuid4()
        send_run(dispatcher.app, waiting, queue, trace_id=uuid.uuid4().hex, tenant=tenant[0])
        # When a task of that queue, accepted a minute ago, has lost its message
        task_id = a_task_row(engine, tenant=tenant[0], capability=queue, age=timedelta(minutes=1))
        # Then the sweeper publishes it again, beside the message that waits
        seen = eventually(
            lambda: _ids_waiting(broker, queue),
            "the lost task's message published again",
            until=lambda ids: str(task_id) in ids,
        )
        assert {str(task_id), str(waiting)} <= seen
    finally:
        broker.delete(*redis_lists(queue))
        broker.close()
        dispatcher.close()
        if task_id is not None:
            with engine.begin() as conn:
                conn.execute(tasks_table.delete().where(tasks_table.c.id == task_id))


def _ids_waiting(broker: redis.Redis, queue: str) -> set[str]:
    """The task ids of the messages in ``queue``'s lists, as a worker would read them."""
    raws = [raw for key in redis_lists(queue) for raw in broker.lrange(key, 0, -1)]
    return {json.loads(raw)["headers"]["id"] for raw in raws}


def queued_rows(engine: Engine, *, tenant: str, capability: str, count: int, age_s: int) -> None:
    """``count`` queued tasks of ``tenant`` created ``age_s`` ago and after, in one statement,
    with no message anywhere."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tasks (id, tenant, capability, queue, status, payload,"
                " payload_digest, payload_size, trace_id, result_ttl_s, created_at, expires_at)"
                " SELECT gen_random_uuid(), :tenant, :capability, :capability, 'queued', '{}',"
                " '', 2, md5(i::text), 600, now() - make_interval(secs => :age_s - i / 100.0),"
                " now() + interval '10 minutes' FROM generate_series(1, :count) AS i"
            ),
            {"tenant": tenant, "capability": capability, "count": count, "age_s": age_s},
        )


def test_an_idempotent_tasks_claim_forgotten_by_postgres_is_swept_and_runs_again(
    client: httpx.Client,
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    engine: Engine,
    system_beat: CeleryProcess,
) -> None:
    """An idempotent agent's claim is committed without waiting for the disk, so a Postgres
    crash may forget it while the handler runs. The task must still finish."""
    worker = start_worker(settings, "test.slow-idem", "forgetful", log_dir)
    try:
        task_id = client.post(
            "/tasks", json={"capability": "test.slow-idem", "payload": {"sleep_s": 2}}
        ).json()["task_id"]
        eventually(lambda: runs(redis_url, task_id) == 1, "the handler started")
        # When Postgres comes back without the claim: queued, as accepted (a while ago)
        row = tasks_table.c
        with engine.begin() as conn:
            forgotten = conn.execute(
                tasks_table.update()
                .where(row.id == uuid.UUID(task_id), row.status == "running")
                .values(
                    status="queued",
                    attempts=row.attempts - 1,
                    started_at=None,
                    instance=None,
                    created_at=row.created_at - timedelta(minutes=1),
                )
            ).rowcount
        assert forgotten == 1
        # Then the run's finish finds it queued and leaves it; the sweeper publishes it again
        done = wait_for_task(client, task_id, FINAL, timeout_s=60)
    finally:
        worker.stop()
    assert (done["status"], done["attempts"]) == ("succeeded", 1)
    eventually(lambda: runs(redis_url, task_id) == 2, "it ran again")


def test_queued_tasks_survive_the_broker_losing_everything(
    client: httpx.Client,
    settings: Settings,
    log_dir: Path,
    redis_url: str,
    engine: Engine,
    system_beat: CeleryProcess,
) -> None:
    # Given tasks waiting in a queue nobody consumes yet
    ids = [
        client.post(
            "/tasks",
            json={"capability": "test.late", "payload": {"i": i}, "queue_if_unavailable": True},
        ).json()["task_id"]
        for i in range(5)
    ]
    # When the broker forgets every message (what a Redis restart without persistence does)
    client_redis = redis.Redis.from_url(redis_url)
    assert client_redis.delete("test.late") == 1
    late = start_worker(settings, "test.late", "after-loss", log_dir)
    try:
        # Then the sweeper publishes them again and every one finishes, once
        finished = [wait_for_task(client, i, FINAL, timeout_s=60) for i in ids]
    finally:
        late.stop()
    assert {t["status"] for t in finished} == {"succeeded"}
    assert {t["attempts"] for t in finished} == {1}
    with engine.connect() as conn:
        statuses = (
            conn.execute(
                select(tasks_table.c.status).where(
                    tasks_table.c.id.in_([uuid.UUID(i) for i in ids])
                )
            )
            .scalars()
            .all()
        )
    assert sorted(statuses) == ["succeeded"] * 5


def test_requests_beyond_the_waiting_limit_get_503_at_once(
    settings: Settings, tenant: tuple[str, str], engine: Engine, worker: CeleryProcess
) -> None:
    import threading

    tight = create_app(settings.model_copy(update={"max_requests_waiting": 1}))
    with ServedApp(tight) as api, client_for(api, tenant[1]) as http:
        slow = threading.Thread(
            target=lambda: http.post(
                "/tasks",
                json={
                    "capability": "test.sleepy",
                    "reply_mode": "sync",
                    "payload": {"sleep_s": 2},
                },
            )
        )
        slow.start()
        # Its row written: the sync request is past the limit's door, waiting for its answer
        eventually(lambda: count_tasks(engine, tenant[0]) == 1, "the slow request accepted")
        refused = http.post("/tasks", json={"capability": "echo", "payload": {}})
        health = http.get("/healthz")
        slow.join()
    assert refused.status_code == 503
    assert refused.json()["code"] == "overloaded"
    assert refused.headers["retry-after"] == "1"
    assert health.status_code == 200  # health is never refused
    assert count_tasks(engine, tenant[0]) == 1  # only the slow one was written
