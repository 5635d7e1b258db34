"""Which messages the threads pool hands to the event loop (``workers.pool``), which of them
skip Celery's request, and when a worker gets that pool."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from celery import Celery
from celery.concurrency import prefork, thread
from celery.utils.collections import LimitedSet
from kombu import Message

from broker.tasks.dispatch import RUN_TASK
from workers.loop_consumer import CELERY_WAY
from workers.pool import Direct, TaskPool, plain, use_direct_pool
from workers.sdk.agent import AgentRegistry
from workers.sdk.context import Context

registry = AgentRegistry()


@registry.capability("unit.async", agent_id="unit-async", version="1.0.0")
async def waits(ctx: Context, payload: Any) -> Any:
    return payload


@registry.capability("unit.sync", agent_id="unit-sync", version="1.0.0")
def blocks(ctx: Context, payload: Any) -> Any:
    return payload


direct = Direct(SimpleNamespace(registry=registry))  # type: ignore[arg-type]


def message(name: str, body: Any, content_type: str = "application/json") -> tuple[Any, ...]:
    raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
    return (name, "id-1", {"hostname": "async@box"}, memoryview(raw), content_type, "utf-8")


def run_body(queue: str) -> list[Any]:
    return [["7d3f3c2e-1f7a-4b8e-9c55-0f8a1f0f3d11", queue], {}, {}]


def test_an_async_handlers_run_message_goes_to_the_loop() -> None:
    taken = direct.take(message(RUN_TASK, run_body("unit.async")))
    assert taken == ("7d3f3c2e-1f7a-4b8e-9c55-0f8a1f0f3d11", "unit.async", "async@box")


def test_a_sync_handlers_and_an_unknown_queues_go_to_a_thread() -> None:
    assert direct.take(message(RUN_TASK, run_body("unit.sync"))) is None
    assert direct.take(message(RUN_TASK, run_body("unit.nobody"))) is None


def test_without_celerys_request_a_sync_handlers_run_is_read_too() -> None:
    body = json.dumps(run_body("unit.sync")).encode()
    assert direct.run_of(body, "async@box") is None
    taken = direct.run_of(body, "async@box", sync=True)
    assert taken == ("7d3f3c2e-1f7a-4b8e-9c55-0f8a1f0f3d11", "unit.sync", "async@box")
    assert (direct.is_async("unit.sync"), direct.is_async("unit.async")) == (False, True)
    nobody = json.dumps(run_body("unit.nobody")).encode()
    assert direct.run_of(nobody, "async@box", sync=True) is None


def test_other_tasks_and_bodies_it_cannot_read_go_to_a_thread() -> None:
    assert direct.take(message("reach.purge_expired", [[], {}, {}])) is None
    assert direct.take(message(RUN_TASK, b"not json")) is None
    assert direct.take(message(RUN_TASK, [["only-one"], {}, {}])) is None
    assert direct.take(message(RUN_TASK, run_body("unit.async"), "application/x-yaml")) is None
    assert direct.take(None) is None


def test_a_worker_started_with_the_threads_pool_gets_the_direct_pool() -> None:
    threads = SimpleNamespace(pool_cls=thread.TaskPool)
    use_direct_pool(sender=threads)
    assert threads.pool_cls is TaskPool
    by_name = SimpleNamespace(pool_cls="threads")
    use_direct_pool(sender=by_name)
    assert by_name.pool_cls is TaskPool
    forks = SimpleNamespace(pool_cls=prefork.TaskPool)
    use_direct_pool(sender=forks)
    assert forks.pool_cls is prefork.TaskPool


# -- which run messages skip Celery's request (``run_strategy``) ----------------------------

app = Celery("unit-strategy", set_as_current=False)


def run_message(**options: Any) -> Message:
    """A run message as Celery builds it, as the worker's consumer receives it."""
    task_id = "7d3f3c2e-1f7a-4b8e-9c55-0f8a1f0f3d11"
    built = app.amqp.as_task_v2(task_id, RUN_TASK, args=[task_id, "unit.async"], **options)
    return Message(
        body=json.dumps(built.body).encode(),
        content_type=options.get("content_type", "application/json"),
        headers=built.headers,
    )


quiet = SimpleNamespace(enabled=True, groups={"worker"})  # Celery's default: no task events


def test_a_plain_run_message_skips_celerys_request() -> None:
    assert plain(run_message(), LimitedSet(), quiet)
    later = datetime.now(UTC) + timedelta(minutes=5)
    assert plain(run_message(expires=later.isoformat()), LimitedSet(), quiet)


def test_countdowns_expired_and_revoked_messages_take_celerys_way() -> None:
    assert not plain(run_message(countdown=5), LimitedSet(), quiet)
    earlier = datetime.now(UTC) - timedelta(seconds=1)
    assert not plain(run_message(expires=earlier.isoformat()), LimitedSet(), quiet)
    revoked = LimitedSet()
    revoked.add("7d3f3c2e-1f7a-4b8e-9c55-0f8a1f0f3d11")
    assert not plain(run_message(), revoked, quiet)
    assert not plain(run_message(content_type="application/x-yaml"), LimitedSet(), quiet)


def test_with_task_events_on_every_run_takes_celerys_way() -> None:
    """Flower's ``enable_events`` adds the task group; an empty group set means all."""
    watched = SimpleNamespace(enabled=True, groups={"worker", "task"})
    assert not plain(run_message(), LimitedSet(), watched)
    assert not plain(run_message(), LimitedSet(), SimpleNamespace(enabled=True, groups=set()))
    assert plain(run_message(), LimitedSet(), SimpleNamespace(enabled=False, groups=set()))
    assert plain(run_message(), LimitedSet(), None)


def test_a_message_handed_back_after_its_direct_path_failed_takes_celerys_way() -> None:
    """The loop consumer hands a run whose direct path failed to Celery's consumer."""
    handed_back = run_message()
    handed_back.properties[CELERY_WAY] = True
    assert not plain(handed_back, LimitedSet(), quiet)
