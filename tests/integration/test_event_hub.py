"""The API's event hub against a real Redis: one pub/sub connection for every listener of the
process, each listener given its task's live events, and a channel given up once its last
listener left (after the listener's answer, not before it)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from broker.observability import logs
from broker.tasks import eventhub, events
from broker.tasks.eventhub import LOG_PAGE, EventHub


async def subscribers(client: Redis, task_id: str) -> int:
    counts = await client.pubsub_numsub(events.channel(task_id))
    return int(counts[0][1])


Steps = Callable[[Redis, EventHub, events.EventLog], Awaitable[None]]


def run(own_redis: str, steps: Steps) -> None:
    async def main() -> None:
        client = Redis.from_url(own_redis)
        hub = EventHub(client)
        try:
            await steps(client, hub, events.EventLog(client, 60, max_bytes=1 << 20))
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
            await log.append_async(
                task_id, events.STATUS, {"status": "running"}, tenant="t", trace_id="t"
            )
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
            await log.append_async(
                task_id, events.STATUS, {"status": "running"}, tenant="t", trace_id="t"
            )
            event = await asyncio.wait_for(live.get(), 5)
            assert event.data == {"status": "running"}

    run(own_redis, steps)


class PageCounting(Redis):
    """A real client that notes the ``count`` each log read asks for."""

    asked: list[int | None]

    async def xrange(self, *args: Any, **kwargs: Any) -> Any:
        self.asked.append(kwargs.get("count"))
        return await super().xrange(*args, **kwargs)


def test_a_stream_of_a_long_log_reads_it_a_page_at_a_time_in_order_from_where_it_resumes(
    own_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's client may stop reading: what the stream holds then is a page of the log,
    not the whole log read ahead of the socket (600 such streams of a 1.4 MB log grew the API
    by 108 MiB)."""
    task_id = str(uuid.uuid4())
    n = 2 * LOG_PAGE + 50

    async def main() -> None:
        client = PageCounting.from_url(own_redis)
        client.asked = []
        hub = EventHub(client)
        log = events.EventLog(client, 60, max_bytes=1 << 20)
        try:
            for i in range(n):
                await log.append_async(task_id, events.OUTPUT, {"i": i}, tenant="t", trace_id="t")
            await log.append_async(
                task_id, "succeeded", {"status": "succeeded"}, tenant="t", trace_id="t"
            )
            # from the start: every event once, in order, ending with the final one
            seen = [e async for page in hub.events(task_id) if page for e in page]
            assert [e.seq for e in seen] == list(range(1, n + 2))
            assert seen[-1].final and [e.data["i"] for e in seen[:-1]] == list(range(n))
            # read a page at a time: two full pages, then the rest with the final event
            assert client.asked == [LOG_PAGE] * 3
            # resumed after event 120: from 121 on, none twice
            resumed = [e.seq async for page in hub.events(task_id, after=120) if page for e in page]
            assert resumed == list(range(121, n + 2))
            # and where the log stands, counted a page at a time (an A2A resubscription's)
            client.asked = []
            assert await hub.tally(task_id, events.OUTPUT) == (n + 1, n)
            assert client.asked == [eventhub.TALLY_PAGE]
            monkeypatch.setattr(eventhub, "TALLY_PAGE", LOG_PAGE)
            client.asked = []
            assert await hub.tally(task_id, events.OUTPUT) == (n + 1, n)
            assert client.asked == [LOG_PAGE] * 3
        finally:
            await hub.close()
            await client.aclose()

    asyncio.run(main())


async def lose_log(client: Redis, task_id: str) -> None:
    """The task's log lost in Redis (a restart without persistence, an eviction)."""
    keys = (events.log_key, events.seq_key, events.final_key, events.attempt_key, events.bytes_key)
    await client.delete(*(key(task_id) for key in keys))


async def append(log: events.EventLog, task_id: str, event_type: str, data: Any) -> None:
    await log.append_async(task_id, event_type, data, tenant="t", trace_id="t")


def test_a_final_event_handed_to_a_resumed_stream_is_not_handed_again_to_its_reconnect(
    own_redis: str,
) -> None:
    task_id = str(uuid.uuid4())

    async def steps(client: Redis, hub: EventHub, log: events.EventLog) -> None:
        # Given a client that read a task's log to id 5, then the log lost, then the task done
        for i in range(5):
            await append(log, task_id, events.OUTPUT, {"i": i})
        await lose_log(client, task_id)
        await append(log, task_id, "succeeded", {"status": "succeeded"})  # id 1 of a new log
        # When it resumes from 5: it gets the final event, numbered past 5
        first = [
            (e.seq, e.type) async for page in hub.events(task_id, after=5) if page for e in page
        ]
        assert first == [(6, "succeeded")]
        # Then an EventSource's reconnect from that id ends with nothing (before: the same
        # event again as 7, then 8, for ever)
        again = [e async for page in hub.events(task_id, after=6) if page for e in page]
        assert again == []

    run(own_redis, steps)


