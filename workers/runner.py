"""Running one task on this worker: claim, call the handler, record the outcome.

A handler's exception never escapes (the worker stays up) and never leaves the task running:
every path after a successful claim ends in ``succeed`` or ``fail``. Status changes, progress
and outputs go to the task's event log as they happen.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NoReturn

import billiard.common
import redis
import redis.asyncio as aioredis
import sqlalchemy.exc
from sqlalchemy import Engine

from broker import jsonbody, redisclients
from broker.db.engines import LoopConnection, ThreadConnection, sync_engine
from broker.errors import AgentFailure, Retryable
from broker.grouping import Grouped, ThreadGrouped
from broker.observability import logs, metrics
from broker.outages import AGENT_TRANSIENT_ERRORS, INFRASTRUCTURE_ERRORS
from broker.registry import leases, schemas
from broker.registry.model import capability_of, home_queue
from broker.settings import Settings
from broker.tasks import cancellation, events, execution, retry, turns
from broker.tasks.events import EVENTS_SLACK_S
from broker.tasks.execution import Claim, Claimed, Finish
from broker.tasks.resource import QUEUED, RUNNING, TaskRow, said, task_error
from workers import faults
from workers.aio import (
    ON_LOOP_BYTES,
    CallCancelled,
    Calls,
    CallTimedOut,
    HandlerExited,
    off_the_loop,
)
from workers.card_runs import CardRuns, LineClosed, bound_of
from workers.sdk.agent import AgentRegistry, CapabilitySpec
from workers.sdk.context import Context
from workers.sdk.session import Session
from workers.session_store import SessionStore
from workers.timelimit import SoftTimeLimit, soft_limit

log = logging.getLogger("reach.worker")
THREADED_DB_POOL = 10  # Postgres connections of one threads-pool worker process
GROUP_MAX_TASKS = 100  # claims or finishes in one statement
DEADLINE_SLACK_S = 0.05  # a failure this close to the deadline is the deadline's
REFUSED_BACK_S = 0.5  # a task a private card refused waits this long to be taken again
CANCEL_PROBE_S = 0.25  # a sync generator asks whether its task was cancelled at most this often
# The waits before each new try of a final write while Postgres is away. The handler's outcome
# exists only in this process: lost, the message came again, found the task running and was
# skipped, and the task was recovered as lost (run again, or worker_lost) or, on the bridge,
# stayed running. About 18 s in all, inside a lease.
FINISH_RETRY_S = (0.1, 0.5, 2.0, 5.0, 10.0)
# The ``running`` event's Redis call, tried again after a blip: failing, it left the task
# claimed and running with no handler (the message's retry found it claimed, and the task
# ended worker_lost, never run).
ANNOUNCE_RETRY_S = (0.1, 0.5, 2.0)
REDIS_BLIPS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
# What a database error raised in a handler tells the task's caller of itself: its text is SQL and
# its parameters, for the worker's log only.
HIDDEN = "a database statement failed; its detail is in the worker's log"
# A task's progress reports: each is a write to its row and an event (and a webhook message
# where one is subscribed), so a handler reporting once per item of a tenant's payload, or a
# remote agent streaming reports, made as many. Up to the burst at once, then this many a
# second; a report past them is dropped (the next one let through carries the latest).
PROGRESS_BURST = 50
PROGRESS_PER_S = 10.0
FinalHook = Callable[[TaskRow], None]
# (task_id, queue, trace_id, deadline_at, countdown_s, tenant): publishes the task's message
# again, behind the other tenants' when its tenant holds its fair slice of the queue, as at
# submit (``backpressure.FairPlace``).
Republish = Callable[[uuid.UUID, str, str, datetime | None, float, str], None]


class Runner:
    def __init__(self, settings: Settings, registry: AgentRegistry) -> None:
        self.settings = settings
        self.registry = registry
        # Called with the task row each time this runner puts a task in a final state.
        self.on_final: list[FinalHook] = []
        # Called with the task id each time a running task reports progress.
        self.on_progress: list[Callable[[uuid.UUID], None]] = []
        self.republish: Republish | None = None
        # Each bounded card's runs here, where Celery's consumer took their messages
        self.card_runs = CardRuns()
        self._engine: Engine | None = None
        self._redis: redis.Redis | None = None
        self._events: events.EventLog | None = None
        self._claims: ThreadGrouped[Claim, Claimed | None] | None = None
        self._finishes: ThreadGrouped[Finish, TaskRow | None] | None = None
        # Their own connections: a group's statement goes out only when the one before it
        # has come back, so one each, without SQLAlchemy's layers (as the loop's below).
        self._claims_db: ThreadConnection | None = None
        self._finishes_db: ThreadConnection | None = None
        self._pid = 0
        # A prefork pool's child (``worker_process_init``): it ignores SIGINT, and billiard
        # says when its SIGTERM handler raised, so an exit raised there otherwise is its
        # handler's own
        self.in_pool_child = False
        self._crash_after_finish = faults.crash_after_finish()
        self._crash_after_group = faults.crash_after_group()
        self._connect_lock = threading.Lock()
        # Async handlers: the loop and what runs on it.
        self.calls = Calls(settings.redis_url, settings.event_loop)
        # The loop's own, for tasks run on it directly (``run_async``).
        self._aclaims_db: LoopConnection | None = None
        self._afinishes_db: LoopConnection | None = None
        self._aredis: aioredis.Redis | None = None
        self._aevents: events.EventLog | None = None
        self._aclaims: Grouped[Claim, Claimed | None] | None = None
        self._afinishes: Grouped[Finish, TaskRow | None] | None = None

    def _connect(self) -> None:
        # One engine and client per process: a prefork child must not reuse its parent's
        # connections.
        if self._pid == os.getpid():
            return
        with self._connect_lock:  # threads of one process make them once
            if self._pid != os.getpid():
                self._open()

    def _open(self) -> None:
        # Many tasks at once in threads of this process (the threads pool): a pool of
        # connections they share, none opened and closed per statement.
        threaded = threading.current_thread() is not threading.main_thread()
        self._engine = (
            sync_engine(self.settings, pool_size=THREADED_DB_POOL, max_overflow=0)
            if threaded
            else sync_engine(self.settings)
        )
        self._redis = redisclients.sync_client(self.settings.redis_url, socket_timeout=5)
        self._events = events.EventLog(
            self._redis, self.settings.result_ttl_s, self.settings.event_log_max_bytes
        )
        # The tasks in flight in this process's threads claim and finish in groups: what
        # arrives while one statement is out goes in the next (on prefork, always alone).
        self._claims_db = ThreadConnection(self.settings.database_url)
        self._finishes_db = ThreadConnection(self.settings.database_url)
        self._claims = ThreadGrouped(
            self._claim_many, max_items=GROUP_MAX_TASKS, name="claims", retry_alone=True
        )
        self._finishes = ThreadGrouped(
            self._finish_many,
            max_items=GROUP_MAX_TASKS,
            name="finishes",
            retry_alone=True,
            weigh=Finish.weight,
        )
        self._pid = os.getpid()

    def _connect_async(self) -> None:
        """The event loop's own Postgres connections, Redis client and groups
        (``run_async``), made on the loop, once."""
        if self._aclaims_db is not None:
            return
        # One connection each for the claims and the finishes: a group's statement goes out
        # only when the one before it has come back.
        self._aclaims_db = LoopConnection(self.settings.database_url)
        self._afinishes_db = LoopConnection(self.settings.database_url)
        self._aredis = redisclients.async_client(self.settings.redis_url, socket_timeout=5)
        self._aevents = events.EventLog(
            self._aredis, self.settings.result_ttl_s, self.settings.event_log_max_bytes
        )
        self._aclaims = Grouped(
            self._claim_many_async, max_items=GROUP_MAX_TASKS, name="claims", retry_alone=True
        )
        self._afinishes = Grouped(
            self._finish_many_async,
            max_items=GROUP_MAX_TASKS,
            name="finishes",
            retry_alone=True,
            weigh=Finish.weight,
        )

    async def _claim_many_async(self, claims: list[Claim]) -> list[Claimed | None]:
        assert self._aclaims_db is not None
        claimed = await execution.claim_many_async(self._aclaims_db, claims)
        if "claims" in self._crash_after_group and len(claims) > 1:
            faults.crash()  # tests only: as in ``_claim_many``
        return claimed

    async def _finish_many_async(self, finishes: list[Finish]) -> list[TaskRow | None]:
        assert self._afinishes_db is not None
        rows = await execution.finish_many_async(self._afinishes_db, finishes)
        if "finishes" in self._crash_after_group and len(finishes) > 1:
            faults.crash()  # tests only: as in ``_finish_many``
        return rows

    @property
    def engine(self) -> Engine:
        self._connect()
        assert self._engine is not None
        return self._engine

    @property
    def redis(self) -> redis.Redis:
        self._connect()
        assert self._redis is not None
        return self._redis

    @property
    def events(self) -> events.EventLog:
        self._connect()
        assert self._events is not None
        return self._events

    def claim(self, claim: Claim) -> Claimed | None:
        self._connect()
        assert self._claims is not None
        return self._claims(claim)

    def finish(self, finish: Finish) -> str:
        """Write a final state (grouped with others in flight), then announce it."""
        self._connect()
        assert self._finishes is not None
        retried = False
        for wait_s in FINISH_RETRY_S:
            try:
                row = self._finishes(finish)
            except INFRASTRUCTURE_ERRORS as exc:
                _final_write_failed(finish, exc, wait_s)
                time.sleep(wait_s)
                retried = True
                continue
            return self.finalize(row if row or not retried else self._written_before(finish))
        row = self._finishes(finish)  # the last try: its error is the caller's
        return self.finalize(row or self._written_before(finish))

    def _written_before(self, finish: Finish) -> TaskRow | None:
        """The row a try of ``finish`` whose answer was lost (the connection broke after its
        commit) wrote: final, by its move, at its attempt. None when another move made the
        task final (a cancel, which announced it)."""
        row = execution.final_row(self.engine, finish.task_id)
        if row is None or row["status"] != finish.move.target:
            return None
        return row if finish.attempt is None or row["attempts"] == finish.attempt else None

    def _claim_many(self, claims: list[Claim]) -> list[Claimed | None]:
        self._connect()
        assert self._claims_db is not None
        claimed = execution.claim_many(self._claims_db, claims)
        if "claims" in self._crash_after_group and len(claims) > 1:
            faults.crash()  # tests only: a group written, none of its handlers started
        return claimed

    def _finish_many(self, finishes: list[Finish]) -> list[TaskRow | None]:
        self._connect()
        assert self._finishes_db is not None
        rows = execution.finish_many(self._finishes_db, finishes)
        if "finishes" in self._crash_after_group and len(finishes) > 1:
            faults.crash()  # tests only: a group final in Postgres, none of it announced
        return rows

    def run(self, task_id: str, queue: str, *, instance: str) -> str:
        """Run the task; returns the status it ended in, 'retrying', or 'skipped' when it was
        not queued any more (a redelivered message, a cancelled task)."""
        with logs.bound(task_id=task_id, capability=capability_of(queue), instance=instance):
            spec = self.registry.for_queue(queue)
            card, bound = (queue, None) if spec is None else bound_of(spec.card)
            try:
                with self.card_runs.held(card, bound):
                    return self._run(uuid.UUID(task_id), queue, spec, instance)
            except LineClosed:
                return self._put_back(uuid.UUID(task_id), queue)

    def _run(self, tid: uuid.UUID, queue: str, spec: CapabilitySpec | None, instance: str) -> str:
        if spec is None:
            message = f"no agent on {instance} serves {queue!r}"
            return self.finish(Finish.failed(tid, task_error("capability_not_served", message)))
        claimed_at = time.monotonic()
        claimed = self.claim(_claim_of(tid, spec, instance))
        if claimed is None:
            return self._unclaimed(tid, queue, spec)
        gone = self._begin(claimed)
        if gone is not None:
            return self.finish(gone)
        running, ctx = self._prepare(claimed, spec, instance)
        if not spec.is_async:  # an async handler's goes out while its coroutine starts
            running.announce()
        outcome = self._call(spec, ctx, claimed.payload, claimed_at, running.announce)
        # Sent now if the handler never started (an invalid payload); raises if it failed,
        # whatever the handler's coroutine, cancelled then, came to.
        running.announce()
        finish, retry_in_s = self._conclude(outcome, ctx, claimed, spec)
        if retry_in_s is not None and self._retry(claimed, finish, retry_in_s):
            return "retrying"
        return self.finish(finish)

    async def run_async(self, task_id: str, queue: str, *, instance: str) -> str:
        """``run`` for an async handler, as a coroutine on the process's event loop (the
        threads pool's direct path, ``workers.pool``): the claim, the events and the finish
        go out from the loop, grouped with the other calls in flight, and no thread waits.
        The rare paths (a task not claimed, a retry, a session's next turn) run in a thread."""
        with logs.bound(task_id=task_id, capability=capability_of(queue), instance=instance):
            tid = uuid.UUID(task_id)
            spec = self.registry.for_queue(queue)
            if spec is None or not spec.is_async:
                raise LookupError(f"no async handler serves {queue!r} here")
            try:
                async with self.card_runs.held_async(*bound_of(spec.card)):
                    return await self._run_async(tid, queue, spec, instance)
            except LineClosed:
                return await asyncio.to_thread(self._put_back, tid, queue)

    def _put_back(self, tid: uuid.UUID, queue: str) -> str:
        """A run that waited for its card's room while this process began to stop: its task,
        never claimed, goes back to its queue for another process (its message here is
        acked as it ends; a copy the claim drops, should both come)."""
        found = execution.queued_message(self.engine, tid)
        if found is not None and self.republish is not None:
            trace_id, deadline_at, tenant = found["trace_id"], found["deadline_at"], found["tenant"]
            self.republish(tid, queue, trace_id, deadline_at, 0.0, tenant)
            log.info("task %s not started: this process is stopping; put back", tid)
        return "skipped"

    async def _run_async(
        self, tid: uuid.UUID, queue: str, spec: CapabilitySpec, instance: str
    ) -> str:
        self._connect_async()
        assert self._aclaims is not None
        claimed_at = time.monotonic()
        claimed = await self._aclaims(_claim_of(tid, spec, instance))
        if claimed is None:
            return await asyncio.to_thread(self._unclaimed, tid, queue, spec)
        gone = self._begin(claimed)
        if gone is not None:
            return await self.finish_async(gone)
        running, ctx = self._prepare(claimed, spec, instance, direct=True)
        outcome = await self._call_async(spec, ctx, claimed, claimed_at, running)
        await running.announce_async()  # as in ``_run``
        finish, retry_in_s = self._conclude(outcome, ctx, claimed, spec)
        if retry_in_s is not None and await asyncio.to_thread(
            self._retry, claimed, finish, retry_in_s
        ):
            return "retrying"
        return await self.finish_async(finish)

    def _unclaimed(self, tid: uuid.UUID, queue: str, spec: CapabilitySpec) -> str:
        """A message whose task could not be claimed: expired before it started, final
        already, of a tenant its card does not admit, or not to run now. Its lines carry
        the task's trace and tenant, as a claimed task's do (they carried neither)."""
        with logs.bound(**execution.trace_of(self.engine, tid)):
            return self._not_run(tid, queue, spec)

    def _not_run(self, tid: uuid.UUID, queue: str, spec: CapabilitySpec) -> str:
        overdue = execution.expire_overdue(self.engine, tid)
        if overdue is not None:
            return self.finalize(overdue)
        tenants = spec.card.tenants
        if tenants is not None:
            refused = self._refused(tid, queue, tenants)
            if refused is not None:
                return refused
        early = execution.retry_not_due(self.engine, tid)
        if early is not None and self.republish is not None:
            # A copy of its message (a sweep's, a redelivery), or its own by a clock ahead of
            # Postgres's: it goes again for when the retry is due, and the first one then runs
            trace_id, deadline_at, tenant = early["trace_id"], early["deadline_at"], early["tenant"]
            self.republish(tid, queue, trace_id, deadline_at, early["due_in_s"], tenant)
            log.info("task %s came before its retry was due; sent again for then", tid)
            return "skipped"
        # A redelivered message of a finished task: its worker may have died between the
        # final write and the final event, so the event goes out now (once: see events).
        final = execution.final_row(self.engine, tid)
        if final is not None and self.announce(final):
            log.warning("task %s was final without its final event; announced it", tid)
        if final is None:  # parked (see turns), or running by another message, or gone
            turns.mark_dropped(self.redis, tid)
            log.info("task %s waiting for its turn, running already, or gone; skipped", tid)
        else:
            log.info("task %s not queued any more; skipped", tid)
        return "skipped"

    def _refused(self, tid: uuid.UUID, queue: str, tenants: tuple[str, ...]) -> str | None:
        """A task whose tenant this card's ``tenants`` do not admit (its claim refused it);
        None when it is not one. Taken from the capability's queue (before this instance
        stopped consuming it, ``CardRef.queues``), it goes back there, for a card of every
        tenant's; from the card's own queues it goes back to the card's queue while another
        live instance of the card admits its tenant, and fails otherwise, as no card it may
        use takes from them (the card's tenants changed after routing sent it there)."""
        if queue == capability_of(queue):
            found = execution.queued_outsider(self.engine, tid, tenants)
            if found is None or self.republish is None:
                return None
            trace_id, deadline_at, tenant = found["trace_id"], found["deadline_at"], found["tenant"]
            self.republish(tid, queue, trace_id, deadline_at, REFUSED_BACK_S, tenant)
            log.warning("task %s is of a tenant this card does not admit; put back", tid)
            return "skipped"
        found = execution.queued_outsider(self.engine, tid, tenants)
        if found is None:
            return None
        if self.republish is not None and leases.admitted_by_a_live_instance(
            self.redis, queue, found["tenant"]
        ):
            # Another instance of the card admits it (their ``tenants`` differ while a
            # change rolls out): it goes back to the card's queue, for one of them.
            trace_id, deadline_at, tenant = found["trace_id"], found["deadline_at"], found["tenant"]
            self.republish(tid, home_queue(queue), trace_id, deadline_at, REFUSED_BACK_S, tenant)
            log.warning("task %s is of a tenant this instance does not admit; put back", tid)
            return "skipped"
        refused = execution.fail_outsider(self.engine, tid, tenants)
        if refused is None:
            return None
        log.warning("task %s is of a tenant this card does not admit; failed", tid)
        return self.finalize(refused)

    def _begin(self, claimed: Claimed) -> Finish | None:
        """A claimed task's log fields; the failure to write instead, when its session is
        gone."""
        logs.bind(trace_id=claimed.trace_id, tenant=claimed.tenant)
        log.info("task claimed", extra={"attempt": claimed.attempt})
        if claimed.session_id is not None and claimed.session is None:
            gone = task_error("session_not_found", "its session expired or was deleted")
            return Finish.failed(claimed.task_id, gone, attempt=claimed.attempt)
        if claimed.session is not None and claimed.session.get("written"):
            # An earlier attempt wrote its session, then its worker was lost (an attempt
            # that writes and fails is not retried, ``_conclude``): run again, the turn
            # would be applied twice.
            lost = task_error(
                "worker_lost",
                "its worker was lost after the task wrote its session: not run again",
            )
            return Finish.failed(claimed.task_id, lost, attempt=claimed.attempt)
        return None

    def _prepare(
        self, claimed: Claimed, spec: CapabilitySpec, instance: str, *, direct: bool = False
    ) -> tuple[Running, Context]:
        """The task's ``running`` event and the context its handler gets. ``direct``: the
        task runs on the event loop, and its events are appended from there."""
        tid, attempt = claimed.task_id, claimed.attempt
        # Every event of the attempt carries it: once a later attempt has begun, a stale one's
        # progress and outputs are refused (``events``).
        trace_id, tenant = claimed.trace_id, claimed.tenant
        ttl_s = claimed.result_ttl_s + EVENTS_SLACK_S
        # The log lasts as long as the row its streams read it for (``held_expiry``): a
        # handler silent past ``ttl_s`` outlived its log, whose ids began again at 1.
        hold_s = execution.RUN_HOLD_S
        append_async = None
        if direct:
            aevents = self._aevents
            assert aevents is not None
            append_async = functools.partial(
                aevents.append_async,
                tid,
                trace_id=trace_id,
                tenant=tenant,
                ttl_s=ttl_s,
                attempt=attempt,
                hold_s=hold_s,
            )
        running = Running(
            functools.partial(
                self.events.append,
                tid,
                trace_id=trace_id,
                tenant=tenant,
                ttl_s=ttl_s,
                attempt=attempt,
                hold_s=hold_s,
            ),
            {"status": RUNNING, "attempt": claimed.attempt, "instance": instance},
            append_async=append_async,
        )
        publish = running.publish
        reports = Bucket(PROGRESS_BURST, PROGRESS_PER_S)
        ctx = Context(
            task_id=tid,
            capability=claimed.capability,
            trace_id=claimed.trace_id,
            attempt=claimed.attempt,
            deadline_at=claimed.deadline_at,
            session_id=claimed.session_id,
            metadata=claimed.metadata,
            session=self._session_of(claimed),
            _progress_sink=lambda p: self._progress(tid, attempt, p, publish),
            _progress_gate=reports.take,
            _readiness_sink=self._readiness_sink(instance, spec.name),
            _output_sink=lambda chunk: publish(events.OUTPUT, self._checked(chunk)),
            _cancel_probe=lambda: bool(self.redis.exists(cancellation.flag_key(tid))),
        )
        if direct:
            ctx._async_output_sink = lambda chunk: running.publish_async(
                events.OUTPUT, self._checked(chunk)
            )
        return running, ctx

    def _conclude(
        self, outcome: Outcome, ctx: Context, claimed: Claimed, spec: CapabilitySpec
    ) -> tuple[Finish, float | None]:
        """The final write an outcome calls for, and when it is a failure that may be tried
        again, the delay before the next attempt (None: it is not retried)."""
        tid, attempt = claimed.task_id, claimed.attempt  # a stale attempt's writes miss
        if isinstance(outcome, Succeeded):
            finish = Finish.succeeded(
                tid, outcome.result, attempt=attempt, result_size=outcome.size
            )
            return finish, None
        left = ctx.time_left_s()
        if (
            not outcome.expired
            and left is not None
            and left <= DEADLINE_SLACK_S
            and outcome.error["code"] != "cancelled"
        ):
            # A failure at the deadline is the deadline's, as a late result is: the agent was
            # cut short (a remote one may stop at the deadline it was sent, by a clock that
            # reads milliseconds, a moment before the broker does).
            outcome = Failed(timed_out(outcome.error), expired=True)
        if outcome.expired:
            return Finish.expired(tid, outcome.error, attempt=attempt), None
        if outcome.error["retryable"] and ctx.session is not None and ctx.session.written:
            # Tried again, the turn would be applied to the revision it wrote itself.
            error = {**outcome.error, "retryable": False}
            error["message"] = f"{error['message']} (not retried: the task wrote its session)"
            return Finish.failed(tid, error, attempt=attempt), None
        decision = retry.decide(
            retryable=outcome.error["retryable"],
            attempt=claimed.attempt,
            limit=retry.attempt_limit(claimed.max_attempts, spec.card.max_attempts),
            deadline_at=claimed.deadline_at,
            now=datetime.now(UTC),
            requested_delay_s=outcome.delay_s,
        )
        delay_s = decision.delay_s if decision.retry else None
        return Finish.failed(tid, outcome.error, attempt=attempt), delay_s

    def _session_of(self, claimed: Claimed) -> Session | None:
        if claimed.session_id is None or claimed.session is None:
            return None
        store = SessionStore(
            self.engine,
            claimed.tenant,
            claimed.session_id,
            claimed.task_id,
            self.settings.session_max_bytes,
            self.settings.session_revisions_kept,
            claimed.attempt,
        )
        return store.session(claimed.session)

    def _retry(
        self,
        claimed: Claimed,
        failed: Finish,
        delay_s: float,
    ) -> bool:
        """Queue the task again after ``failed``'s error; False when it cannot be."""
        err = failed.outcome
        # A hinted task goes again to any instance of its card: affinity is a preference.
        home = home_queue(claimed.queue)
        if (
            self.republish is None
            or execution.requeue(
                self.engine,
                claimed.task_id,
                err,
                attempt=claimed.attempt,
                queue=home,
                delay_s=delay_s,
            )
            is None
        ):
            return False
        metrics.task_retries.labels(capability_of(claimed.queue)).inc()
        log.info("task will run again", extra={"delay_s": round(delay_s, 3), "code": err["code"]})
        self.events.append(
            claimed.task_id,
            events.STATUS,
            {
                "status": QUEUED,
                "retry_in_s": round(delay_s, 3),
                "attempt": claimed.attempt,
                "error": err,
            },
            trace_id=claimed.trace_id,
            tenant=claimed.tenant,
            ttl_s=claimed.result_ttl_s + EVENTS_SLACK_S,
            attempt=claimed.attempt + 1,  # it opens the next attempt
        )
        self.republish(
            claimed.task_id, home, claimed.trace_id, claimed.deadline_at, delay_s, claimed.tenant
        )
        return True

    def _progress(
        self, tid: uuid.UUID, attempt: int, progress: dict[str, Any], publish: Any
    ) -> None:
        """A report the task's rate let through (``Context._progress_gate``)."""
        if not execution.report_progress(self.engine, tid, progress, attempt=attempt):
            return  # the task is not this attempt's any more (final, cancelled, or requeued)
        publish(events.PROGRESS, progress)
        for hook in self.on_progress:
            try:
                hook(tid)
            except Exception:  # progress is advisory: a hook must not fail the agent
                log.exception("progress hook %r failed for task %s", hook, tid)

    def finalize(self, row: TaskRow | None) -> str:
        """Announce a final state: its event, then the hooks. Returns the status.

        A session's turn releases its session first (``_release_next_turn``): a caller told
        by the final event sends the next turn at once, and found the session gone when
        the turn had held it past its idle TTL, until that release restarted it."""
        if row is None:  # moved to a final state by someone else (cancelled), who announced it
            return "skipped"
        self._finished(row)
        self._release_next_turn(row)
        self.announce(row)
        return self._hooks(row)

    async def finish_async(self, finish: Finish) -> str:
        """``finish`` from the event loop (``run_async``)."""
        assert self._afinishes is not None and self._aevents is not None
        row = await self._final_row_async(finish)
        if row is None:
            return "skipped"
        self._finished(row)
        if turns.of_row(row) is not None:  # before the final event, as ``finalize``
            await asyncio.to_thread(self._release_next_turn, row)
        await self._aevents.append_final_async(row)
        # The hooks run here, on the loop. The webhooks' publishes one message, and only for
        # a task with a callback or whose tenant subscribes (the row says which): one short
        # Redis call then, where a thread for every task's hooks would cost more CPU.
        return self._hooks(row)

    async def _final_row_async(self, finish: Finish) -> TaskRow | None:
        """The row ``finish`` wrote, tried again while Postgres is away (as ``finish``)."""
        assert self._afinishes is not None
        retried = False
        for wait_s in FINISH_RETRY_S:
            try:
                row = await self._afinishes(finish)
            except INFRASTRUCTURE_ERRORS as exc:
                _final_write_failed(finish, exc, wait_s)
                await asyncio.sleep(wait_s)
                retried = True
                continue
            if row is None and retried:
                return await asyncio.to_thread(self._written_before, finish)
            return row
        row = await self._afinishes(finish)  # the last try: its error is the caller's
        return row or await asyncio.to_thread(self._written_before, finish)

    def _finished(self, row: TaskRow) -> None:
        if self._crash_after_finish and capability_of(row["queue"]) in self._crash_after_finish:
            faults.crash()  # tests only: see workers.faults
        metrics.labelled(metrics.tasks_finished, capability_of(row["queue"]), row["status"]).inc()
        log.info(
            "task finished",
            extra={"status": row["status"], "code": (row["error"] or {}).get("code")},
        )

    def _hooks(self, row: TaskRow) -> str:
        for hook in self.on_final:
            try:
                hook(row)
            except Exception:  # the task is final either way; a hook must not undo that
                log.exception("final hook %r failed for task %s", hook, row["id"])
        return str(row["status"])

    def _release_next_turn(self, row: TaskRow) -> None:
        """A session's task went final: the session's next turn may run (``turns``), and the
        mark of a message of it dropped while it waited is of no use any more."""
        place = turns.of_row(row)
        if place is None:
            return
        try:
            with self.engine.begin() as conn:
                turns.ended(conn, place[0])
                due = turns.next_due(conn, *place) if self.republish is not None else None
            if (
                due is not None and self.republish is not None
            ):  # a turn of the same session: the same tenant's
                self.republish(
                    due.task_id, due.queue, due.trace_id, due.deadline_at, 0.0, row["tenant"]
                )
            turns.take_dropped(self.redis, row["id"])
        except Exception:  # the task is final either way; the sweeper publishes the next turn
            log.exception("could not release the turn after task %s", row["id"])

    def announce(self, row: TaskRow) -> bool:
        """Append the final event of a final task row; False when its log had one already."""
        return self.events.append_final(row) > 0

    def _checked(self, value: Any) -> Any:
        """A value that will go out as JSON; agents get a TypeError/ValueError otherwise."""
        self._size(value)
        return value

    def _size(self, value: Any) -> int:
        """The bytes of ``value`` as the API will send it (``jsonbody.sent_size``); a
        TypeError/ValueError when it is no JSON, BadRequest when Postgres would refuse it or
        it is nested past ``max_json_depth``."""
        data = jsonbody.written(value, max_depth=self.settings.max_json_depth)
        return jsonbody.sent_size(data)

    def _readiness_sink(self, instance: str, capability: str) -> Any:
        def apply(ready: bool, for_s: float) -> None:
            if ready:
                leases.mark_ready(self.redis, instance, capability)
            else:
                leases.mark_not_ready(self.redis, instance, capability, for_s)

        return apply

    def _call(
        self,
        spec: CapabilitySpec,
        ctx: Context,
        payload: Any,
        claimed_at: float,
        announce: Callable[[], None],
    ) -> Outcome:
        invalid = _invalid(spec, payload)
        if invalid is not None:
            return invalid
        limit_s = _limit_s(spec, ctx, self.settings.default_task_timeout_s)
        if limit_s <= 0:  # the deadline passed while the payload was checked
            return _too_late()
        with metrics.labelled(metrics.task_run, spec.name).time():
            try:
                result = self._result_of(spec, ctx, payload, limit_s, claimed_at, announce)
            except Exception as exc:
                return _failure(exc, spec, ctx)
        return self._succeeded(result)

    async def _call_async(
        self,
        spec: CapabilitySpec,
        ctx: Context,
        claimed: Claimed,
        claimed_at: float,
        running: Running,
    ) -> Outcome:
        """``_call`` on the event loop: the handler's coroutine runs as a task of its own."""
        payload = claimed.payload
        invalid = await _invalid_async(spec, payload, claimed.payload_size)
        if invalid is not None:
            return invalid
        limit_s = _limit_s(spec, ctx, self.settings.default_task_timeout_s)
        if limit_s <= 0:  # as in ``_call``
            return _too_late()
        tid = ctx.task_id

        async def cancelled() -> bool:
            assert self._aredis is not None
            return bool(await self._aredis.exists(cancellation.flag_key(tid)))

        with metrics.labelled(metrics.task_run, spec.name).time():
            try:
                result = await self.calls.arun(
                    tid,
                    _awaited(spec, ctx, payload),
                    timeout_s=limit_s,
                    claimed_at=claimed_at,
                    cancelled=cancelled,
                    started=running.announce_async,
                )
            except Exception as exc:
                return _failure(exc, spec, ctx)
        return self._succeeded(result)

    def _succeeded(self, result: Any) -> Outcome:
        try:
            size = self._size(result)
        except Exception as exc:  # what the JSON writer refused, or what the value raised
            message = f"the agent returned no valid JSON: {said(exc)}"
            return Failed(task_error("result_invalid", message))
        limit = self.settings.max_result_bytes
        if size > limit:
            message = f"the agent returned {size} bytes of JSON, over the limit of {limit}"
            return Failed(task_error("result_too_large", message))
        return Succeeded(result, size)

    def _result_of(
        self,
        spec: CapabilitySpec,
        ctx: Context,
        payload: Any,
        limit_s: float | None,
        claimed_at: float,
        announce: Callable[[], None],
    ) -> Any:
        """What the handler came to. An async handler runs on the process's event loop and is
        cancelled when its time is up. A sync one is interrupted by SIGALRM where it runs in
        its process's main thread (prefork, solo); elsewhere (the threads pool) nothing can
        stop it, and a result that comes after its time is not taken."""
        if spec.is_async:
            call = _awaited(spec, ctx, payload)
            cancelled = lambda: ctx.cancelled  # noqa: E731
            return self.calls.run(
                ctx.task_id,
                call,
                timeout_s=limit_s,
                claimed_at=claimed_at,
                cancelled=cancelled,
                started=announce,
            )
        started = time.monotonic()
        try:
            with soft_limit(limit_s):
                result = spec.handler(ctx, payload)
                if inspect.isawaitable(result):
                    _refuse_awaitable(result)
                if inspect.isgenerator(result):
                    stop_at = None if limit_s is None else started + limit_s
                    result = _drain_generator(result, ctx, stop_at)
        except SoftTimeLimit:
            raise
        except BaseException as exc:
            exiting = isinstance(exc, SystemExit | KeyboardInterrupt)
            if exiting and self._signals_reach(threading.current_thread()):
                raise  # a signal's (solo, the worker's own Ctrl-C or warm stop): Celery's
            # A failure past its time is its time's, as a result is: it was a failure of
            # the agent's, or a retry, that ran the task again past its time.
            if limit_s is not None and time.monotonic() - started > limit_s:
                raise SoftTimeLimit("the handler failed after its time limit") from exc
            if isinstance(exc, Exception):
                raise
            raise HandlerExited(f"the handler raised {said(exc, repr)}") from exc
        if limit_s is not None and time.monotonic() - started > limit_s:
            raise SoftTimeLimit("the handler returned after its time limit")
        return result

    def _signals_reach(self, thread: threading.Thread) -> bool:
        """Whether a ``SystemExit`` or ``KeyboardInterrupt`` raised in ``thread`` may be a
        signal's, not the handler's: in the worker's own main thread (the solo pool), or in
        a prefork child once billiard's SIGTERM handler ran there (a cancel's terminate, a
        cold stop: it raises ``SystemExit`` for the child to end)."""
        if thread is not threading.main_thread():
            return False
        return not self.in_pool_child or _terminating()


def _terminating() -> bool:
    """Whether billiard's terminate handler ran in this pool child; True where billiard
    cannot tell (an exit is then Celery's, as before)."""
    fired = getattr(billiard.common, "terminate_handler_fired", None)
    return True if fired is None else bool(fired())


class Running:
    """A task's ``running`` event, sent once, and every later event of the task after it.

    For an async handler it goes out while the handler's coroutine starts on the event loop
    (``Calls.run``'s ``started``), not before: the Redis round trip and the hop to the loop
    overlap. Events the handler sends meanwhile wait for it, so the log stays in order. If it
    cannot be sent, ``announce`` raises, as it did before the handler started.
    ``append_async``: the task runs on the event loop itself, which sends it
    (``announce_async``) and the handler's outputs (``publish_async``). There a handler's
    sync ``ctx.progress`` or ``ctx.emit`` made before the ``running`` event is out cannot
    wait for it: the loop it would block is the one sending it, and every task of the
    process stopped with it, for good. Such events are kept, and sent right after it.
    """

    def __init__(
        self,
        append: Callable[[str, Any], Any],
        data: dict[str, Any],
        *,
        append_async: Callable[[str, Any], Awaitable[Any]] | None = None,
    ) -> None:
        self._append = append
        self._append_async = append_async
        self._data = data
        self._lock = threading.Lock()
        self._sent = threading.Event()
        self._sent_here = asyncio.Event() if append_async is not None else None
        self._early: list[tuple[str, Any]] = []  # made on the loop before it was sent
        self._error: BaseException | None = None

    def announce(self) -> None:
        """Send it, once; raises (each time) when that failed."""
        with self._lock:
            if not self._sent.is_set():
                try:
                    for wait_s in ANNOUNCE_RETRY_S:  # a blip: the claim stands, wait it out
                        try:
                            self._append(events.STATUS, self._data)
                            break
                        except REDIS_BLIPS:
                            time.sleep(wait_s)
                    else:
                        self._append(events.STATUS, self._data)
                except BaseException as exc:
                    self._error = exc
                finally:
                    self._sent.set()  # the handler's events go on (and meet the same error)
            if self._error is not None:
                raise self._error

    async def announce_async(self) -> None:
        """``announce`` from the event loop, which is the only caller then."""
        assert self._append_async is not None and self._sent_here is not None
        if not self._sent.is_set():
            try:
                for wait_s in ANNOUNCE_RETRY_S:  # as ``announce``
                    try:
                        await self._append_async(events.STATUS, self._data)
                        break
                    except REDIS_BLIPS:
                        await asyncio.sleep(wait_s)
                else:
                    await self._append_async(events.STATUS, self._data)
            except BaseException as exc:
                self._error = exc
            try:
                if self._error is None:
                    await self._send_early()
            finally:
                self._sent.set()
                self._sent_here.set()
        if self._error is not None:
            raise self._error

    async def _send_early(self) -> None:
        """The handler's events made before the ``running`` event was out, in order. One
        refused (over the task's event budget) fails the handler, as it would have had it
        been sent at once; it raises here, once: the ``running`` event itself is out, and
        the call that awaits it again before the finish goes on."""
        assert self._append_async is not None
        while self._early:  # the handler may add more while one is written
            await self._append_async(*self._early.pop(0))

    def publish(self, event_type: str, data: Any) -> None:
        if self._append_async is not None and not self._sent.is_set() and _on_a_loop():
            self._early.append((event_type, data))
            return
        self._sent.wait()
        self._append(event_type, data)

    async def publish_async(self, event_type: str, data: Any) -> None:
        assert self._append_async is not None and self._sent_here is not None
        await self._sent_here.wait()
        await self._append_async(event_type, data)


def _on_a_loop() -> bool:
    """Whether this thread is running an event loop (a sync call from a coroutine)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _final_write_failed(finish: Finish, exc: BaseException, wait_s: float) -> None:
    log.warning("task %s: its final write failed (%r); again in %gs", finish.task_id, exc, wait_s)


def _claim_of(tid: uuid.UUID, spec: CapabilitySpec, instance: str) -> Claim:
    """An idempotent agent's claim need not reach the disk before its handler starts
    (``execution``): a Postgres crash that forgets it only runs the task again."""
    card = spec.card
    return Claim(
        tid,
        card.agent_id,
        card.version,
        instance,
        durable=not card.idempotent,
        tenants=card.tenants,
    )


def _invalid(spec: CapabilitySpec, payload: Any) -> Failed | None:
    """The failure of a payload its capability's schema refuses; None when it is valid."""
    validator = spec.validator
    if validator is None:
        return None
    try:
        problems = schemas.problems(validator, payload)
    except schemas.PayloadUncheckable as exc:
        return Failed(task_error("payload_invalid", f"it cannot be checked: {exc}"))
    if not problems:
        return None
    detail = "; ".join(
        f"{'/'.join(map(str, p.path)) or '<root>'}: {p.message}" for p in problems[:10]
    )
    return Failed(task_error("payload_invalid", detail))


async def _invalid_async(spec: CapabilitySpec, payload: Any, payload_size: int) -> Failed | None:
    """``_invalid`` from the event loop. The check is Python over every node (about 2 s for a
    MiB of integers), and the loop runs every call of this process (on the bridge, every
    tenant's): a payload past ``ON_LOOP_BYTES`` is checked in a thread (``off_the_loop``)."""
    if spec.validator is None or payload_size <= ON_LOOP_BYTES:
        return _invalid(spec, payload)
    return await off_the_loop(_invalid, spec, payload)


def _too_late() -> Failed:
    """A task whose deadline passed after its claim, before its handler started (its payload's
    check took the time left): it ends as one not claimed before its deadline does
    (``execution.expire_overdue``), and its handler never runs."""
    error = task_error("deadline_exceeded", "its deadline passed before its handler started")
    return Failed(error, expired=True)


def _limit_s(spec: CapabilitySpec, ctx: Context, default_s: float) -> float:
    """How long the handler may run: its agent's timeout (``default_s`` when its card sets
    none) or the time left to the deadline, whichever is shorter; 0 when the deadline has
    passed. Without the default, an async handler on the threads pool, where Celery's hard
    limit does not act (a remote agent's call on the bridge), could run for ever."""
    timeout_s = spec.card.timeout_s or default_s
    left_s = ctx.time_left_s()
    return timeout_s if left_s is None else min(timeout_s, left_s)


def _failure(exc: Exception, spec: CapabilitySpec, ctx: Context) -> Failed:
    """What a handler that raised ``exc`` (or was stopped) came to."""
    if isinstance(exc, (SoftTimeLimit, CallTimedOut)):
        message = "the agent ran past its time limit"
        if isinstance(exc.__cause__, Exception):  # it failed, late: what it failed with
            cause = _failure(exc.__cause__, spec, ctx).error
            message = f"{message} ({cause['code']}: {cause['message']})"
        return Failed(task_error("timeout", message), expired=True)
    if isinstance(exc, CallCancelled):
        return Failed(task_error("cancelled", "cancelled by the caller"))
    if isinstance(exc, Retryable):
        return Failed(task_error(exc.code, exc.message, retryable=True), delay_s=exc.delay_s)
    if isinstance(exc, AgentFailure):
        return Failed(task_error(exc.code, exc.message, retryable=exc.retryable))
    if isinstance(exc, AGENT_TRANSIENT_ERRORS):
        message = f"{type(exc).__name__}: {said(exc)}"
        return Failed(task_error("transient_error", message, retryable=True))
    log.exception("agent %s failed on task %s", spec.card.agent_id, ctx.task_id, exc_info=exc)
    if isinstance(exc, sqlalchemy.exc.StatementError):
        return Failed(task_error("agent_error", f"{type(exc).__name__}: {HIDDEN}"))
    return Failed(task_error("agent_error", f"{type(exc).__name__}: {said(exc)}"))


def timed_out(cause: dict[str, Any]) -> dict[str, Any]:
    return task_error("timeout", f"the deadline passed ({cause['code']}: {cause['message']})")


@dataclass(frozen=True)
class Succeeded:
    result: Any
    size: int  # its bytes as the API sends it, kept with it (``Finish.result_size``)


@dataclass(frozen=True)
class Failed:
    """``expired``: the handler ran past its time (status ``expired``); ``delay_s``: the back-off
    the agent asked for (``Retryable``)."""

    error: dict[str, Any]
    expired: bool = False
    delay_s: object = None  # as given: ``retry.decide`` reads it


Outcome = Succeeded | Failed  # what calling a handler came to


async def _awaited(spec: CapabilitySpec, ctx: Context, payload: Any) -> Any:
    """An async handler's result. An async generator's items are output chunks, sent in
    order, and its result is the list of them (an async generator cannot return a value).
    A chunk refused (no JSON, over the task's event budget) is raised in the generator where
    it yielded it, as ``emit_async`` raises in a handler that calls it: it may catch it."""
    if not spec.is_async_generator:
        return await spec.handler(ctx, payload)
    generator = spec.handler(ctx, payload)
    chunks: list[Any] = []
    refused: Exception | None = None
    while True:
        try:
            chunk = await (anext(generator) if refused is None else generator.athrow(refused))
        except StopAsyncIteration:
            return {"outputs": chunks}
        refused = None
        try:
            await ctx.emit_async(chunk)
        except Exception as exc:
            refused = exc
            continue
        chunks.append(chunk)


def _refuse_awaitable(result: Any) -> NoReturn:
    """A sync handler that returned a coroutine (a ``lambda`` around an ``async def``, say):
    nothing here can await it, and it failed its task ``result_invalid``, a coroutine being
    no JSON. Its task fails saying what to register instead, and the coroutine is closed
    (not left to warn that it was never awaited)."""
    close = getattr(result, "close", None)
    if callable(close):
        close()
    raise AgentFailure(
        f"the handler returned {type(result).__name__}, an awaitable, and is not async: "
        "register the async def itself (or an object whose __call__ is one)",
        code="agent_error",
    )


def _drain_generator(generator: Any, ctx: Context, stop_at: float | None) -> Any:
    """A generator handler: each yielded item is an output chunk; what it returns is the
    result, or, when it returns nothing, the list of chunks. A chunk refused is raised in
    the generator, as in ``_awaited``.

    Between chunks it is closed when its time is up (``stop_at``, on the monotonic clock) or
    the caller cancelled its task (asked at most every ``CANCEL_PROBE_S``): on the threads
    pool nothing else stops a sync handler, and a stream that never ended ran for good."""
    chunks: list[Any] = []
    refused: Exception | None = None
    probed = time.monotonic()
    while True:
        try:
            chunk = next(generator) if refused is None else generator.throw(refused)
        except StopIteration as stop:
            return stop.value if stop.value is not None else {"outputs": chunks}
        refused = None
        try:
            ctx.emit(chunk)
        except SoftTimeLimit:
            raise  # its time (SIGALRM, prefork) came during the write: not the chunk's
        except Exception as exc:
            refused = exc
            continue
        chunks.append(chunk)
        now = time.monotonic()
        if stop_at is not None and now > stop_at:
            generator.close()
            raise SoftTimeLimit("the handler ran past its time limit")
        if now - probed >= CANCEL_PROBE_S:
            probed = now
            if ctx.cancelled:
                generator.close()
                raise CallCancelled("the caller cancelled the task")


class Bucket:
    """A token bucket of ``burst`` tokens refilled at ``per_s`` a second: ``take`` says
    whether one was there (and takes it). For one task's reports; threads that race on it
    may let one more through, which is harmless here."""

    def __init__(
        self, burst: int, per_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst, self.per_s, self._clock = burst, per_s, clock
        self._tokens = float(burst)
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.per_s)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
