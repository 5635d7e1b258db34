"""Running one task on this worker: claim, call the handler, record the outcome.

A handler's exception never escapes (the worker stays up) and never leaves the task running:
every path after a successful claim ends in ``succeed`` or ``fail``. Status changes, progress
and outputs go to the task's event log as they happen.
"""

from __future__ import annotations

import inspect
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

import redis
from sqlalchemy import Engine

from broker import events, execution, jsonbody, leases
from broker.db.engines import sync_engine
from broker.errors import AgentFailure, BadRequest
from broker.registry import capability_of
from broker.settings import Settings
from broker.submission import EVENTS_SLACK_S
from broker.tasks import render
from workers.sdk.context import Context
from workers.sdk.registry import AgentRegistry, CapabilitySpec

log = logging.getLogger("reach.worker")
MESSAGE_MAX = 2000


def error(code: str, message: str, *, retryable: bool = False) -> dict[str, Any]:
    return {"code": code, "message": message[:MESSAGE_MAX], "retryable": retryable}


FinalHook = Callable[[dict[str, Any]], None]


class Runner:
    def __init__(self, settings: Settings, registry: AgentRegistry) -> None:
        self.settings = settings
        self.registry = registry
        # Called with the task row each time this runner puts a task in a final state.
        self.on_final: list[FinalHook] = []
        self._engine: Engine | None = None
        self._redis: redis.Redis | None = None
        self._events: events.EventLog | None = None
        self._pid = 0

    def _connect(self) -> None:
        # One engine and client per process: a prefork child must not reuse its parent's
        # connections.
        if self._pid != os.getpid():
            self._engine = sync_engine(self.settings)
            self._redis = redis.Redis.from_url(self.settings.redis_url, socket_timeout=5)
            self._events = events.EventLog(self._redis, self.settings.result_ttl_s)
            self._pid = os.getpid()

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

    def run(self, task_id: str, queue: str, *, instance: str) -> str:
        """Run the task; returns the status it ended in, or 'skipped' when it was not queued."""
        tid = uuid.UUID(task_id)
        spec = self.registry.get(capability_of(queue))
        if spec is None:
            message = f"no agent on {instance} serves {queue!r}"
            row = execution.fail(self.engine, tid, error("capability_not_served", message))
            self._publish_final(row)
            return "failed"
        claimed = execution.claim(
            self.engine, tid, agent_id=spec.agent_id, version=spec.version, instance=instance
        )
        if claimed is None:
            log.info("task %s not queued any more; skipped", task_id)
            return "skipped"
        ttl_s = claimed.result_ttl_s + EVENTS_SLACK_S

        def publish(event_type: str, data: Any) -> None:
            self.events.append(tid, event_type, data, trace_id=claimed.trace_id, ttl_s=ttl_s)

        publish(
            events.STATUS, {"status": "running", "attempt": claimed.attempt, "instance": instance}
        )
        ctx = Context(
            task_id=tid,
            capability=claimed.capability,
            trace_id=claimed.trace_id,
            attempt=claimed.attempt,
            deadline_at=claimed.deadline_at,
            session_id=claimed.session_id,
            metadata=claimed.metadata,
            _progress_sink=lambda p: self._progress(tid, p, publish),
            _readiness_sink=self._readiness_sink(instance, spec.name),
            _output_sink=lambda chunk: publish(events.OUTPUT, self._checked(chunk)),
        )
        outcome = self._call(spec, ctx, claimed.payload)
        if "error" in outcome:
            row = execution.fail(self.engine, tid, outcome["error"])
        else:
            row = execution.succeed(self.engine, tid, outcome["result"])
        self._publish_final(row)
        return str(row["status"]) if row is not None else "skipped"

    def _progress(self, tid: uuid.UUID, progress: dict[str, Any], publish: Any) -> None:
        execution.report_progress(self.engine, tid, progress)
        publish(events.PROGRESS, progress)

    def _publish_final(self, row: dict[str, Any] | None) -> None:
        if row is None:  # moved to a final state by someone else, who published it
            return
        task = render(row)
        self.events.append(
            row["id"],
            row["status"],
            task,
            trace_id=row["trace_id"],
            ttl_s=row["result_ttl_s"] + EVENTS_SLACK_S,
        )
        for hook in self.on_final:
            try:
                hook(row)
            except Exception:  # the task is final either way; a hook must not undo that
                log.exception("final hook %r failed for task %s", hook, row["id"])

    def _checked(self, value: Any) -> Any:
        """A value that will go out as JSON; agents get a TypeError/ValueError otherwise."""
        jsonbody.check_tree(value, max_depth=self.settings.max_json_depth)
        jsonbody.canonical(value)
        return value

    def _readiness_sink(self, instance: str, capability: str) -> Any:
        def apply(ready: bool, for_s: float) -> None:
            if ready:
                leases.mark_ready(self.redis, instance, capability)
            else:
                leases.mark_not_ready(self.redis, instance, capability, for_s)

        return apply

    def _call(self, spec: CapabilitySpec, ctx: Context, payload: Any) -> dict[str, Any]:
        validator = spec.validator()
        if validator is not None:
            problems = sorted(validator.iter_errors(payload), key=lambda e: list(e.path))
            if problems:
                detail = "; ".join(
                    f"{'/'.join(map(str, p.path)) or '<root>'}: {p.message}" for p in problems[:10]
                )
                return {"error": error("payload_invalid", detail)}
        try:
            result = spec.handler(ctx, payload)
            if inspect.isgenerator(result):
                result = _drain_generator(result, ctx)
        except AgentFailure as exc:
            return {"error": error(exc.code, exc.message, retryable=exc.retryable)}
        except Exception as exc:
            log.exception("agent %s failed on task %s", spec.agent_id, ctx.task_id)
            return {"error": error("agent_error", f"{type(exc).__name__}: {exc}")}
        try:
            self._checked(result)
        except (BadRequest, TypeError, ValueError) as exc:
            return {"error": error("result_invalid", f"the agent returned no valid JSON: {exc}")}
        return {"result": result}


def _drain_generator(generator: Any, ctx: Context) -> Any:
    """A generator handler: each yielded item is an output chunk; what it returns is the
    result, or, when it returns nothing, the list of chunks."""
    chunks: list[Any] = []
    while True:
        try:
            chunk = next(generator)
        except StopIteration as stop:
            return stop.value if stop.value is not None else {"outputs": chunks}
        ctx.emit(chunk)
        chunks.append(chunk)
