"""Retention deletes only what has ended, and a batch is a batch whatever plan Postgres picks.

- The janitor ends queued tasks about to expire (``ttl_exceeded``), then deletes expired
  rows. Its ending loop stops at its time budget; the delete ran on past it, over every
  expired row whatever its status, so a backlog larger than one run's time to end went with
  no final state, no event and no webhook (38,000 of 80,000 queued tasks in one run at the
  default settings). A task still queued or running past its expiry now stays, to be ended
  first. So does an idempotent replay's delete of an expired task.
- ``UPDATE … WHERE id IN (SELECT … LIMIT n FOR UPDATE SKIP LOCKED)`` on a small, unanalyzed
  table was planned as a nested loop that ran the limited subquery again for every row: one
  call with a batch of 100 ended all 2,000 queued tasks (``broker.db.batches``).
- The webhook sweep removed at most 20 batches of expired bodies a run, whatever time it
  had: 10,000 every 30 s, behind one body a task at 400 tasks a second.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, func, select, text

from broker.db.models import tasks_table as tasks
from broker.db.models import webhook_bodies_table as bodies
from broker.settings import Settings
from broker.tasks import execution
from broker.tasks.events import log_key
from broker.tasks.resource import task_error
from broker.webhooks import upkeep
from workers.runner import Runner
from workers.sdk.agent import AgentRegistry
from workers.system import recovery


def _rows(engine: Engine, status: str, count: int, expired: bool = True, in_s: int = 3600) -> None:
    """``count`` tasks in ``status`` whose expiry has passed (or is ``in_s`` away)."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tasks (id, tenant, capability, queue, status, payload,"
                " payload_digest, payload_size, trace_id, result_ttl_s, expires_at)"
                " SELECT gen_random_uuid(), 't-retention', 'echo', 'echo', :status, '{}',"
                " 'd', 2, md5(g::text), 600,"
                " now() + CASE WHEN :expired THEN interval '-1 minute'"
                " ELSE make_interval(secs => :in_s) END"
                " FROM generate_series(1, :count) AS g"
            ),
            {"status": status, "count": count, "expired": expired, "in_s": in_s},
        )


def _by_status(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        query = select(tasks.c.status, func.count()).group_by(tasks.c.status)
        return {status: count for status, count in conn.execute(query).all()}


def test_the_purge_deletes_expired_tasks_that_ended_and_none_still_queued_or_running(
    own_engine: Engine,
) -> None:
    # Given expired tasks in every state, and ended ones not expired yet
    for status in ("queued", "running", "succeeded", "failed", "cancelled", "expired"):
        _rows(own_engine, status, 30)
    _rows(own_engine, "succeeded", 7, expired=False)
    # When the janitor's delete runs, with time to spare
    removed = execution.purge_expired(own_engine, batch=10, budget_s=60)
    # Then every expired task that ended is gone, and none that has not
    assert removed == 4 * 30
    assert _by_status(own_engine) == {"queued": 30, "running": 30, "succeeded": 7}


def test_a_queued_backlog_the_janitor_has_not_ended_waits_for_it_and_then_goes(
    own_engine: Engine,
) -> None:
    # Given more expired queued tasks than a run ends before its budget is spent
    _rows(own_engine, "queued", 50)
    ended = execution.expire_unstarted(own_engine, within_s=0, batch=10)
    assert len(ended) == 10
    # When the delete runs after it
    assert execution.purge_expired(own_engine, batch=100, budget_s=60) == 0
    # Then the ones it did not end are still there, queued, for the next run to end
    assert _by_status(own_engine) == {"queued": 40, "expired": 10}
    while execution.expire_unstarted(own_engine, within_s=0, batch=10):
        pass
    assert _by_status(own_engine) == {"expired": 50}


def test_one_batch_ends_at_most_its_size_on_a_small_unanalyzed_table(own_engine: Engine) -> None:
    # Given 2,000 expired queued tasks in a table Postgres has no statistics of
    _rows(own_engine, "queued", 2000)
    # When one batch of 100 is ended
    ended = execution.expire_unstarted(own_engine, within_s=0, batch=100)
    # Then 100 are, and the rest wait for the next batches
    assert len(ended) == 100
    assert _by_status(own_engine) == {"queued": 1900, "expired": 100}


def test_one_sweep_removes_every_expired_body_it_has_time_for(own_engine: Engine) -> None:
    # Given more expired bodies than 20 batches hold (the old cap of one sweep)
    with own_engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO webhook_bodies (id, body, expires_at)"
                " SELECT gen_random_uuid(), '{}', now() - interval '1 minute'"
                " FROM generate_series(1, 250)"
            )
        )
    # When one sweep removes them in batches of 10, with time to spare
    removed = upkeep.purge_expired_bodies(own_engine, batch=10, budget_s=60)
    # Then all of them are gone
    assert removed == 250
    with own_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(bodies)).scalar_one() == 0


