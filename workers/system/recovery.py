"""Nothing accepted is lost: tasks of dead workers, and messages the broker lost.

- A task whose worker died mid-run (its instance's lease expired and its row in Postgres was
  not written for as long, or its pool process died while the instance lives on) runs again
  if its agent is idempotent and attempts remain; otherwise it fails with ``worker_lost``,
  never running twice. Each loss counts as an attempt, so a task that crashes its worker
  every time ends ``failed`` instead of looping.
- A queued task past its deadline is expired (its message may have expired in the broker,
  or it waited for an earlier turn): the earliest first, shared out by tenant
  (``execution.overdue_query``).
- A queued task whose message is not in its queue long after it was accepted (the API died
  between commit and publish; Redis restarted without persistence) is published again. On
  a Redis broker the queue's waiting messages are read for it; on another, a queue that
  holds messages is taken to hold it. A
  duplicate message is harmless: only one claim from ``queued`` can succeed. A session's turn
  that came due is published again even when its queue holds messages, if a worker dropped
  its message while it waited (``broker.tasks.turns``): once per message dropped. A turn
  still waiting for an earlier one is left alone. Each sweep reads at most ``limit`` such
  tasks, shared out by (tenant, queue) (``execution.stale_queued``): one tenant's backlog,
  however old, takes only its share, so another's lost task is found at the next sweep.
- What is published again (a task requeued, republished or moved) goes where its tenant's
  fair slice of the queue puts it, as a submit does (``backpressure.FairPlace``): a tenant
  whose tasks were lost by the thousand does not have them all put ahead of the others'.
- A queued task waiting in the queue of an instance that holds no ready lease (a hint to an
  instance that died or drained before taking it) moves to its card's queue.
- A queued task of a card gone for good (``card_gone``: its version revoked, or a remote
  agent's no longer registered at that version; or of a capability whose cards are all
  such) moves to the version that replaced it, or fails (``version_revoked``,
  ``agent_not_found``): no one would ever take it.
- A queued task whose queue is a reserved name (accepted before the name was reserved) fails
  with ``capability_reserved``: publishing it would write into a key kombu keeps (``unacked``),
  which stops every worker, and would do it again each sweep after an operator deleted it.
- A task final in Postgres whose event log lacks its final event (its worker died between the
  two writes) gets that event. The scan walks ``finished_at`` from where the last one stopped,
  over the last ``ANNOUNCE_WINDOW_S`` only; older ones are left to their readers (a stream
  that finds the task final in Postgres appends the event itself) and to redeliveries.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from celery import Celery
from sqlalchemy import Engine, func, select

from broker.db.models import (
    agent_cards_table,
    agent_instances_table,
    remote_agents_table,
)
from broker.db.models import agent_revocations_table as revocations_table
from broker.observability import metrics
from broker.registry import leases, revocations
from broker.registry.capabilities import is_valid_name
from broker.registry.model import (
    OFFLINE,
    READY,
    Lease,
    capability_of,
    card_queue,
    home_queue,
    instance_of,
    lease_key,
    now_s,
)
from broker.tasks import events, execution, retry, turns
from broker.tasks.dispatch import queue_depths, waiting_ids
from broker.tasks.resource import QUEUED, task_error
from workers.runner import Runner

log = logging.getLogger("reach.recovery")
REPUBLISH_GUARD_PREFIX = "reach:republished:"
ANNOUNCED_UNTIL_KEY = "reach:reaper:announced-until"
ANNOUNCE_WINDOW_S = 900
# A worker that finished a task this recently is still appending its final event.
ANNOUNCE_GRACE_S = 2.0
ANNOUNCE_BATCH = 1000
ANNOUNCE_MAX_BATCHES = 10
SWEEP_END_BUDGET_S = 5.0  # of a sweep, for ending queued tasks past their TTL


def recover_lost(runner: Runner, rows: list[dict[str, Any]], why: str) -> dict[str, int]:
    counts = {"requeued": 0, "failed": 0}
    for row in rows:
        # The version it ran under: another's card (any one, unordered, before) may call an
        # agent that is not idempotent so, and run its task twice.
        card = leases.card_of(
            runner.engine, row["agent_id"], row["agent_version"], capability_of(row["queue"])
        )
        limit = retry.attempt_limit(row["max_attempts"], card.get("max_attempts"))
        lost = task_error("worker_lost", why, retryable=bool(card.get("idempotent")))
        if card.get("idempotent") and row["attempts"] < limit and runner.republish is not None:
            # Only the attempt read above: a newer one (after another recovery) is not lost.
            home = home_queue(row["queue"])  # not the lost instance's own queue
            if execution.requeue(
                runner.engine, row["id"], lost, attempt=row["attempts"], queue=home
            ):
                runner.events.append(
                    row["id"],
                    events.STATUS,
                    {"status": QUEUED, "error": lost},
                    trace_id=row["trace_id"],
                    tenant=row["tenant"],
                    ttl_s=row["result_ttl_s"] + events.EVENTS_SLACK_S,  # not the worker's
                    attempt=row["attempts"] + 1,  # the lost attempt's events end here
                )
                runner.republish(row["id"], home, row["trace_id"], None, 0.0, row["tenant"])
                counts["requeued"] += 1
                metrics.lost_tasks.labels("requeued").inc()
            continue
        failed = execution.fail_lost(runner.engine, row["id"], lost, attempt=row["attempts"])
        if runner.finalize(failed) != "skipped":
            counts["failed"] += 1
            metrics.lost_tasks.labels("failed").inc()
    if any(counts.values()):
        log.warning("recovered lost tasks (%s): %s", why, counts)
    return counts


def reap(runner: Runner) -> dict[str, int]:
    """Running tasks whose instance no longer holds a lease and has not been seen in
    Postgres within its lease's TTL either."""
    rows = execution.running_tasks(runner.engine, started_before_s=1)
    instances = sorted({r["instance"] for r in rows if r["instance"]})
    if not instances:
        return {"requeued": 0, "failed": 0}
    alive = runner.redis.mget([lease_key(i) for i in instances])
    unleased = [i for i, lease in zip(instances, alive, strict=True) if lease is None]
    dead = set(unleased) - seen_live(runner.engine, unleased) if unleased else set()
    lost = [r for r in rows if r["instance"] in dead]
    return recover_lost(runner, lost, "the worker running it stopped holding its lease")


