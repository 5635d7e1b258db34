"""The Celery broker may be RabbitMQ: the echo round trip with amqp:// as the broker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from api.app import create_app
from broker.settings import Settings
from reach.localservices import tcp_answers
from tests.conftest import IN_CI
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import CeleryProcess, ServedApp, start_worker, wait_for_task

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
