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

from sqlalchemy import Engine, func, select, text

from broker.db.models import tasks_table as tasks
from broker.db.models import webhook_bodies_table as bodies
from broker.tasks import execution
from broker.webhooks import upkeep


def _rows(engine: Engine, status: str, count: int, expired: bool = True) -> None:
    """``count`` tasks in ``status`` whose expiry has passed (or is an hour away)."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tasks (id, tenant, capability, queue, status, payload,"
                " payload_digest, payload_size, trace_id, result_ttl_s, expires_at)"
                " SELECT gen_random_uuid(), 't-retention', 'echo', 'echo', :status, '{}',"
                " 'd', 2, md5(g::text), 600,"
                " now() + CASE WHEN :expired THEN interval '-1 minute' ELSE interval '1 hour' END"
                " FROM generate_series(1, :count) AS g"
            ),
            {"status": status, "count": count, "expired": expired},
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