def seen_live(engine: Engine, names: list[str]) -> set[str]:
    """The instances among ``names`` whose row a live keeper wrote within their lease's TTL.
    A lease missing from Redis alone is no death: Redis that lost its data (FLUSHDB, a
    restart without persistence, a failover to a replica behind) or that the worker could
    not reach for a while drops the leases of live workers, and the reaper ran before their
    next renewal: each of their tasks ended ``worker_lost`` or ran again beside itself. The
    keeper writes the row every renewal interval (TTL/3) whether or not Redis answers."""
    rows = agent_instances_table.c
    fresh = rows.last_seen_at > func.now() - func.make_interval(0, 0, 0, 0, 0, 0, rows.lease_ttl_s)
    query = select(rows.instance).where(rows.instance.in_(names), rows.state != OFFLINE, fresh)
    with engine.connect() as conn:
        return set(conn.execute(query).scalars())


def end_unstarted(runner: Runner, *, batch: int, budget_s: float) -> int:
    """End the queued tasks whose ``result_ttl_s`` has passed (``ttl_exceeded``), each told
    as a final state is, in batches until none is left or ``budget_s`` is spent; how many.
    Not before: the janitor ended those within its period of it (a minute), so a task
    accepted with a TTL of a minute or less ended the moment it was, never run."""
    ended = 0
    stop_at = time.monotonic() + budget_s
    while True:
        rows = execution.expire_unstarted(runner.engine, within_s=0, batch=batch)
        for row in rows:
            runner.finalize(row)
        ended += len(rows)
        if len(rows) < batch or time.monotonic() >= stop_at:
            return ended


