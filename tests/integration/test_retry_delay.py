"""A retry waits as long as its agent asked (``Retryable.delay_s``, a remote agent's
Retry-After): its countdown message is held in the worker that published it, not in its
queue's list, and the sweeper took the queued task for lost and ran it again within seconds."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, func, update

from api.app import create_app
from broker.db.models import tasks_table
from broker.settings import Settings
from broker.tasks import execution
from broker.tasks.execution import RETRY_DUE_SLACK_S
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.retry_agent import CAPABILITY, attempts_key
from tests.integration.rows import a_task_row
from tests.integration.stack import CeleryProcess, ServedApp, start_worker, wait_for_task

# Past the test settings' sweep_after_s (3 s) and sweep interval (1 s), so the sweeper looks
# at the waiting task several times before it is due.
DELAY_S = 10.0
# How early a worker's timer may fire a message due at a moment.
TIMER_SLACK_S = 0.5


@pytest.fixture
def retry_worker(settings: Settings, log_dir: Path) -> Iterator[CeleryProcess]:
    """A worker of the retrying agent alone: its card is advertised before the test's API
    starts, which then accepts tasks for it."""
    own = settings.model_copy(update={"agents": ["tests.integration.retry_agent"]})
    process = start_worker(own, CAPABILITY, "retry-after", log_dir)
    yield process
    process.stop()


def attempts(redis_url: str, task_id: str) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(redis_url)
    try:
        return [json.loads(entry) for entry in client.lrange(attempts_key(task_id), 0, -1)]
    finally:
        client.close()


def test_a_retry_runs_again_no_sooner_than_its_agent_asked(
    settings: Settings,
    redis_url: str,
    make_key: KeyMaker,
    system_beat: CeleryProcess,
    retry_worker: CeleryProcess,
) -> None:
    _, token = make_key()
    with ServedApp(create_app(settings)) as api, client_for(api, token) as http:
        # Given an agent that asks, on its first attempt, to be tried again in DELAY_S
        answer = http.post(
            "/tasks", json={"capability": CAPABILITY, "payload": {"delay_s": DELAY_S}}
        )
        assert answer.status_code == 202, answer.text
        task_id = answer.json()["task_id"]
        # When the sweeper runs every second meanwhile, then it runs again
        done = wait_for_task(http, task_id, {"succeeded", "failed"}, timeout_s=DELAY_S + 60)
    assert (done["status"], done["attempts"]) == ("succeeded", 2)
    # Then its second attempt started no sooner than DELAY_S after its first ended
    first, second = attempts(redis_url, task_id)
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert second["started_at"] - first["ended_at"] >= DELAY_S - TIMER_SLACK_S


@pytest.mark.parametrize(
    ("retry_in_s", "due_in_s"),
    [(30.0, (0.0, 30.0)), (-0.5, (0.0, 0.0)), (-(RETRY_DUE_SLACK_S + 1), None)],
)
def test_a_message_its_claim_refused_for_its_retry_is_sent_again_for_when_it_is_due(
    engine: Engine, retry_in_s: float, due_in_s: tuple[float, float] | None
) -> None:
    """The claim reads its clock a moment before the look at why it refused: a retry that
    came due in between was taken for none, its message dropped, and its task left for the
    sweep. Past the slack it is none: the claim refused the task for another reason."""
    task_id = a_task_row(engine, tenant=f"t-{uuid.uuid4().hex[:8]}")
    with engine.begin() as conn:
        conn.execute(
            update(tasks_table)
            .where(tasks_table.c.id == task_id)
            .values(retry_at=func.now() + timedelta(seconds=retry_in_s))
        )
    found = execution.retry_not_due(engine, task_id)
    if due_in_s is None:
        assert found is None
    else:
        assert found is not None
        low, high = due_in_s
        assert low <= found["due_in_s"] <= high and (low < found["due_in_s"] or low == high)


@pytest.mark.parametrize(
    ("attempts", "error", "message"),
    [
        (0, None, "not started before its deadline"),
        (
            1,
            {"code": "upstream_busy", "message": "try later", "retryable": True},
            "its attempt 2 did not start before its deadline; attempt 1: upstream_busy: try later",
        ),
        (2, None, "its attempt 3 did not start before its deadline"),
    ],
)
def test_a_task_whose_next_attempt_missed_its_deadline_says_so_and_keeps_its_last_error(
    engine: Engine, attempts: int, error: dict[str, Any] | None, message: str
) -> None:
    """A retry that waited for a free worker past the deadline read "not started before its
    deadline", though it had run, and its last attempt's error was gone."""
    task_id = a_task_row(engine, tenant=f"t-{uuid.uuid4().hex[:8]}")
    with engine.begin() as conn:
        conn.execute(
            update(tasks_table)
            .where(tasks_table.c.id == task_id)
            .values(attempts=attempts, error=error, deadline_at=func.now() - timedelta(seconds=1))
        )
    ended = execution.expire_overdue(engine, task_id)
    assert ended is not None
    assert (ended["status"], ended["error"]) == (
        "expired",
        {"code": "deadline_exceeded", "message": message, "retryable": False},
    )
