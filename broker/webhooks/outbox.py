"""The final events whose fanout is owed: recorded by the task's final write, removed by the
fanout that writes their deliveries.

The fanout message goes out after the final write commits (the worker's hook, the API's
cancel). A process that died between the two, or a Redis that refused the message, lost the
event's webhooks for good: the recoveries append the final event, never the fanout. So the
final write records, in the same statement, that a fanout is owed when anyone may want the
event (the task's callback, or a subscription of its tenant): no extra round trip, and no
write at all for a task with neither. The fanout removes the record in the transaction that
writes the deliveries; one older than the sweep's grace is a fanout that never ran, and the
webhook sweep runs it (``owed``). Running it twice writes no second delivery: a final
event's are unique per endpoint (``fanout``). The table holds only the fanouts in flight.

A fanout that fails for another reason than Postgres or Redis being away (a task's data the
body cannot carry, a bug) would fail at every sweep until its task expired, days later: the
sweep counts its failures, runs it again later each time, and gives it up after as many tries
as a delivery has (``failed``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    Update,
    delete,
    exists,
    func,
    or_,
    select,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import insert

from broker.db.models import tasks_table as tasks
from broker.db.models import webhook_outbox_table as outbox
from broker.db.models import webhooks_table as webhooks


def recording(final: Update) -> Select[Any]:
    """``final``, a task's final write returning the task's columns, as one statement that
    also records the fanout each of its tasks owes; it returns what ``final`` returns."""
    done = final.cte("final")
    if "tenant_subscribes" in done.c:  # judged by ``final`` already: no second probe
        subscribes: Any = done.c.tenant_subscribes
    else:
        subscribes = exists().where(
            webhooks.c.tenant == done.c.tenant, webhooks.c.disabled_at.is_(None)
        )
    # An object: a task without a callback may hold SQL NULL or a JSON null.
    wanted = or_(func.jsonb_typeof(done.c.callback) == "object", subscribes)
    tasks_owing = select(done.c.id, done.c.finished_at).where(wanted)
    # A task ends once; were it recorded already, its final write must still apply.
    owed = insert(outbox).from_select(["task_id", "finished_at"], tasks_owing)
    owed = owed.on_conflict_do_nothing()
    return select(done).add_cte(owed.cte("owed"))


def settle(conn: Connection, task_id: uuid.UUID) -> None:
    """The task's fanout is written (in ``conn``'s transaction): it is owed no more."""
    conn.execute(delete(outbox).where(outbox.c.task_id == task_id))


def owed(engine: Engine, *, grace_s: float, limit: int) -> list[tuple[uuid.UUID, str | None]]:
    """(task, its status) of fanouts owed for longer than ``grace_s`` (their messages were
    lost) and of those due again after a failure (``failed``), the longest due first. The
    status is None when the task is gone (expired and purged). Each kind is read from its
    own index, oldest first, at most ``limit`` of each: fanouts that fail every time wait
    behind the others instead of filling every sweep."""
    grace = func.make_interval(0, 0, 0, 0, 0, 0, grace_s)
    fresh = (
        select(outbox.c.task_id, outbox.c.finished_at.label("due_at"))
        .where(outbox.c.retry_at.is_(None), outbox.c.finished_at < func.now() - grace)
        .order_by(outbox.c.finished_at)  # ix_webhook_outbox_finished_at
        .limit(limit)
    )
    again = (
        select(outbox.c.task_id, outbox.c.retry_at.label("due_at"))
        .where(outbox.c.retry_at <= func.now())
        .order_by(outbox.c.retry_at)  # ix_webhook_outbox_retry_at
        .limit(limit)
    )
    due = union_all(fresh, again).subquery("due")
    query = (
        select(due.c.task_id, tasks.c.status)
        .select_from(due.outerjoin(tasks, tasks.c.id == due.c.task_id))
        .order_by(due.c.due_at)
        .limit(limit)
    )
    with engine.connect() as conn:
        return [(row.task_id, row.status) for row in conn.execute(query)]


def failed(engine: Engine, task_id: uuid.UUID, *, schedule_s: Sequence[float]) -> int | None:
    """Count a failed run of the task's owed fanout; how many have failed, None when it is
    owed no more (it ran meanwhile). It is tried ``len(schedule_s)`` times, the n-th try
    ``schedule_s[n - 1]`` after the one before (the deliveries' schedule), then given up:
    its record is removed. A fanout that fails for its task's data fails every time, and
    each try reads the task's result again."""
    with engine.begin() as conn:
        counted = (
            update(outbox)
            .where(outbox.c.task_id == task_id)
            .values(failures=outbox.c.failures + 1)
            .returning(outbox.c.failures)
        )
        failures: int | None = conn.execute(counted).scalar_one_or_none()
        if failures is None:
            return None
        if failures >= len(schedule_s):
            conn.execute(delete(outbox).where(outbox.c.task_id == task_id))
        else:
            wait = func.make_interval(0, 0, 0, 0, 0, 0, schedule_s[failures])
            later = update(outbox).where(outbox.c.task_id == task_id)
            conn.execute(later.values(retry_at=func.now() + wait))
        return failures


def forget(engine: Engine, task_ids: list[uuid.UUID]) -> None:
    """Drop the records of tasks that are gone: nothing is left to tell."""
    if task_ids:
        with engine.begin() as conn:
            conn.execute(delete(outbox).where(outbox.c.task_id.in_(task_ids)))
