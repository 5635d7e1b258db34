"""A worker's check of a task's payload against its card's schema, in a runner of the test's
own (``workers.runner.Runner``) on the test's Postgres and Redis, with a task row written
straight in. The check's cost is stood in for by a checker that notes the thread it ran on,
or that takes until the task's deadline has passed: a real one takes about 2 s a MiB.

- On an event loop (``run_async``, the threads pool's and the bridge's way) a big payload is
  checked in a thread, so the loop goes on with every other call meanwhile; a small one on
  the loop, spared the thread's hop.
- A deadline that passes during the check ends the task ``expired`` (``deadline_exceeded``)
  without calling its handler: the time left read as 0.0, and 0.0 was no limit at all.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, select

from broker.db.models import tasks_table
from broker.registry.model import lease_key
from broker.settings import Settings
from tests.integration.rows import a_task_row
from workers.aio import ON_LOOP_BYTES
from workers.runner import Runner
from workers.sdk.agent import AgentRegistry, CapabilitySpec
from workers.sdk.context import Context

TENANT = "payload-checks"
INSTANCE = "payload-checks@test"
SCHEMA = {"type": "object"}


class Checker:
    """A schema check (``iter_errors``, as ``broker.registry.schemas.problems`` calls it) that
    finds nothing, noting the thread it ran on; ``until``: it takes until then."""

    def __init__(self, until: datetime | None = None) -> None:
        self.until = until
        self.threads: list[threading.Thread] = []

    def iter_errors(self, payload: Any) -> Iterator[Any]:
        self.threads.append(threading.current_thread())
        while self.until is not None and datetime.now(UTC) <= self.until:
            time.sleep(0.01)
        return iter(())


class Agent:
    """One capability served by a runner of its own, its handler's calls noted."""

    def __init__(self, settings: Settings, name: str, *, is_async: bool) -> None:
        self.name = name
        self.calls: list[Any] = []
        registry = AgentRegistry()

        def handle(ctx: Context, payload: Any) -> dict[str, Any]:
            self.calls.append(payload)
            return {"ok": True}

        async def handle_async(ctx: Context, payload: Any) -> dict[str, Any]:
            return handle(ctx, payload)

        agent_id = name.replace(".", "-")
        card = {"agent_id": agent_id, "version": "1.0.0", "input_schema": SCHEMA}
        registry.capability(name, **card)(handle_async if is_async else handle)
        self.runner = Runner(settings, registry)
        spec = registry.for_queue(name)
        assert isinstance(spec, CapabilitySpec)
        self.spec = spec

    def checked_by(self, checker: Checker) -> None:
        # Where ``CapabilitySpec.validator`` (a cached property) keeps the one it built.
        self.spec.__dict__["validator"] = checker

    def run(self, task_id: uuid.UUID) -> str:
        return self.runner.run(str(task_id), self.name, instance=INSTANCE)

    def run_on_a_loop(self, task_id: uuid.UUID) -> tuple[str, threading.Thread]:
        """``run_async`` on a loop of its own, and the thread that loop ran on."""

        async def run() -> tuple[str, threading.Thread]:
            try:
                status = await self.runner.run_async(str(task_id), self.name, instance=INSTANCE)
                return status, threading.current_thread()
            finally:
                await self._close_loop_clients()

        return asyncio.run(run())

    async def _close_loop_clients(self) -> None:
        runner = self.runner
        for conn in (runner._aclaims_db, runner._afinishes_db):
            if conn is not None:
                await conn.close()
        if runner._aredis is not None:
            await runner._aredis.aclose()

    def close(self) -> None:
        runner = self.runner
        for conn in (runner._claims_db, runner._finishes_db):
            if conn is not None:
                conn.close()
        if runner._redis is not None:
            runner._redis.close()
        if runner._engine is not None:
            runner._engine.dispose()


@pytest.fixture
def agents(settings: Settings) -> Iterator[Any]:
    made: list[Agent] = []
    # The instance holds a lease, as a worker's does: a reaper of the session's other workers
    # takes back a running task whose instance holds none (the check takes seconds here).
    leases = redis.Redis.from_url(settings.redis_url)
    leases.set(lease_key(INSTANCE), "payload-checks", ex=600)

    def make(*, is_async: bool) -> Agent:
        made.append(Agent(settings, f"test.checked-{uuid.uuid4().hex[:8]}", is_async=is_async))
        return made[-1]

    yield make
    for agent in made:
        agent.close()
    leases.delete(lease_key(INSTANCE))
    leases.close()


def row_of(engine: Engine, task_id: uuid.UUID) -> Any:
    with engine.connect() as conn:
        query = select(tasks_table).where(tasks_table.c.id == task_id)
        return conn.execute(query).mappings().one()


@pytest.mark.parametrize(("items", "on_the_loop"), [(40_000, False), (100, True)])
def test_on_a_loop_a_big_payload_is_checked_in_a_thread_and_a_small_one_on_the_loop(
    agents: Any, engine: Engine, items: int, on_the_loop: bool
) -> None:
    """The check ran on the loop, synchronously: a 1 MiB payload held every call of that
    process (on the bridge, every tenant's remote calls) for seconds."""
    agent = agents(is_async=True)
    checker = Checker()
    agent.checked_by(checker)
    payload = {"numbers": list(range(items))}  # ~230 KB, ~500 bytes
    task_id = a_task_row(engine, tenant=TENANT, capability=agent.name, payload=payload)
    assert (row_of(engine, task_id)["payload_size"] > ON_LOOP_BYTES) is not on_the_loop

    status, loop_thread = agent.run_on_a_loop(task_id)

    assert status == "succeeded"
    assert agent.calls == [payload]
    assert len(checker.threads) == 1
    assert (checker.threads[0] is loop_thread) is on_the_loop


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_deadline_passed_during_the_check_ends_the_task_expired_without_its_handler(
    agents: Any, engine: Engine, is_async: bool
) -> None:
    """The time left read 0.0 after the check, and ``soft_limit`` took 0.0 for no limit: a
    sync handler ran with none but Celery's hard limit (the longest timeout of any agent
    plus 30 s), then was marked expired after the fact; an async one was started, then cut."""
    agent = agents(is_async=is_async)
    deadline_at = datetime.now(UTC) + timedelta(seconds=2)  # after the claim, before the call
    checker = Checker(until=deadline_at)
    agent.checked_by(checker)
    task_id = a_task_row(
        engine, tenant=TENANT, capability=agent.name, payload={"n": 1}, deadline_at=deadline_at
    )

    status = agent.run_on_a_loop(task_id)[0] if is_async else agent.run(task_id)

    assert len(checker.threads) == 1, "the task was claimed and its payload checked"
    assert agent.calls == []
    assert status == "expired"
    row = row_of(engine, task_id)
    assert row["status"] == "expired"
    assert row["error"]["code"] == "deadline_exceeded"
    assert row["attempts"] == 1
