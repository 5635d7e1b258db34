"""The Celery app of the workers: the composition root on the worker side."""

from __future__ import annotations

import importlib
import logging
import os
import uuid
from datetime import datetime
from typing import Any

from celery import Celery, signals
from prometheus_client import multiprocess, start_http_server

from broker import runtime, sessions
from broker.observability import logs, metrics, otel
from broker.outages import INFRASTRUCTURE_ERRORS
from broker.registry import retention
from broker.settings import Settings
from broker.tasks import execution
from broker.tasks.backpressure import FairPlace, count_queued
from broker.tasks.dispatch import (
    PURGE_TASK,
    REAP_TASK,
    RUN_TASK,
    SWEEP_TASK,
    VISIBILITY_TIMEOUT_S,
    celery_config,
    redis_depth,
    send_run,
)
from workers.lease_keeper import lease_step
from workers.loop_consumer import LoopConsumer, loop_consumer_step
from workers.pool import Direct, use_direct_pool
from workers.runner import Republish, Runner
from workers.sdk.agent import AgentRegistry, agent
from workers.system import recovery
from workers.system.webhooks import register as register_webhooks

log = logging.getLogger("reach.worker")
HARD_LIMIT_GRACE_S = 30
AMQP_SCHEMES = ("amqp://", "amqps://", "pyamqp://")  # RabbitMQ, as Celery's broker URL names it
INFRA_RETRY_S = 2


def load_agents(modules: list[str]) -> None:
    """Import the modules that hold agents; their decorators register them."""
    for module in modules:
        importlib.import_module(module)


def hard_time_limit_s(settings: Settings, registry: AgentRegistry) -> float:
    """Celery's hard limit: the longest agent timeout plus a grace for the soft limit to act.

    It must stay below the broker's redelivery timeout, or a worker refuses to start: past it
    a Redis broker hands a still-running task to a second worker (the visibility timeout), and
    RabbitMQ closes the channel of a delivery still unacked (late ack) and puts back every
    delivery on it (the server's ``consumer_timeout``).
    """
    longest = max(
        (s.card.timeout_s or settings.default_task_timeout_s for s in registry),
        default=settings.default_task_timeout_s,
    )
    hard = longest + HARD_LIMIT_GRACE_S
    bound_s, bound = redelivery_timeout(settings)
    if hard >= bound_s:
        raise RuntimeError(
            f"an agent timeout of {longest:.0f}s needs a hard limit of {hard:.0f}s, not below "
            f"{bound}"
        )
    return hard


def redelivery_timeout(settings: Settings) -> tuple[float, str]:
    """How long the broker waits for a delivery's ack before it gives the message out again,
    and what sets it and what to do, for the message of a worker that refuses to start."""
    if settings.celery_broker_url.startswith(AMQP_SCHEMES):
        timeout_s = settings.broker_consumer_timeout_s
        return timeout_s, (
            f"RabbitMQ's consumer_timeout (REACH_BROKER_CONSUMER_TIMEOUT_S: {timeout_s:.0f}s):"
            " shorten the timeout, or raise consumer_timeout on the RabbitMQ server and"
            " REACH_BROKER_CONSUMER_TIMEOUT_S with it"
        )
    return VISIBILITY_TIMEOUT_S, (
        f"the broker's visibility timeout of {VISIBILITY_TIMEOUT_S}s: shorten the timeout"
    )


def _configure_logging(loglevel: str | int = "INFO", **_: object) -> None:
    # Connected to Celery's setup_logging: Celery then leaves logging to us.
    logs.configure(level=logging.getLevelName(loglevel) if isinstance(loglevel, int) else loglevel)
    logging.getLogger("celery.worker.control").addFilter(_no_backend_to_mark)


