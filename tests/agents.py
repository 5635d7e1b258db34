"""Agents that exist only for the tests, loaded by the test workers via REACH_AGENTS."""

from __future__ import annotations

from typing import Any

from workers.sdk import Context, agent


@agent.capability("test.boom", agent_id="test-boom", version="0.0.1")
def boom(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("the agent broke")


@agent.capability("test.not-json", agent_id="test-not-json", version="0.0.1")
def not_json(ctx: Context, payload: dict[str, Any]) -> object:
    return {"a set": {1, 2}}


@agent.capability("test.context", agent_id="test-context", version="0.0.2")
def context(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Returns what the handler was told about its task."""
    return {
        "task_id": str(ctx.task_id),
        "trace_id": ctx.trace_id,
        "attempt": ctx.attempt,
        "time_left_s": ctx.time_left_s(),
        "session_id": ctx.session_id,
        "metadata": ctx.metadata,
    }
