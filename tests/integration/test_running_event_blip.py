"""A Redis blip on a task's ``running`` event, after its claim and before its handler.

The event's call raised, the run raised, and Celery sent the message again; the task was
claimed and ``running`` by then, so that message's claim failed and it was skipped, and the
lease keeper handed the task to the lost tasks' recovery: ``worker_lost``, its handler never
called. The event's call is tried again now, and the task runs."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, select

from broker.db.models import tasks_table
from broker.settings import Settings
from broker.tasks import events
from tests.integration.rows import a_task_row
from workers.runner import Runner
from workers.sdk.agent import AgentRegistry

CAPABILITY = "test.blip"


@pytest.mark.parametrize("blips", [1, 3])
def test_a_blip_on_the_running_event_is_waited_out_and_the_task_runs_once(
    own_engine: Engine, own_redis: str, settings: Settings, blips: int
) -> None:
    """On a database of its own: the run's reaper takes a task running a second under an
    instance with no lease (this one's) for lost."""
    engine = own_engine
    url = own_engine.url.render_as_string(hide_password=False)
    settings = settings.model_copy(update={"database_url": url, "redis_url": own_redis})
    calls: list[Any] = []
    registry = AgentRegistry()

    @registry.capability(CAPABILITY, agent_id="test-blip", idempotent=False)
    def handler(ctx: Any, payload: Any) -> dict[str, bool]:
        calls.append(payload)
        return {"ok": True}

    runner = Runner(settings, registry)
    task_id = a_task_row(engine, tenant="t-blip", capability=CAPABILITY, payload={"n": 1})
    append = runner.events.append
    left = {"blips": blips}

    def blipping(tid: Any, event_type: str, data: Any, **more: Any) -> Any:
        if event_type == events.STATUS and data.get("status") == "running" and left["blips"]:
            left["blips"] -= 1
            raise redis.exceptions.ConnectionError("Connection reset by peer (a blip)")
        return append(tid, event_type, data, **more)

    runner.events.append = blipping  # type: ignore[method-assign]
    # When the task runs, its running event meeting Redis away for a moment
    status = runner.run(str(task_id), CAPABILITY, instance=f"blip-{uuid.uuid4().hex[:6]}@h")
    # Then the handler ran once and the task succeeded
    assert (status, calls, left["blips"]) == ("succeeded", [{"n": 1}], 0)
    with engine.connect() as conn:
        stored = conn.execute(
            select(tasks_table.c.status).where(tasks_table.c.id == task_id)
        ).scalar_one()
    assert stored == "succeeded"