def _no_backend_to_mark(record: logging.LogRecord) -> bool:
    """Drops Celery's warning that a revoked task could not be marked in the result backend
    when there is none to mark it in (ours: a task's state is in Postgres). A cancel of a
    running task of a cancellable card is a revoke broadcast to every worker, and each one
    that did not run it logged the warning, for every such cancel."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (
        record.msg == "Failed to mark task %s as revoked in backend: %s"
        and len(args) == 2
        and isinstance(args[1], NotImplementedError)
    )


def serve_metrics(host: str, port: int) -> None:
    """The worker's /metrics, merged over its pool processes, from its main process. It has no
    authentication: it listens on loopback unless ``worker_metrics_host`` says otherwise."""
    if not port:
        return
    try:
        start_http_server(port, addr=host, registry=metrics.merged_registry())
        log.info("worker metrics on %s:%d/metrics", host, port)
    except OSError as exc:
        log.warning("worker metrics not served: %s:%d: %s", host, port, exc)


def _forget_process_metrics(pid: int | None = None, **_: object) -> None:
    if pid is not None and "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


def _republish(app: Celery, settings: Settings, runner: Runner) -> Republish:
    """``Runner.republish``: retries, a session's turns that came due, recoveries. Each goes
    where its tenant's fair slice of the queue puts it, as a submit does; only a Redis
    broker has that order (``dispatch.send_run``), so only there is anything read."""
    redis_broker = settings.celery_broker_url.startswith(("redis://", "rediss://"))
    fair = FairPlace(
        lambda queue: redis_depth(app, queue),
        lambda tenant, queue, limit: count_queued(runner.engine, tenant, queue, limit),
        settings.queue_fair_slice if redis_broker else 0,
    )

    def republish(
        task_id: uuid.UUID,
        queue: str,
        trace_id: str,
        deadline_at: datetime | None,
        countdown_s: float,
        tenant: str,
    ) -> None:
        send_run(
            app,
            task_id,
            queue,
            trace_id=trace_id,
            tenant=tenant,
            deadline_at=deadline_at,
            countdown_s=countdown_s,
            behind=fair.behind(queue, tenant),
        )

    return republish


def create_celery_app(settings: Settings, registry: AgentRegistry = agent) -> Celery:
    app = Celery("workers", set_as_current=True)
    app.conf.update(celery_config(settings))
    if settings.celery_broker_url.startswith(("redis://", "rediss://")):
        app.conf.broker_transport = "workers.transport:Transport"  # intake in batches
    app.conf.beat_schedule = {
        "purge-expired-tasks": {"task": PURGE_TASK, "schedule": settings.janitor_interval_s},
        "reap-lost-tasks": {"task": REAP_TASK, "schedule": settings.reaper_interval_s},
        "sweep-queued-tasks": {"task": SWEEP_TASK, "schedule": settings.sweep_interval_s},
    }
    if settings.otel:
        otel.setup_tracing("agent-reach-worker")
        otel.instrument_celery()
    load_agents(settings.agents)
    app.conf.task_time_limit = hard_time_limit_s(settings, registry)
    runner = Runner(settings, registry)
    if not settings.otel:  # Celery's tracer makes the OTel spans: with them, every task uses it
        app.reach_direct = Direct(runner)  # -P threads: async handlers without a thread
        if settings.celery_broker_url.startswith(("redis://", "rediss://")):
            # ... and their messages taken on the loop, not by Celery's consumer thread
            app.reach_loop_consumer = LoopConsumer(
                app.reach_direct, settings.celery_broker_url, settings.max_slots_share
            )
            app.steps["consumer"].add(loop_consumer_step(app.reach_loop_consumer))
    signals.worker_init.connect(use_direct_pool, weak=False)
    # In the worker's main process, before the pool's children fork (they inherit it).
    signals.worker_init.connect(
        lambda **_: runtime.tune_collector(settings.gc_gen0_threshold), weak=False
    )
    signals.worker_init.connect(lambda **_: runtime.keep_cancels(), weak=False)

    def in_pool_child(**_: object) -> None:
        runner.in_pool_child = True

    signals.worker_process_init.connect(in_pool_child, weak=False)
    # A stop: runs waiting for their card's room go back to their queues, not run on the way out
    signals.worker_shutting_down.connect(lambda **_: runner.card_runs.close(), weak=False)
    webhooks = register_webhooks(app, settings, lambda: runner.engine)
    runner.on_final.append(webhooks.on_final)
    runner.on_progress.append(webhooks.on_progress)
    runner.republish = _republish(app, settings, runner)
    app.reach_republish = runner.republish  # the lease keeper's rehomed hints go the same way
    # Tasks claimed under this worker's name that it no longer holds (``lease_keeper.orphans``)
    app.reach_recover_orphans = lambda rows: recovery.recover_lost(
        runner, rows, "its run ended without a final write, or its pool process died"
    )
    app.steps["consumer"].add(lease_step(settings, registry, app.reach_recover_orphans))

    def drain_on_shutdown(**_: object) -> None:
        # From the signal on, no run starts here: Celery stops the consumer (and its step
        # pauses this one) only after the pool, and runs ending before then made room for
        # more (five more started in 0.5 s after a SIGTERM)
        taking = getattr(app, "reach_loop_consumer", None)
        if taking is not None:
            taking.pause()
        keeper = getattr(app, "reach_lease_keeper", None)
        if keeper is not None:
            keeper.begin_drain(stop_consuming=False)

    signals.worker_shutting_down.connect(drain_on_shutdown, weak=False)
    signals.setup_logging.connect(_configure_logging, weak=False)
    signals.worker_ready.connect(
        lambda **_: serve_metrics(settings.worker_metrics_host, settings.worker_metrics_port),
        weak=False,
    )
    signals.worker_process_shutdown.connect(_forget_process_metrics, weak=False)

    @app.task(  # type: ignore[untyped-decorator]
        name=RUN_TASK, bind=True, Strategy="workers.pool:run_strategy"
    )
    def run(self: Any, task_id: str, queue: str) -> str:
        try:
            return runner.run(task_id, queue, instance=self.request.hostname or "unknown")
        except INFRASTRUCTURE_ERRORS as exc:
            # Postgres or Redis is away: keep the message (a new one, later) instead of losing
            # it. A task claimed before the outage is found by the orphan check.
            raise self.retry(exc=exc, countdown=INFRA_RETRY_S, max_retries=None) from exc

    @app.task(name=PURGE_TASK)  # type: ignore[untyped-decorator]
    def purge_expired() -> int:
        # Queued tasks past their TTL end first, each told as a final state is (the sweep
        # ends them too, more often); only final tasks are deleted.
        recovery.end_unstarted(
            runner, batch=settings.janitor_batch, budget_s=settings.janitor_budget_s
        )
        removed = execution.purge_expired(
            runner.engine, batch=settings.janitor_batch, budget_s=settings.janitor_budget_s
        )
        gone = sessions.purge_expired(runner.engine, batch=settings.janitor_batch)
        if gone:
            log.info("janitor removed %d expired sessions", gone)
        instances = retention.purge_gone(
            runner.engine,
            runner.redis,
            retention_s=settings.instance_retention_s,
            batch=settings.janitor_batch,
            budget_s=settings.janitor_budget_s,
        )
        if instances:
            log.info("janitor removed %d instances gone longer than the retention", instances)
        return removed

    @app.task(name=REAP_TASK)  # type: ignore[untyped-decorator]
    def reap_lost() -> dict[str, int]:
        return {**recovery.reap(runner), "announced": recovery.announce_finished(runner)}

    @app.task(name=SWEEP_TASK)  # type: ignore[untyped-decorator]
    def sweep_queued() -> dict[str, int]:
        return recovery.sweep(runner, app, older_than_s=settings.sweep_after_s)

    return app