def sweep(runner: Runner, app: Celery, *, older_than_s: float, limit: int = 1000) -> dict[str, int]:
    expired = end_unstarted(runner, batch=limit, budget_s=SWEEP_END_BUDGET_S)
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
        gone = card_gone(runner.engine, queue)
        if gone is not None:
            moved, failed = _away(runner, queue, rows, gone)
            republished, refused = republished + moved, refused + failed
            continue
        if instance_of(queue) is not None and not _ready(runner, instance_of(queue)):
            republished += rehome(runner, queue)
            continue
        if queue_depths(app, [queue])[queue] > 0:
            rows = _not_waiting(runner, app, queue, rows)
        for row in rows:
            if _first_republish(runner.redis, row["id"], older_than_s):
                assert runner.republish is not None
                trace_id, deadline_at, tenant = row["trace_id"], row["deadline_at"], row["tenant"]
                runner.republish(row["id"], queue, trace_id, deadline_at, 0.0, tenant)
                republished += 1
    if expired or republished or refused:
        log.warning("sweep: %d expired, %d republished, %d refused", expired, republished, refused)
    return {"expired": expired, "republished": republished, "refused": refused}


def _not_waiting(
    runner: Runner, app: Celery, queue: str, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The rows whose message is not among those waiting in ``queue``. On a Redis broker
    the queue's messages are read (``dispatch.waiting_ids``): a tenant keeping a queue busy
    used to delay another's lost task until the queue drained. Elsewhere (or past the
    most messages read) these rows are most likely among them, but for a turn whose
    message a worker dropped while it waited (``broker.tasks.turns``)."""
    present = waiting_ids(app, queue)
    if present is None:
        return [
            row
            for row in rows
            if row["session_id"] is not None and turns.take_dropped(runner.redis, row["id"])
        ]
    lost = [row for row in rows if str(row["id"]) not in present]
    for row in lost:
        if row["session_id"] is not None:
            turns.take_dropped(runner.redis, row["id"])  # published again: that drop is seen
    return lost


def _ready(runner: Runner, instance: str | None) -> bool:
    raw = runner.redis.get(lease_key(instance or ""))
    return raw is not None and Lease.from_json(raw).observed_state(now_s()) == READY


def rehome(runner: Runner, queue: str) -> int:
    """Move the queued tasks of an instance's queue to its card's queue (the instance stopped
    taking work); how many. What is left in the instance's queue is harmless: a message
    finds its task no longer queued, or claims it once."""
    assert runner.republish is not None
    moved = execution.rehome(runner.engine, queue, home_queue(queue))
    for row in moved:
        trace_id, deadline_at, tenant = row["trace_id"], row["deadline_at"], row["tenant"]
        runner.republish(row["id"], home_queue(queue), trace_id, deadline_at, 0.0, tenant)
    return len(moved)


@dataclass(frozen=True)
class Gone:
    """Where the queued tasks of a card that is gone for good go: the queue of the version
    that took its place (``to``), or nowhere (they fail with ``error``)."""

    to: str | None = None
    error: dict[str, Any] | None = None


def card_gone(engine: Engine, queue: str) -> Gone | None:
    """Whether the card whose queue (or instance's queue) ``queue`` is will never be served
    again: its version was revoked, or it is a remote agent's that is no longer registered,
    or registered at another version now, or at the same one without the capability. Its
    tasks waited for good: with no deadline, until their rows expired, with no final state.
    A worker's card that no instance serves now is not gone: one may start (its tasks wait,
    as the design has them).

    A capability's own queue is gone when every card of the capability is a remote agent's
    that no registration serves any more, or revoked: its tasks end ``agent_not_found``."""
    parts = home_queue(queue).split("@")
    if len(parts) == 1:
        return _capability_gone(engine, queue)
    if len(parts) != 3:
        return None
    capability, agent_id, version = parts
    if revocations.revoked_among(engine, [(agent_id, version)]):
        why = f"version {version} of agent {agent_id} was revoked before it ran the task"
        return Gone(error=task_error("version_revoked", why))
    card = agent_cards_table.c
    remote = remote_agents_table.c
    stored = select(card.card).where(
        card.agent_id == agent_id, card.version == version, card.capability == capability
    )
    registered = select(remote.version, remote.cards).where(remote.agent_id == agent_id)
    with engine.connect() as conn:
        document = conn.execute(stored).scalar_one_or_none()
        now = conn.execute(registered).first() if document else None
    if not document or "endpoint" not in document:  # unknown, or a worker's
        return None
    if now is not None and capability in {d["capability"] for d in now.cards}:
        if now.version == version:
            return None  # served as it was
        return Gone(to=card_queue(capability, agent_id, now.version))
    why = f"remote agent {agent_id} no longer serves {capability} at version {version}"
    return Gone(error=task_error("agent_not_found", why))


def _capability_gone(engine: Engine, capability: str) -> Gone | None:
    """``card_gone`` for a capability's own queue: every card of every tenant's (only those
    take from it, ``CardRef.queues``) is a remote agent's that no registration serves any
    more, or revoked: routing sent its tasks there while one agent served it (``waiting_queue``),
    and it deregistered or re-registered without it. A worker's card keeps the queue: an
    instance may start for it. One statement, so a registration that lands meanwhile is
    seen whole or not at all."""
    card = agent_cards_table.c
    remote = remote_agents_table.c
    query = (
        select(
            card.agent_id,
            card.version,
            card.card["tenants"].label("tenants"),
            card.card.has_key("endpoint").label("remote"),
            (
                (remote.version == card.version)
                & remote.cards.contains([{"capability": capability}])
            ).label("registered"),
            revocations_table.c.agent_id.is_not(None).label("revoked"),
        )
        .select_from(
            agent_cards_table.outerjoin(
                remote_agents_table, remote.agent_id == card.agent_id
            ).outerjoin(
                revocations_table,
                (revocations_table.c.agent_id == card.agent_id)
                & (revocations_table.c.version == card.version),
            )
        )
        .where(card.capability == capability)
    )
    with engine.connect() as conn:
        rows = [r for r in conn.execute(query) if not isinstance(r.tenants, list)]
    if not rows or any(not r.remote or (r.registered and not r.revoked) for r in rows):
        return None
    why = f"no registered agent serves {capability} any more"
    return Gone(error=task_error("agent_not_found", why))


def _away(runner: Runner, queue: str, rows: list[dict[str, Any]], gone: Gone) -> tuple[int, int]:
    """The queued tasks of a card gone for good moved where ``gone`` says, or failed: (moved,
    failed)."""
    if gone.to is not None:
        assert runner.republish is not None
        moved = execution.rehome(runner.engine, queue, gone.to)
        for row in moved:
            trace_id, deadline_at, tenant = row["trace_id"], row["deadline_at"], row["tenant"]
            runner.republish(row["id"], gone.to, trace_id, deadline_at, 0.0, tenant)
        return len(moved), 0
    assert gone.error is not None
    ended = [runner.finalize(execution.fail(runner.engine, r["id"], gone.error)) for r in rows]
    return 0, ended.count("failed")


def _refuse(runner: Runner, rows: list[dict[str, Any]]) -> int:
    why = task_error(
        "capability_reserved", "the capability's name is reserved for the broker's keys"
    )
    failed = [runner.finalize(execution.fail(runner.engine, r["id"], why)) for r in rows]
    return failed.count("failed")


def _first_republish(client: redis.Redis, task_id: uuid.UUID, window_s: float) -> bool:
    """At most one republish per task per window, however many sweepers run."""
    key = f"{REPUBLISH_GUARD_PREFIX}{task_id}"
    return bool(client.set(key, "1", nx=True, px=max(1000, int(window_s * 1000))))


def announce_finished(runner: Runner) -> int:
    """Append the final event of recently finished tasks whose log lacks it; how many."""
    floor = datetime.now(UTC) - timedelta(seconds=ANNOUNCE_WINDOW_S)
    mark = runner.redis.get(ANNOUNCED_UNTIL_KEY)
    after = max(floor, datetime.fromtimestamp(float(mark), UTC)) if mark else floor
    announced = 0
    for _ in range(ANNOUNCE_MAX_BATCHES):
        batch = execution.finished_between(
            runner.engine, after=after, before_s=ANNOUNCE_GRACE_S, limit=ANNOUNCE_BATCH
        )
        if not batch:
            break
        missing = events.unannounced(runner.redis, [task_id for task_id, _ in batch])
        for row in execution.rows_of(runner.engine, missing) if missing else []:
            announced += runner.announce(row)
        # Two tasks finished in the same microsecond across a batch boundary: the second is
        # left to its readers.
        after = batch[-1][1]
        runner.redis.set(ANNOUNCED_UNTIL_KEY, after.timestamp(), ex=2 * ANNOUNCE_WINDOW_S)
        if len(batch) < ANNOUNCE_BATCH:
            break
    if announced:
        log.warning("announced %d final states their workers did not", announced)
    return announced
