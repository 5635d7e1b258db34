"""The webhook tasks: fanout and one delivery attempt on ``reach.webhooks``; the sweep on
``reach.maintenance``, so that receivers holding every delivery slot cannot stop it.

Postgres holds when each attempt is due (``next_attempt_at``). A short wait is a Celery
countdown; a long one is left to the sweep, because a Redis broker hands an unacked
countdown message out again after its visibility timeout and a worker holds every countdown
message in memory until it is due. The sweep also finds messages that were lost; a duplicate
finds its attempt already taken.

A tenant's due deliveries beyond its slots free wait in Postgres, not on the queue: a fanout
publishes no more than its slots free, a message that finds them all taken is dropped (the
delivery parked), and each attempt that ends publishes the tenant's next due delivery
(``deliveries.release``). So the queue holds a few messages per tenant, whatever its backlog.
A task's progress reports have at most one fanout message waiting at a time: the fanout
reads the task's latest progress when it runs, so the reports meanwhile ride on it (one
tenant's 30 tasks of 50 reports each put 525 fanouts on the queue every tenant's final
events wait on, and another tenant's webhooks came 6-9 s late).

A final event's fanout is owed from the task's final write, which records it (``outbox``):
the hook's message is the fast way, and the sweep runs a fanout whose message never came
(its process died after the final write, or Redis refused the message). A fanout that fails
there is tried again on the deliveries' schedule, then given up (``outbox.failed``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import redis
from celery import Celery
from sqlalchemy import Engine

from broker import redisclients
from broker.observability import logs, metrics
from broker.observability.tracing import traceparent
from broker.outages import INFRASTRUCTURE_ERRORS
from broker.settings import Settings
from broker.tasks.dispatch import (
    DELIVER_TASK,
    FANOUT_TASK,
    WEBHOOK_SWEEP_TASK,
    send_announce,
    send_deliver,
)
from broker.tasks.resource import FINAL, TaskRow
from broker.webhooks import deliveries, fanout, outbox, policy, signing, upkeep
from broker.webhooks.events import PROGRESS, event_for_status
from broker.webhooks.ssrf import Guard
from workers.system.sender import send

log = logging.getLogger("reach.webhooks")
SWEEP_BATCH = 500
# The sweep republishes a pending delivery only when its message is this late.
SWEEP_GRACE_S = 60.0
# The sweep runs a final event's fanout itself when it is owed this long after the task's
# final write: its message, published right after that write, was lost. A fanout run twice
# writes no second delivery.
FANOUT_GRACE_S = 10.0
# Waits up to this long are countdown messages; longer ones are published by the sweep.
COUNTDOWN_MAX_S = SWEEP_GRACE_S
PROGRESS_CACHE_S = 5.0
INFRA_RETRY_S = 2
# An attempt ends by its deadline (the timeout); its lease adds room for the database writes.
LEASE_MARGIN_S = 30.0
PROGRESS_CACHE_MAX = 10_000
# A task's progress fanout waiting on the queue, noted in Redis until the fanout runs (or for
# this long, if its message is lost).
PROGRESS_FANOUT_PREFIX = "reach:progress-fanout:"
PROGRESS_FANOUT_TTL_S = 60
# A sweep deletes expired deliveries until none is left or this is spent: it holds one
# maintenance process meanwhile, as the janitor (REACH_JANITOR_BUDGET_S) may hold the other.
PURGE_BUDGET_S = 5.0


class Webhooks:
    """What the webhook tasks need: settings, the guard, a per-process engine, the app."""

    def __init__(self, app: Celery, settings: Settings, engine: Callable[[], Engine]) -> None:
        self.app = app
        self.settings = settings
        self.engine = engine
        self.guard = Guard(settings.webhook_allow)
        # task id -> (until, whether anyone wants its progress): one query per task, not per
        # report; a subscription made meanwhile counts once the entry is stale.
        self._wants_progress: dict[uuid.UUID, tuple[float, bool]] = {}
        self._redis: redis.Redis | None = None  # made on first use: after a pool's fork

    def on_final(self, row: TaskRow) -> None:
        """The runner's hook: announce a task's final state, when anyone may want it (its
        callback, or a subscription of its tenant): most tasks cost no extra message. The
        final update returned ``tenant_subscribes``, so a subscription made before it counts.
        That update recorded the fanout as owed: if this message is lost, the sweep runs it."""
        wanted = row.get("callback") or row.get("tenant_subscribes", True)
        if row["status"] in FINAL and wanted:
            send_announce(self.app, row["id"], event_for_status(row["status"]))

    def on_progress(self, task_id: uuid.UUID) -> None:
        """The runner's progress hook: announce it only when some endpoint asked for it."""
        now = time.monotonic()
        known = self._wants_progress.get(task_id)
        if known is None or known[0] < now:
            if len(self._wants_progress) > PROGRESS_CACHE_MAX:
                self._wants_progress.clear()
            wants = fanout.wanted(self.engine(), task_id, PROGRESS)
            known = self._wants_progress[task_id] = (now + PROGRESS_CACHE_S, wants)
        if known[1] and self._first_waiting(task_id):
            send_announce(self.app, task_id, PROGRESS)

    def _first_waiting(self, task_id: uuid.UUID | str) -> bool:
        """Note a progress fanout of the task as waiting; False if one already is."""
        try:
            key = f"{PROGRESS_FANOUT_PREFIX}{task_id}"
            return bool(self._client().set(key, 1, nx=True, ex=PROGRESS_FANOUT_TTL_S))
        except redis.RedisError:  # announced, as each report was before
            return True

    def _client(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redisclients.sync_client(self.settings.redis_url, socket_timeout=5)
        return self._redis

    def fanout(self, task_id: str, event_type: str) -> int:
        if event_type == PROGRESS:
            # Before the task is read: a report after this point sends a fanout of its own.
            try:
                self._client().delete(f"{PROGRESS_FANOUT_PREFIX}{task_id}")
            except redis.RedisError:
                log.warning(
                    "progress fanout of %s not marked done: the next waits its TTL", task_id
                )
        written = fanout.fanout(self.engine(), uuid.UUID(task_id), event_type, self.settings)
        if written is None:
            return 0
        first_s = self.settings.webhook_schedule_s[0]
        if first_s == 0:
            self._release(written.tenant)
        elif first_s <= COUNTDOWN_MAX_S:
            # Not due yet, so none can be released: each new one gets its countdown message,
            # and one that finds its tenant's slots taken is parked (it costs one claim, once).
            for delivery_id in written.waiting:
                send_deliver(self.app, delivery_id, 1, first_s)
        return len(written.waiting)

    def deliver(self, delivery_id: str, attempt: int) -> str:
        """Attempt ``attempt`` of a delivery; returns the delivery's status after it."""
        did = uuid.UUID(delivery_id)
        claimed = deliveries.claim(
            self.engine(),
            did,
            attempt,
            lease_s=self.settings.webhook_timeout_s + LEASE_MARGIN_S,
            max_inflight=self.settings.webhook_max_inflight_per_tenant,
        )
        if isinstance(claimed, deliveries.Busy):
            # Its tenant holds its share of the slots: the delivery waits in Postgres until
            # one of them ends and releases it; others' attempts go on.
            return "parked"
        if claimed is None:
            early_by = deliveries.due_in_s(self.engine(), did, attempt)
            if early_by is None:
                return "skipped"  # a duplicate, or an attempt already made
            if early_by <= COUNTDOWN_MAX_S:  # else the sweep publishes it when due
                send_deliver(self.app, did, attempt, early_by)
            return "early"
        # Its task's trace id on every line the attempt logs, as a task's run has it: the
        # trace tells a failing webhook's story too.
        ids = {"trace_id": claimed.trace_id, "task_id": str(claimed.task_id)}
        try:
            with logs.bound(**ids, tenant=claimed.tenant, delivery_id=str(did)):
                return self._attempt(claimed)
        finally:
            # However the attempt ended (a recording that failed too), the tenant's next
            # due deliveries get the slots it has free.
            self._release(claimed.tenant)

    def _attempt(self, claimed: deliveries.Claimed) -> str:
        outcome = self._send(claimed)
        verdict = policy.verdict(outcome)
        retry_in_s = policy.next_delay_s(
            self.settings.webhook_schedule_s,
            claimed.attempt,
            jitter=self.settings.webhook_jitter,
            retry_after_s=outcome.retry_after_s,
        )
        status = deliveries.record(self.engine(), claimed, outcome, verdict, retry_in_s)
        metrics.webhook_attempts.labels(status).inc()
        did, attempt = claimed.delivery_id, claimed.attempt
        log.info("delivery %s attempt %d: %s (%s)", did, attempt, status, outcome.status_code)
        if status == policy.PENDING and retry_in_s <= COUNTDOWN_MAX_S:
            send_deliver(self.app, did, attempt + 1, retry_in_s)
        return status

    def _fan_out_owed(self) -> int:
        """Run each final event's fanout still owed past ``FANOUT_GRACE_S``, and those due
        again after a failure, the longest due first; how many ran."""
        engine = self.engine()
        owed = outbox.owed(engine, grace_s=FANOUT_GRACE_S, limit=SWEEP_BATCH)
        outbox.forget(engine, [task_id for task_id, status in owed if status is None])
        ran = 0
        for task_id, status in owed:
            if status is None:
                continue
            try:
                self.fanout(str(task_id), event_for_status(status))
            except INFRASTRUCTURE_ERRORS:
                raise  # not the fanout's fault: the next sweep finds them all again
            except Exception as exc:  # one task's fanout must not hold up the others'
                self._fanout_failed(task_id, exc)
                continue
            ran += 1
        if ran:
            log.warning("ran %d fanouts whose message was lost", ran)
        return ran

    def _fanout_failed(self, task_id: uuid.UUID, exc: Exception) -> None:
        """Put a failed fanout back for later, or give it up after its tries: it would fail
        again at every sweep, reading the task's result each time, until the task expired."""
        schedule_s = self.settings.webhook_schedule_s
        failures = outbox.failed(self.engine(), task_id, schedule_s=schedule_s)
        if failures is None:  # another sweep's run settled it, or gave it up, meanwhile
            log.warning("fanout owed for task %s failed: %r", task_id, exc)
        elif failures < len(schedule_s):
            tries = len(schedule_s)
            log.warning(
                "fanout owed for task %s failed (%d of %d tries): %r", task_id, failures, tries, exc
            )
        else:
            log.error(
                "gave up the fanout owed for task %s after %d failures: its webhooks are not sent",
                task_id,
                failures,
                exc_info=exc,
            )

    def _release(self, tenant: str) -> int:
        """Publish the tenant's oldest due deliveries, as many as it has slots free."""
        released = deliveries.release(
            self.engine(), tenant, max_inflight=self.settings.webhook_max_inflight_per_tenant
        )
        for delivery_id, attempt in released:
            send_deliver(self.app, delivery_id, attempt)
        return len(released)

    def _send(self, claimed: deliveries.Claimed) -> policy.Outcome:
        if claimed.disabled:
            return policy.Outcome(error="the subscription is disabled", transient=False)
        if not claimed.secrets:
            return policy.Outcome(error="no signing secret for this endpoint", transient=False)
        message_id = deliveries.message_id(claimed.delivery_id)
        headers = {
            **claimed.headers,
            **signing.headers(claimed.secrets, message_id, int(time.time()), claimed.body),
        }
        headers["X-Trace-Id"] = claimed.trace_id
        headers["traceparent"] = traceparent(claimed.trace_id)
        return send(
            self.guard,
            claimed.url,
            claimed.body,
            headers,
            timeout_s=self.settings.webhook_timeout_s,
            max_bytes=self.settings.webhook_response_max_bytes,
        )

    def sweep(self) -> dict[str, int]:
        """Run the fanouts whose message was lost, take back attempts that never reported,
        release what waits past its time (a message or a release was lost), remove bodies
        whose task expired, drop deliveries past their retention."""
        engine = self.engine()
        fanned_out = self._fan_out_owed()
        lost = upkeep.take_back_lost(engine, limit=SWEEP_BATCH)
        for delivery_id, attempt in lost:
            send_deliver(self.app, delivery_id, attempt)
        stranded = upkeep.stranded(engine, grace_s=SWEEP_GRACE_S, limit=SWEEP_BATCH)
        # Not each of them: a tenant at its bound has them parked, and its attempts in
        # flight release them as they end.
        tenants = deliveries.tenants_of(engine, [delivery_id for delivery_id, _ in stranded])
        republished = sum(self._release(tenant) for tenant in tenants)
        bodies = upkeep.purge_expired_bodies(engine, batch=SWEEP_BATCH, budget_s=PURGE_BUDGET_S)
        purged = upkeep.purge_expired(engine, batch=SWEEP_BATCH, budget_s=PURGE_BUDGET_S)
        return {
            "fanned_out": fanned_out,
            "lost": len(lost),
            "republished": republished,
            "bodies_purged": bodies,
            "purged": purged,
        }


def register(app: Celery, settings: Settings, engine: Callable[[], Engine]) -> Webhooks:
    """Register the webhook tasks and the sweep's beat entry; returns the hooks' owner."""
    hooks = Webhooks(app, settings, engine)

    # With Postgres or Redis away, keep the message (a new one, later) instead of losing the
    # event; the claim makes a repeated attempt harmless.
    kept = {
        "autoretry_for": INFRASTRUCTURE_ERRORS,
        "retry_kwargs": {"countdown": INFRA_RETRY_S, "max_retries": None},
    }

    @app.task(name=FANOUT_TASK, **kept)  # type: ignore[untyped-decorator]
    def fanout_event(task_id: str, event_type: str) -> int:
        return hooks.fanout(task_id, event_type)

    @app.task(name=DELIVER_TASK, **kept)  # type: ignore[untyped-decorator]
    def deliver(delivery_id: str, attempt: int) -> str:
        return hooks.deliver(delivery_id, attempt)

    @app.task(name=WEBHOOK_SWEEP_TASK)  # type: ignore[untyped-decorator]
    def sweep() -> dict[str, int]:
        return hooks.sweep()

    app.conf.beat_schedule["sweep-webhooks"] = {
        "task": WEBHOOK_SWEEP_TASK,
        "schedule": settings.webhook_sweep_interval_s,
    }
    return hooks
