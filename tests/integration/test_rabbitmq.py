"""The Celery broker may be RabbitMQ: the echo round trip with amqp:// as the broker, and a
worker that starts while its queues already hold messages (a backlog, or the deliveries a
killed worker left), which over AMQP arrive as soon as its consumer starts; and the hard time
limit held below RabbitMQ's consumer_timeout, as it is below Redis's visibility timeout."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import kombu
import pytest
import redis
from sqlalchemy import Engine

from api.app import create_app
from broker.settings import Settings
from reach.localservices import tcp_answers
from tests.conftest import IN_CI
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import CeleryProcess, ServedApp, start_worker, wait_for_task
from tests.integration.test_async_agents import all_final, runs, statuses_of
from tests.integration.test_max_concurrency_otel import BOUNDED, held_to_two
from workers.application import hard_time_limit_s
from workers.sdk.agent import AgentRegistry

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture(scope="module")
def rabbit_settings(settings: Settings) -> Settings:
    if not tcp_answers("127.0.0.1", 5672):
        if IN_CI:
            pytest.fail("RabbitMQ must answer on 127.0.0.1:5672 in CI")
        pytest.skip("no RabbitMQ on 127.0.0.1:5672")
    return settings.model_copy(update={"broker_url": AMQP_URL})


@pytest.fixture(scope="module")
def rabbit_worker(rabbit_settings: Settings, log_dir: Path) -> Iterator[CeleryProcess]:
    # A message another run left on the shared RabbitMQ finds no row in this run's database
    # and is skipped by the claim, so it cannot disturb this test.
    process = start_worker(rabbit_settings, "echo", "rabbit", log_dir)
    yield process
    process.stop()


@pytest.mark.rabbitmq
def test_echo_round_trip_over_rabbitmq(
    rabbit_settings: Settings, rabbit_worker: CeleryProcess, make_key: KeyMaker
) -> None:
    _, token = make_key(["echo"])
    with ServedApp(create_app(rabbit_settings)) as api, client_for(api, token) as http:
        response = http.post("/tasks", json={"capability": "echo", "payload": {"via": "amqp"}})
        assert response.status_code == 202
        done = wait_for_task(http, response.json()["task_id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded"
    assert done["result"] == {"via": "amqp"}
    assert done["agent"]["instance"].startswith("rabbit@")
    assert "amqp://guest:**@127.0.0.1:5672//" in rabbit_worker.output()


def test_the_hard_limit_stays_below_rabbitmqs_consumer_timeout() -> None:
    # Given an agent of an hour: its hard limit passes RabbitMQ's default consumer_timeout (30
    # min), past which the server closes the channel of an unacked delivery and requeues all
    # it holds, though not Redis's visibility timeout (6 h)
    registry = AgentRegistry()
    registry.capability("slow.hour", agent_id="slow-hour", timeout_s=3600)(lambda ctx, p: p)
    over_redis = Settings(broker_url="redis://127.0.0.1:6379/0")
    over_rabbitmq = Settings(broker_url=AMQP_URL)
    # I expect a worker over Redis to start, one over RabbitMQ to refuse, naming what to change
    assert hard_time_limit_s(over_redis, registry) == 3630
    refused = r"RabbitMQ's consumer_timeout \(REACH_BROKER_CONSUMER_TIMEOUT_S: 1800s\)"
    with pytest.raises(RuntimeError, match=refused):
        hard_time_limit_s(over_rabbitmq, registry)
    # and one over RabbitMQ to start once the setting says the server waits longer
    waits_longer = over_rabbitmq.model_copy(update={"broker_consumer_timeout_s": 3631})
    assert hard_time_limit_s(waits_longer, registry) == 3630


def test_a_hard_limit_that_reaches_the_consumer_timeout_is_refused() -> None:
    # Given an agent of 29.5 min: with the grace, its hard limit is RabbitMQ's 30 min
    registry = AgentRegistry()
    registry.capability("slow.half", agent_id="slow-half", timeout_s=1770)(lambda ctx, p: p)
    over_rabbitmq = Settings(broker_url=AMQP_URL, broker_consumer_timeout_s=1800)
    # I expect a worker over RabbitMQ to refuse to start, and to start if the server waits longer
    with pytest.raises(RuntimeError, match="consumer_timeout"):
        hard_time_limit_s(over_rabbitmq, registry)
    waits_longer = over_rabbitmq.model_copy(update={"broker_consumer_timeout_s": 1801})
    assert hard_time_limit_s(waits_longer, registry) == 1800


@pytest.fixture(scope="module")
def rabbit_api(rabbit_settings: Settings) -> Iterator[ServedApp]:
    with ServedApp(create_app(rabbit_settings)) as api:
        yield api


@pytest.fixture
def rabbit_http(rabbit_api: ServedApp, make_key: KeyMaker) -> Iterator[httpx.Client]:
    _, token = make_key()
    with client_for(rabbit_api, token) as http:
        yield http


def submit(http: httpx.Client, capability: str, payload: dict[str, object]) -> str:
    body = {"capability": capability, "payload": payload, "queue_if_unavailable": True}
    response = http.post("/tasks", json=body)
    assert response.status_code == 202, response.text
    task_id: str = response.json()["task_id"]
    return task_id


@pytest.mark.rabbitmq
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_worker_started_on_a_backlog_runs_it(
    pool: str, rabbit_settings: Settings, rabbit_http: httpx.Client, log_dir: Path
) -> None:
    # Given tasks waiting in a capability's queue that no worker serves yet
    ids = [submit(rabbit_http, "test.solo", {"n": n}) for n in range(3)]
    # When a worker for it starts (it died at start, before its consumer had a callback for
    # the messages RabbitMQ delivered at once)
    name = f"rabbit-backlog-{pool}-{uuid.uuid4().hex[:6]}"
    worker = start_worker(rabbit_settings, "test.solo", name, log_dir, pool=pool)
    try:
        done = all_final(rabbit_http, ids, "the backlog to run", 60)
    finally:
        worker.stop()
    # I expect it to run every one of them
    assert {task_id: task["status"] for task_id, task in done.items()} == dict.fromkeys(
        ids, "succeeded"
    )


@pytest.mark.rabbitmq
@pytest.mark.timeout(180)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_worker_restarted_after_kill_9_finishes_its_tasks(
    pool: str, rabbit_settings: Settings, rabbit_http: httpx.Client, log_dir: Path, redis_url: str
) -> None:
    # Given a worker running tasks, idempotent and not, when it is killed with kill -9: RabbitMQ
    # puts their unacked messages back on the queues at once
    queues = "test.slow-idem,test.slow-once"
    name = f"rabbit-restarted-{pool}-{uuid.uuid4().hex[:6]}"
    doomed = start_worker(rabbit_settings, queues, name, log_dir, concurrency=4, pool=pool)
    try:
        idem = [submit(rabbit_http, "test.slow-idem", {"sleep_s": 5}) for _ in range(2)]
        once = [submit(rabbit_http, "test.slow-once", {"sleep_s": 5}) for _ in range(2)]
        eventually(
            lambda: statuses_of(rabbit_http, idem + once),
            "every task running",
            30,
            until=lambda found: all(t["status"] == "running" for t in found.values()),
        )
        # and each handler begun (a task is running once claimed, its handler a moment later)
        eventually(
            lambda: [runs(redis_url, t) for t in idem + once],
            "every handler to begin",
            30,
            until=lambda counted: counted == [1, 1, 1, 1],
        )
        doomed.kill_hard()
    finally:
        doomed.stop()
    # When it is started again under its name, while those messages wait
    restarted = CeleryProcess(
        doomed.args, rabbit_settings, log_dir / f"{name}-restarted.log"
    ).start(" ready.")
    try:
        done = all_final(rabbit_http, idem + once, "the lost tasks to end", 90)
    finally:
        restarted.stop()
    # I expect it to start, and to recover them: the idempotent ones run again to success, the
    # others fail as lost, never run twice
    statuses = {t: (d["status"], (d.get("error") or {}).get("code")) for t, d in done.items()}
    assert statuses == {
        **dict.fromkeys(idem, ("succeeded", None)),
        **dict.fromkeys(once, ("failed", "worker_lost")),
    }
    assert [runs(redis_url, t) for t in idem + once] == [2, 2, 1, 1]


@pytest.mark.rabbitmq
@pytest.mark.timeout(120)
def test_a_worker_whose_queue_name_rabbitmq_would_refuse_says_so_at_start(
    rabbit_settings: Settings, log_dir: Path
) -> None:
    # Given a worker name that makes its instance queue (card queue @ name @ host) longer
    # than an AMQP queue's name may be (255 bytes), though not Celery's own control queue
    # (<name>@<host>.celery.pidbox, whose declare fails the same way past it)
    hostname_bytes = 235
    name = "w" * (hostname_bytes - len(f"@{socket.gethostname()}"))
    # I expect it to refuse to start naming the queue and the cure (it died on
    # "ubyte format requires 0 <= number <= 255", which named neither)
    with pytest.raises(RuntimeError, match="did not start") as refused:
        start_worker(rabbit_settings, "test.solo", name, log_dir)
    assert "past the 255 RabbitMQ allows a queue's name" in str(refused.value)
    assert "shorter name (-n)" in str(refused.value)


@pytest.mark.rabbitmq
@pytest.mark.timeout(180)
def test_a_cards_max_concurrency_holds_on_a_threads_worker_over_rabbitmq(
    rabbit_settings: Settings,
    rabbit_http: httpx.Client,
    engine: Engine,
    log_dir: Path,
    redis_url: str,
) -> None:
    """Celery's consumer takes the messages over AMQP (no loop consumer), as many as its
    prefetch allows: a card of 2 on a worker of 10 ran 6 at once."""
    name = f"rabbit-bounded-{uuid.uuid4().hex[:6]}"
    worker = start_worker(rabbit_settings, BOUNDED, name, log_dir, concurrency=10, pool="threads")
    gates = redis.Redis.from_url(redis_url)
    try:
        with kombu.Connection(AMQP_URL) as amqp:
            channel = amqp.default_channel

            def all_taken() -> bool:
                return bool(channel.queue_declare(queue=BOUNDED, passive=True).message_count == 0)

            ids = held_to_two(rabbit_http, engine, gates, all_taken)
        done = all_final(rabbit_http, ids, "all six done", 60)
    finally:
        worker.stop()
        gates.close()
    assert {(t["status"], t["attempts"]) for t in done.values()} == {("succeeded", 1)}
    assert {runs(redis_url, t) for t in ids} == {1}
