"""What the API's reads of one task select (``broker.tasks.queries``), and the look at
Postgres the waiters of one task share (``EventHub.polled``)."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis
from sqlalchemy import Select
from sqlalchemy.dialects import postgresql

from broker.db.models import FINAL_COLUMNS
from broker.tasks import queries
from broker.tasks.eventhub import EventHub
from broker.tasks.resource import SHOWN_COLUMNS

TASK = uuid.UUID(int=7)


def selected(query: Select[object]) -> list[str]:
    return [column.key for column in query.selected_columns]


def where(query: Select[object]) -> str:
    return str(query.compile(dialect=postgresql.dialect())).partition("WHERE")[2]


def test_a_task_is_read_with_the_columns_its_readers_show_and_its_payload_only_if_asked() -> None:
    # The resource's columns, and the callback A2A shows as the task's push config
    assert selected(queries.task_query("t", TASK)) == [*SHOWN_COLUMNS, "callback"]
    assert "payload" not in SHOWN_COLUMNS
    asked = queries.task_query("t", TASK, patterns=["invoice.*"], payload=True)
    assert selected(asked) == [*SHOWN_COLUMNS, "callback", "payload"]
    assert "tasks.capability" in where(asked)  # still narrowed by the key's patterns


def test_a_wait_polls_the_status_alone_and_reads_the_rest_but_the_payload_once_final() -> None:
    polled = queries.status_query("t", TASK)
    assert selected(polled) == ["status"]
    final = queries.final_query("t", TASK)
    assert selected(final) == [column.key for column in FINAL_COLUMNS]
    assert "payload" not in selected(final)
    assert "tasks.status IN" in where(final)
    for query in (polled, final):
        assert "tasks.id =" in where(query) and "tasks.tenant =" in where(query)
        assert "tasks.expires_at > now()" in where(query)


def test_the_waiters_asking_together_share_one_poll_and_each_key_has_its_own() -> None:
    async def run() -> None:
        hub = EventHub(aioredis.Redis())  # never connects: a poll is no Redis call
        polls: list[str] = []
        gate = asyncio.Event()

        async def poll(name: str) -> str:
            polls.append(name)
            await gate.wait()
            return f"{name}: queued"

        asked = [
            asyncio.create_task(hub.polled(("status", tenant, TASK), lambda t=tenant: poll(t)))
            for tenant in ["a"] * 50 + ["b"]
        ]
        await asyncio.sleep(0.01)
        gate.set()
        answers = await asyncio.gather(*asked)
        assert answers == ["a: queued"] * 50 + ["b: queued"]
        assert sorted(polls) == ["a", "b"]  # one for tenant a's 50 waiters, one for b's
        assert await hub.polled(("status", "a", TASK), lambda: poll("again")) == "a: queued"
        assert sorted(polls) == ["a", "b"]  # still fresh: not polled again

    asyncio.run(run())
