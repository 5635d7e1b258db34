"""``echo``: returns its payload. The smallest agent, and the benchmark's no-op."""

from __future__ import annotations

from typing import Any

from broker.errors import AgentFailure
from workers.sdk import Context, agent


@agent.capability("echo", agent_id="echo", version="1.0.0", idempotent=True, timeout_s=5)
def echo(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Return the payload. ``{"fail": "<code>"}`` fails the task with that code instead."""
    if "fail" in payload:
        raise AgentFailure(str(payload.get("message", "asked to fail")), code=str(payload["fail"]))
    return payload
