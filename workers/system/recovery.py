"""Nothing accepted is lost: tasks of dead workers, and messages the broker lost.

- A task whose worker died mid-run (its instance's lease expired, or its pool process died
  while the instance lives on) runs again if its agent is idempotent and attempts remain;
  otherwise it fails with ``worker_lost``, never running twice. Each loss counts as an
  attempt, so a task that crashes its worker every time ends ``failed`` instead of looping.
- A queued task past its deadline is expired (its message may have expired in the broker).
- A queued task whose queue is empty in the broker long after it was accepted (the API died
  between commit and publish; Redis restarted without persistence) is published again. A
  duplicate message is harmless: only one claim from ``queued`` can succeed.
- A queued task whose queue is a reserved name (accepted before the name was reserved) fails
  with ``capability_reserved``: publishing it would write into a key kombu keeps (``unacked``),
  which stops every worker, and would do it again each sweep after an operator deleted it.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from typing import Any

import redis
from celery import Celery

from broker import events, execution, leases, metrics, retry
from broker.capabilities import is_valid_name
from broker.dispatch import queue_depths
from broker.registry import capability_of, lease_key
from workers.runner import Runner, error

log = logging.getLogger("reach.recovery")
REPUBLISH_GUARD_PREFIX = "reach:republished:"


def recover_lost(runner: Runner, rows: list[dict[str, Any]], why: str) -> dict[str, int]:
    counts = {"requeued": 0, "failed": 0}
    for row in rows:
        card = leases.card_of(runner.engine, row["agent_id"], None, capability_of(row["queue"]))
        limit = retry.attempt_limit(row["max_attempts"], card.get("max_attempts"))
        lost = error("worker_lost", why, retryable=bool(card.get("idempotent")))
        if card.get("idempotent") and row["attempts"] < limit and runner.republish is not None:
            if execution.requeue(runner.engine, row["id"], lost) is not None:
                runner.events.append(
                    row["id"],
                    events.STATUS,
                    {"status": "queued", "error": lost},
                    trace_id=row["trace_id"],
                )
                runner.republish(row["id"], row["queue"], row["trace_id"], None, 0.0)
                counts["requeued"] += 1
                metrics.lost_tasks.labels("requeued").inc()
            continue
        if runner.finalize(execution.fail(runner.engine, row["id"], lost)) != "skipped":
            counts["failed"] += 1
            metrics.lost_tasks.labels("failed").inc()
    if any(counts.values()):
        log.warning("recovered lost tasks (%s): %s", why, counts)
    return counts


def reap(runner: Runner) -> dict[str, int]:
    """Running tasks whose instance no longer holds a lease."""
    rows = execution.running_tasks(runner.engine, started_before_s=1)
    instances = sorted({r["instance"] for r in rows if r["instance"]})
    if not instances:
        return {"requeued": 0, "failed": 0}
    alive = runner.redis.mget([lease_key(i) for i in instances])
    dead = {i for i, lease in zip(instances, alive, strict=True) if lease is None}
    lost = [r for r in rows if r["instance"] in dead]
    return recover_lost(runner, lost, "the worker running it stopped holding its lease")


def sweep(runner: Runner, app: Celery, *, older_than_s: float, limit: int = 1000) -> dict[str, int]:
    expired = 0
    for task_id in execution.overdue_queued(runner.engine, limit=limit):
        if runner.finalize(execution.expire_overdue(runner.engine, task_id)) == "expired":
            expired += 1
    stale = execution.stale_queued(runner.engine, older_than_s=older_than_s, limit=limit)
    by_queue: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in stale:
        by_queue[row["queue"]].append(row)
    republished = refused = 0
    for queue, rows in by_queue.items():
        if not is_valid_name(capability_of(queue)):
            refused += _refuse(runner, rows)
            continue
        if queue_depths(app, [queue])[queue] > 0:
            continue  # messages are waiting: these rows are most likely among them
        for row in rows:
            if _first_republish(runner.redis, row["id"], older_than_s):
                assert runner.republish is not None
                runner.republish(row["id"], queue, row["trace_id"], row["deadline_at"], 0.0)
                republished += 1
    if expired or republished or refused:
        log.warning("sweep: %d expired, %d republished, %d refused", expired, republished, refused)
    return {"expired": expired, "republished": republished, "refused": refused}


def _refuse(runner: Runner, rows: list[dict[str, Any]]) -> int:
    why = error("capability_reserved", "the capability's name is reserved for the broker's keys")
    failed = [runner.finalize(execution.fail(runner.engine, r["id"], why)) for r in rows]
    return failed.count("failed")


def _first_republish(client: redis.Redis, task_id: uuid.UUID, window_s: float) -> bool:
    """At most one republish per task per window, however many sweepers run."""
    key = f"{REPUBLISH_GUARD_PREFIX}{task_id}"
    return bool(client.set(key, "1", nx=True, px=max(1000, int(window_s * 1000))))
