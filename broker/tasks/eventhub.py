"""Reading task events in the API: one pub/sub connection per process, fanned out to every
stream and waiter of that process, with the log as the source of truth.

A reader subscribes first and waits for Redis to confirm, then reads the log: an event is
either in what it read or arrives on the channel afterwards. Pub/sub may still drop (a slow
reader's queue overflowing, a reconnect), so every gap in ``seq`` and every quiet spell is
filled from the log. Nothing is delivered twice: the reader skips what it already sent.

Looks at Postgres are shared the same way (``polled``): the waiters and streams of one task
in a process read its status once an interval between them, however many they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import Any, TypeVar, cast

from redis.asyncio import Redis

from broker.cache import TimedCache
from broker.tasks.events import (
    STATUS,
    Event,
    channel,
    handed_key,
    log_key,
    parse_entries,
    seq_key,
    type_of,
)
from broker.tasks.resource import QUEUED

log = logging.getLogger("reach.events")
QUEUE_MAX = 1024
SUBSCRIBE_WAIT_S = 2.0
STORE_EVERY = 3  # quiet spells between two looks at Postgres when the log is gone
STORE_EVERY_WITH_LOG = 15
# Events a stream reads from the log at once. A stream hands its events to a socket that waits
# when its client stops reading; reading the whole log first, 600 streams of a task whose log
# held 1.4 MB, that none of them read, grew the API by 108 MiB.
LOG_PAGE = 100
TALLY_PAGE = 1_000  # entries a tally reads at once: it holds only their types
# How long a handed-out final event's id is kept when its log has no expiry to follow.
HANDED_KEPT_MS = 3_600_000
HANDED_KEPT = 16  # the ids a task's final event was handed under that are kept, newest
# The largest event id a client may send (``Last-Event-ID``: 18 digits) and be handed.
MAX_EVENT_ID = 10**18 - 1
# What a reader does when the log has been quiet without a final event: the caller looks the
# task up in Postgres and, when it is final, appends its final event to the log (its worker
# died between the two writes, or Redis lost the log) and returns it, with seq ``last + 1``
# for the case where the log began again below what this reader has sent.
FinalFromStore = Callable[[int], Awaitable[Event | None]]
# How long one look at Postgres answers every reader of this process that asks the same: the
# interval at which a waiter looks (``api.replies.STORE_CHECK_S``).
POLL_S = 2.0
T = TypeVar("T")


class EventHub:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._pubsub = redis.pubsub()
        self._queues: dict[str, set[asyncio.Queue[Event]]] = {}
        self._confirmed: dict[str, asyncio.Event] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        # Set when a subscription is made: the reader sleeps on it while there is none, so a
        # new listener's confirmation is read at once, not after a polling interval.
        self._wake = asyncio.Event()
        self._leaving: set[asyncio.Task[None]] = set()
        self._polls = TimedCache(ttl_s=POLL_S)

    async def close(self) -> None:
        for leave in list(self._leaving):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await leave
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        await self._pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # untyped in older redis

    @contextlib.asynccontextmanager
    async def listen(self, task_id: str) -> AsyncIterator[asyncio.Queue[Event]]:
        """Live events of one task, from the moment Redis confirms the subscription."""
        name = channel(task_id)
        queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=QUEUE_MAX)
        async with self._lock:
            first = name not in self._queues
            self._queues.setdefault(name, set()).add(queue)
            if first:
                self._confirmed[name] = asyncio.Event()
                try:
                    await self._pubsub.subscribe(name)
                except BaseException as exc:
                    # Not subscribed (Redis away): the channel's next listener tries again
                    del self._queues[name], self._confirmed[name]
                    if isinstance(exc, asyncio.CancelledError):  # its SUBSCRIBE may be out
                        self._leave(name)
                    raise
                self._wake.set()
            if self._reader is None or self._reader.done():
                # In a context of its own: the request that happened to start it ends, and
                # the hub's lines are no request's (they carried its trace id for good).
                self._reader = asyncio.create_task(
                    self._read(), name="reach-event-hub", context=contextvars.Context()
                )
        # From here the queue is the channel's: a listener cancelled while it waits for the
        # confirmation (a stream whose client hung up at once) leaves too. It stayed, its
        # queue filling with its task's events, subscribed, for the life of the process.
        try:
            with contextlib.suppress(TimeoutError):
                # Unconfirmed after this wait, the log reads below still cover the gap.
                async with asyncio.timeout(SUBSCRIBE_WAIT_S):
                    await self._confirmed[name].wait()
            yield queue
        finally:
            listeners = self._queues.get(name, set())
            listeners.discard(queue)
            if not listeners:
                self._queues.pop(name, None)
                self._confirmed.pop(name, None)
                # After the answer: a sync wait's response goes out before the UNSUBSCRIBE.
                self._leave(name)

    def _leave(self, name: str) -> None:
        leave = asyncio.create_task(self._unsubscribe_unheard(name))
        self._leaving.add(leave)  # the loop holds its tasks weakly
        leave.add_done_callback(self._leaving.discard)

    async def polled(self, key: Hashable, poll: Callable[[], Awaitable[T]]) -> T:
        """``poll()``'s answer, read once per ``POLL_S`` for every reader that asks with
        ``key`` (``TimedCache.computed``): 256 waits on one task, each reading its row every
        2 s, decoded its megabyte payload 128 times a second on the loop every tenant's
        requests share. Keep the answer small: it is held until the cache is full."""
        return cast(T, await self._polls.computed(key, poll))

    async def _unsubscribe_unheard(self, name: str) -> None:
        """Unsubscribe from a channel left by its last listener, unless a new one came."""
        try:
            async with self._lock:
                if name not in self._queues:
                    await self._pubsub.unsubscribe(name)
        except Exception:  # left subscribed: its messages find no listener and are dropped
            log.warning("event hub: unsubscribing %s failed", name, exc_info=True)

    async def _read(self) -> None:
        while True:
            try:
                if not self._pubsub.subscribed:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                message = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("event hub read failed; readers fall back to the log")
                await asyncio.sleep(0.5)
                continue
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        name = message["channel"]
        name = name.decode() if isinstance(name, bytes) else name
        if message["type"] == "subscribe":
            if name in self._confirmed:
                self._confirmed[name].set()
            return
        if message["type"] != "message":
            return
        event = Event.parse(message["data"])
        for queue in self._queues.get(name, ()):
            with contextlib.suppress(asyncio.QueueFull):  # the reader refills from the log
                queue.put_nowait(event)

    async def _ask_store(self, task_id: str, quiet_spells: int) -> bool:
        """Whether to look in Postgres now: soon when the log is gone (lost with Redis), and
        seldom while it exists (a worker may have died between its final write and event)."""
        if quiet_spells % STORE_EVERY:
            return False
        return quiet_spells % STORE_EVERY_WITH_LOG == 0 or not await self.redis.exists(
            seq_key(task_id)
        )

    async def read_log(self, task_id: str, after: int, count: int | None = None) -> list[Event]:
        """The log's events after ``after`` (the first ``count`` of them)."""
        entries = await self.redis.xrange(log_key(task_id), min=f"(0-{after}", max="+", count=count)
        return parse_entries(entries)

    async def closing_event(self, task_id: str) -> Event | None:
        """The log's final event, if it has one: a final event closes the log (see
        ``broker.tasks.events``), so it is the last one, read alone however long the log."""
        entries = await self.redis.xrevrange(log_key(task_id), max="+", min="-", count=1)
        last = parse_entries(entries)
        return last[0] if last and last[0].final else None

    async def tally(self, task_id: str, event_type: str) -> tuple[int, int]:
        """The log's last ``seq`` and how many of its events are of ``event_type``, read a page
        at a time (a long log is never held whole), each entry's type read from the front of
        its JSON, not the whole of it parsed: over 10,000 events, 60-80 ms became a few."""
        last = count = 0
        while True:
            entries: Any = await self.redis.xrange(
                log_key(task_id), min=f"(0-{last}", max="+", count=TALLY_PAGE
            )
            for _, fields in entries:
                stored = fields.get(b"e") or fields["e"]
                count += type_of(stored) == event_type
            if entries:
                last = Event.parse(entries[-1][1].get(b"e") or entries[-1][1]["e"]).seq
            if len(entries) < TALLY_PAGE:
                return last, count

    async def _unseen(self, task_id: str, final: Event, after: int) -> bool:
        """Whether a client resuming from ``after`` has not had ``final``, the log's final
        event at or below ``after``: it has it under its own id, or under one it was handed
        (``_hand``)."""
        if final.seq == after:  # its own id, unless that id was of the log that was lost
            return await self._began_again(task_id)
        return await self.redis.zscore(handed_key(task_id), after) is None

    async def _began_again(self, task_id: str) -> bool:
        """Whether the log began again: its first event is not its submit's (``queued``,
        and nothing else), which every task's log opens with. A client that had read id 1
        of the lost log (its ``queued``) was taken to have the new one's final event, also
        id 1, for ever. One that had that final event and reconnects from its id gets it
        once more, then nothing (``_hand``). A log whose first event was let go is not
        told (the client has it, as before)."""
        first = parse_entries(await self.redis.xrange(log_key(task_id), min="0-1", max="0-1"))
        return bool(first) and (first[0].type, first[0].data) != (STATUS, {"status": QUEUED})

    async def _hand(self, task_id: str, final: Event, last: int) -> Event:
        """``final``, numbered past ``last`` (what the stream has sent, or the client's id),
        with that id kept as long as the log, beside the last ``HANDED_KEPT`` others: one id
        for the task, two clients resuming from different ids each got it, and the first's
        reconnect got it again, under a new id. Never past ``MAX_EVENT_ID``: a reconnect
        sends it back, and a client's id is at most that."""
        handed = dataclasses.replace(final, seq=min(last + 1, MAX_EVENT_ID), stored=None)
        key = handed_key(task_id)
        ttl_ms = await self.redis.pttl(log_key(task_id))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zadd(key, {str(handed.seq): time.time()})
            pipe.zremrangebyrank(key, 0, -HANDED_KEPT - 1)
            pipe.pexpire(key, ttl_ms if ttl_ms > 0 else HANDED_KEPT_MS)
            await pipe.execute()
        return handed

    async def events(
        self,
        task_id: str,
        *,
        after: int = 0,
        quiet_s: float = 2.0,
        final_from_store: FinalFromStore | None = None,
    ) -> AsyncIterator[list[Event] | None]:
        """Every event after ``after``, in order, once each, ending with the final one, in
        pages: the events at hand at once (up to ``LOG_PAGE``, a page of the log as it is
        read), so a stream replaying a long log writes a page at a time, not an event.
        Yields None after ``quiet_s`` without news (the caller may send a keep-alive).

        A resumed stream whose log's final event is ``after`` itself ends at once, with
        nothing sent: the client has it (an EventSource reconnects after the final event,
        with its id), unless the log began again (``_began_again``). One below ``after`` is
        of a log that began again (Redis lost the one the client read), or ``after`` is made
        up: the client never had it, so it goes out at once, numbered past what the stream
        has sent for the client to take it, and the id it went out with is kept (``_hand``)
        so that a client resuming from that id ends
        with nothing, not with the same event again under a new id, for ever. Before, a
        ``Last-Event-ID`` of 10^18 - 1 on a finished task held its stream for 30 s until the
        store's final event stood in. A final event between ``after`` and what this reader
        has sent is of a log that began again too: the store's stands in for it."""
        last = after
        quiet_spells = 0
        async with self.listen(task_id) as queue:
            backlog = await self.read_log(task_id, last, LOG_PAGE)
            if after and not backlog:
                closing = await self.closing_event(task_id)
                if closing is not None and closing.seq > after:
                    # Appended since the read: the client has not had it.
                    backlog = await self.read_log(task_id, last, LOG_PAGE)
                elif closing is not None:
                    if await self._unseen(task_id, closing, after):
                        yield [await self._hand(task_id, closing, last)]
                    return
            while True:
                page = []
                for event in backlog:
                    if event.seq <= last:
                        continue
                    last = event.seq
                    page.append(event)
                    if event.final:
                        break
                if page:
                    yield page
                    if page[-1].final:
                        return
                if len(backlog) == LOG_PAGE:  # a full page: the log may hold more
                    backlog = await self.read_log(task_id, last, LOG_PAGE)
                    continue
                backlog = []
                try:
                    async with asyncio.timeout(quiet_s):
                        event = await queue.get()
                except TimeoutError:
                    quiet_spells += 1
                    backlog = await self.read_log(task_id, last, LOG_PAGE)
                    # Postgres is asked only after a longer silence: with many open streams a
                    # query per stream every few seconds would crowd out real work.
                    if (
                        not backlog
                        and final_from_store
                        and await self._ask_store(task_id, quiet_spells)
                    ):
                        substitute = await final_from_store(last)
                        if substitute is not None:
                            backlog = await self.read_log(task_id, last, LOG_PAGE)
                            if len(backlog) < LOG_PAGE and not any(e.final for e in backlog):
                                closing = await self.closing_event(task_id)
                                if closing is not None and closing.seq <= after:
                                    if await self._unseen(task_id, closing, after):
                                        yield [await self._hand(task_id, closing, last)]
                                    return
                                backlog = [substitute]
                    if not backlog:
                        yield None
                    continue
                quiet_spells = 0
                if event.final and event.seq <= after:
                    if await self._unseen(task_id, event, after):
                        yield [await self._hand(task_id, event, last)]
                    return
                if event.seq == last + 1:
                    backlog = [event]
                elif event.seq > last + 1:  # something was dropped: the log has it
                    backlog = await self.read_log(task_id, last, LOG_PAGE)