def test_two_clients_resuming_a_log_that_began_again_each_get_its_final_event_once(
    own_redis: str,
) -> None:
    """The id a final event was handed under was one per task: B's resume replaced A's,
    and A's reconnect got the final event again, under a new id."""
    task_id = str(uuid.uuid4())

    async def steps(client: Redis, hub: EventHub, log: events.EventLog) -> None:
        # Given a log lost after its id 5, then the task done (id 1 of a new log)
        for i in range(5):
            await append(log, task_id, events.OUTPUT, {"i": i})
        await lose_log(client, task_id)
        await append(log, task_id, "succeeded", {"status": "succeeded"})

        async def resumed(after: int) -> list[tuple[int, str]]:
            return [
                (e.seq, e.type) async for p in hub.events(task_id, after=after) for e in p or []
            ]

        # When client A resumes from 2 and client B from 5, each is handed it
        assert await resumed(2) == [(3, "succeeded")]
        assert await resumed(5) == [(6, "succeeded")]
        # Then each one's reconnect, from the id it was handed, ends with nothing
        assert await resumed(3) == []
        assert await resumed(6) == []

    run(own_redis, steps)


def test_a_final_event_of_a_log_that_began_again_is_numbered_past_what_the_stream_sent(
    own_redis: str,
) -> None:
    task_id = str(uuid.uuid4())

    async def steps(client: Redis, hub: EventHub, log: events.EventLog) -> None:
        # Given a stream resumed from id 2 that has sent ids 3 to 5
        for status in ("queued", "running"):
            await append(log, task_id, events.STATUS, {"status": status})
        sent: list[tuple[int, str]] = []

        async def read() -> None:
            async for page in hub.events(task_id, after=2, quiet_s=5):
                sent.extend((event.seq, event.type) for event in page or [])

        reader = asyncio.create_task(read())
        for i in range(3):
            await append(log, task_id, events.OUTPUT, {"i": i})
        for _ in range(250):
            if len(sent) == 3:
                break
            await asyncio.sleep(0.02)
        # When the log is lost and the final event begins a new one at id 1
        await lose_log(client, task_id)
        await append(log, task_id, "succeeded", {"status": "succeeded"})
        await asyncio.wait_for(reader, 30)
        # Then it goes out numbered past 5, an id the stream has not sent (before: 3 again,
        # which a client drops as one it has)
        assert sent == [(3, "output"), (4, "output"), (5, "output"), (6, "succeeded")]

    run(own_redis, steps)


def test_a_final_event_appended_while_a_resumed_stream_starts_is_sent(own_redis: str) -> None:
    task_id = str(uuid.uuid4())

    async def steps(client: Redis, hub: EventHub, log: events.EventLog) -> None:
        for status in ("queued", "running"):
            await append(log, task_id, events.STATUS, {"status": status})
        looks = hub.closing_event

        async def finished_meanwhile(of: str) -> events.Event | None:
            # The worker's final event lands between the stream's read of the log (nothing
            # after 2) and its look at the log's closing event
            await append(log, task_id, "succeeded", {"status": "succeeded"})
            hub.closing_event = looks  # type: ignore[method-assign]
            return await looks(of)

        hub.closing_event = finished_meanwhile  # type: ignore[method-assign]
        sent = [
            (e.seq, e.type) async for page in hub.events(task_id, after=2) if page for e in page
        ]
        # Before: the stream ended with nothing
        assert sent == [(3, "succeeded")]

    run(own_redis, steps)


def test_the_hubs_reader_runs_in_no_requests_context(own_redis: str) -> None:
    """The reader is shared by every listener of the process: started inside the first
    listener's request, it ran in that request's context for good, and every line it logged
    (a Redis failure, for everyone) carried that request's trace id and tenant."""
    seen: list[dict[str, Any]] = []

    async def steps(client: Redis, hub: EventHub, log: events.EventLog) -> None:
        async def a_request() -> None:
            logs.bind(trace_id="a" * 32, tenant="tenant-a")
            async with hub.listen(str(uuid.uuid4())):
                assert hub._pubsub is not None
                read = hub._pubsub.get_message

                async def spied(*args: Any, **kwargs: Any) -> Any:
                    seen.append(logs.current())  # the context the reader runs in
                    return await read(*args, **kwargs)

                hub._pubsub.get_message = spied  # type: ignore[method-assign]
                for _ in range(250):
                    if seen:
                        break
                    await asyncio.sleep(0.02)

        await asyncio.create_task(a_request())

    run(own_redis, steps)
    assert seen, "the reader read"
    assert all("trace_id" not in fields and "tenant" not in fields for fields in seen), seen