@pytest.fixture
def runner(settings: Settings, own_engine: Engine, own_redis: str) -> Runner:
    """A runner on the test's own database, as the janitor's and the sweep's."""
    url = own_engine.url.render_as_string(hide_password=False)
    local = settings.model_copy(update={"database_url": url, "redis_url": own_redis})
    return Runner(local, AgentRegistry())


def test_a_queued_task_ends_unstarted_only_once_its_ttl_has_passed(
    own_engine: Engine, runner: Runner
) -> None:
    """The janitor ended every queued task within its period (60 s) of its TTL: one
    accepted with a TTL of a minute or less ended the moment it was, never run."""
    # Given a queued task past its TTL, and one with 30 s left (a TTL of 45 s, say)
    _rows(own_engine, "queued", 1)
    _rows(own_engine, "queued", 1, expired=False, in_s=30)
    # When the janitor's and the sweep's step runs
    assert recovery.end_unstarted(runner, batch=100, budget_s=60) == 1
    # Then only the first has ended; the other waits for an agent until its time is up
    assert _by_status(own_engine) == {"queued": 1, "expired": 1}


def test_a_lost_tasks_recovery_leaves_a_task_its_worker_requeued_meanwhile(
    own_engine: Engine, runner: Runner
) -> None:
    """A recovery reads a running task, then acts: between the two its worker may have
    requeued it for a retry (the same attempt). It was failed ``worker_lost`` then, and its
    retry found it final."""
    _rows(own_engine, "queued", 1, expired=False)
    with own_engine.connect() as conn:
        [task_id] = conn.execute(select(tasks.c.id)).scalars()
    claimed = execution.claim(own_engine, task_id, agent_id="a", version="1.0.0", instance="w@h")
    assert claimed is not None
    # Given the recovery's read of it running
    [read] = [r for r in execution.running_tasks(own_engine) if r["id"] == task_id]
    # And its worker's retry since
    retried = task_error("flaky", "again", retryable=True)
    assert execution.requeue(own_engine, task_id, retried, attempt=claimed.attempt, delay_s=5)
    # When the recovery acts on what it read
    recovery.recover_lost(runner, [read], "its worker is gone")
    # Then the task still waits for its retry
    assert _by_status(own_engine) == {"queued": 1}


def test_a_lost_tasks_requeue_keeps_its_event_log_for_the_tasks_own_ttl(
    own_engine: Engine, runner: Runner
) -> None:
    """The requeue event went with the worker's default TTL (``REACH_RESULT_TTL_S``, a day),
    not the task's: a task kept a week that waited past a day for its next attempt lost its
    log (its event ids began again at 1)."""
    week = 7 * 24 * 3600
    _rows(own_engine, "queued", 1, expired=False, in_s=week)
    with own_engine.begin() as conn:
        conn.execute(text("UPDATE tasks SET result_ttl_s = :week"), {"week": week})
        conn.execute(
            text(
                "INSERT INTO agent_cards (agent_id, version, capability, schema_version, card)"
                " VALUES ('a', '1.0.0', 'echo', 1, '{\"idempotent\": true}')"
            )
        )
        [task_id] = conn.execute(select(tasks.c.id)).scalars()
    assert execution.claim(own_engine, task_id, agent_id="a", version="1.0.0", instance="w@h")
    [read] = [r for r in execution.running_tasks(own_engine) if r["id"] == task_id]
    # When the recovery finds it lost and sends it again (its agent is idempotent)
    runner.republish = lambda *args, **kwargs: None
    assert recovery.recover_lost(runner, [read], "its worker is gone")["requeued"] == 1
    # Then its log is kept as long as the task may wait for its next attempt
    assert runner.redis.ttl(log_key(str(task_id))) > week
