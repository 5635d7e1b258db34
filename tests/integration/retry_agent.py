"""An agent that asks to be retried later, for ``test_retry_delay.py``: loaded by that test's
own worker (REACH_AGENTS), not by the shared test worker."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

from workers.sdk import Context, Retryable, agent

CAPABILITY = "test.retry-after"


def attempts_key(task_id: object) -> str:
    return f"reach:test:attempts:{task_id}"


@agent.capability(CAPABILITY, agent_id="test-retry-after", version="0.0.1", max_attempts=2)
def retry_after(ctx: Context, payload: dict[str, Any]) -> dict[str, int]:
    """On its first attempt asks to run again in ``delay_s`` (an upstream's 429 with a
    Retry-After); records when each attempt started and ended, by this process's clock."""
    started_at = time.time()
    client = redis.Redis.from_url(os.environ["REACH_REDIS_URL"])

    def record() -> None:
        entry = {"attempt": ctx.attempt, "started_at": started_at, "ended_at": time.time()}
        client.rpush(attempts_key(ctx.task_id), json.dumps(entry))
        client.expire(attempts_key(ctx.task_id), 600)

    if ctx.attempt == 1:
        record()
        raise Retryable("rate limited upstream", code="upstream_busy", delay_s=payload["delay_s"])
    record()
    return {"attempt": ctx.attempt}
