"""Running one task on this worker: claim, call the handler, record the outcome.

A handler's exception never escapes (the worker stays up) and never leaves the task running:
every path after a successful claim ends in ``succeed`` or ``fail``.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import redis
from sqlalchemy import Engine

from broker import execution, jsonbody, leases
from broker.db.engines import sync_engine
from broker.errors import AgentFailure, BadRequest
from broker.registry import capability_of
from broker.settings import Settings
from workers.sdk.context import Context
from workers.sdk.registry import AgentRegistry, CapabilitySpec

log = logging.getLogger("reach.worker")
MESSAGE_MAX = 2000


def error(code: str, message: str, *, retryable: bool = False) -> dict[str, Any]:
    return {"code": code, "message": message[:MESSAGE_MAX], "retryable": retryable}


class Runner:
    def __init__(self, settings: Settings, registry: AgentRegistry) -> None:
        self.settings = settings
        self.registry = registry
        self._engine: Engine | None = None
        self._redis: redis.Redis | None = None
        self._pid = 0

    def _connect(self) -> None:
        # One engine and client per process: a prefork child must not reuse its parent's
        # connections.
        if self._pid != os.getpid():
            self._engine = sync_engine(self.settings)
            self._redis = redis.Redis.from_url(self.settings.redis_url, socket_timeout=5)
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

    def _readiness_sink(self, instance: str, capability: str) -> Any:
        def apply(ready: bool, for_s: float) -> None:
            if ready:
                leases.mark_ready(self.redis, instance, capability)
            else:
                leases.mark_not_ready(self.redis, instance, capability, for_s)

        return apply

    def run(self, task_id: str, queue: str, *, instance: str) -> str:
        """Run the task; returns the status it ended in, or 'skipped' when it was not queued."""
        tid = uuid.UUID(task_id)
        spec = self.registry.get(capability_of(queue))
        if spec is None:
            message = f"no agent on {instance} serves {queue!r}"
            execution.fail(self.engine, tid, error("capability_not_served", message))
            return "failed"
        claimed = execution.claim(
            self.engine, tid, agent_id=spec.agent_id, version=spec.version, instance=instance
        )
        if claimed is None:
            log.info("task %s not queued any more; skipped", task_id)
            return "skipped"
        ctx = Context(
            task_id=tid,
            capability=claimed.capability,
            trace_id=claimed.trace_id,
            attempt=claimed.attempt,
            deadline_at=claimed.deadline_at,
            session_id=claimed.session_id,
            metadata=claimed.metadata,
            _progress_sink=lambda p: execution.report_progress(self.engine, tid, p),
            _readiness_sink=self._readiness_sink(instance, spec.name),
        )
        outcome = self._call(spec, ctx, claimed.payload)
        if "error" in outcome:
            execution.fail(self.engine, tid, outcome["error"])
            return "failed"
        execution.succeed(self.engine, tid, outcome["result"])
        return "succeeded"

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
        except AgentFailure as exc:
            return {"error": error(exc.code, exc.message, retryable=exc.retryable)}
        except Exception as exc:
            log.exception("agent %s failed on task %s", spec.agent_id, ctx.task_id)
            return {"error": error("agent_error", f"{type(exc).__name__}: {exc}")}
        try:
            jsonbody.check_tree(result, max_depth=self.settings.max_json_depth)
            jsonbody.canonical(result)
        except (BadRequest, TypeError, ValueError) as exc:
            return {"error": error("result_invalid", f"the agent returned no valid JSON: {exc}")}
        return {"result": result}
