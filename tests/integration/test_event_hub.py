"""The API's event hub against a real Redis: one pub/sub connection for every listener of the
process, each listener given its task's live events, and a channel given up once its last
listener left (after the listener's answer, not before it)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from broker.tasks import events
from broker.tasks.eventhub import EventHub


async def subscribers(client: Redis, task_id: str) -> int:
    counts = await client.pubsub_numsub(events.channel(task_id))
    return int(counts[0][1])


Steps = Callable[[Redis, EventHub, events.EventLog], Awaitable[None]]


def run(own_redis: str, steps: Steps) -> None:
    async def main() -> None:
        client = Redis.from_url(own_redis)
        hub = EventHub(client)
        try:
            await steps(client, hub, events.EventLog(client, 60))
        finally:
            await hub.close()
            await client.aclose()

    asyncio.run(main())


def test_a_listener_gets_its_tasks_live_events_and_the_channel_is_left_after_it(
    own_redis: str,
) -> None:
    task_id = str(uuid.uuid4())

    async def steps(client: Redis, hub: EventHub, log: events.EventLog) -> None:
        async with hub.listen(task_id) as live:
            assert await subscribers(client, task_id) == 1
            await log.append_async(task_id, events.STATUS, {"status": "running"}, trace_id="t")
            event = await asyncio.wait_for(live.get(), 5)
            assert event.data == {"status": "running"}
        for _ in range(100):  # the UNSUBSCRIBE goes out after the listener's own work
            if await subscribers(client, task_id) == 0:
                break
            await asyncio.sleep(0.02)
        assert await subscribers(client, task_id) == 0

    run(own_redis, steps)


def test_a_listener_that_comes_back_at_once_keeps_hearing_its_task(own_redis: str) -> None:
    """The last listener leaves and a new one comes for the same task before the deferred
    UNSUBSCRIBE runs: the channel stays, and the new listener hears what follows."""
    task_id = str(uuid.uuid4())

    async def steps(client: Redis, hub: EventHub, log: events.EventLog) -> None:
        async with hub.listen(task_id):
            pass
        async with hub.listen(task_id) as live:
            await asyncio.sleep(0.2)  # the first listener's leaving has run by now
            assert await subscribers(client, task_id) == 1
            await log.append_async(task_id, events.STATUS, {"status": "running"}, trace_id="t")
            event = await asyncio.wait_for(live.get(), 5)
            assert event.data == {"status": "running"}

    run(own_redis, steps)
