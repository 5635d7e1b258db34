"""The run messages of a threads-pool worker, taken from Redis on the process's event loop.

Celery's consumer takes messages on the worker's main thread (kombu's ``BRPOP``), and the
pool hands each run to the event loop, which runs it (``workers.pool``). With hundreds of
calls in flight that is two busy threads handing the GIL to each other on every message, and
a quarter of a bridge process's CPU spent in kombu (``docs/performance.md``). Here the loop
takes the run queues' messages itself, on a Redis connection of its own: one ``BRPOP``, then
one script that records that message as unacked and takes up to ``BATCH`` more
(``workers.transport``'s, the same records kombu's ``QoS.append`` makes), and each run starts
on the loop at once (an async handler's) or in one of the pool's threads (a sync handler's).
Acks made in one turn of the loop go out together.

Celery keeps everything else. Its consumer still consumes the run queues (``-Q``, the lease
keeper's pauses, the bridge's registrations, ``inspect active_queues``): its channel only
leaves their ``BRPOP`` to this consumer (``Channel._update_queue_cycle``). A message the direct
path does not take (an expiry, task events on, another task, a run whose direct path failed
before its claim) goes to Celery's consumer as kombu would have delivered it.

Delivery is kombu's: a message is recorded as unacked before its run can ack it, and acked
(late) after its final state is written. A process killed with runs in flight leaves them
unacked, for the lease keeper's and the reaper's recovery; a cold shutdown puts them back on
their queues, as kombu's channel does; a warm one stops taking, lets the runs in flight
finish, then sends their acks. The prefetch limit is the pool's concurrency: it takes
no more messages than it has free slots.

One tenant's runs hold at most its share of those slots (``REACH_MAX_SLOTS_SHARE``, read from
the message's ``TENANT_HEADER`` before anything else is): a message of a tenant holding its
share goes back to its queue, behind every other message, and the consumer takes again at the
next run that ends (or after ``SHARE_WAIT_S``). One tenant's slow calls cannot take every slot
of a bridge or an async worker while the other tenants' tasks wait.

A card's ``max_concurrency`` bounds its runs in the process the same way, without setting
anything aside: a queue whose card holds that many runs is left out of the ``BRPOP`` until
one of them ends, so its messages keep their order. Within it, one tenant's runs hold at
most their share of it.

A countdown's message (a retry's back-off) is held here, unacked and holding no slot, until
it is due; then it starts as any message taken then would, within the slots, its card's
``max_concurrency`` and its tenant's share: it goes first in its queue when there is no room
for it, and behind the queue's others when its tenant holds its share. Left to Celery's
timer, a retry ran when due whatever the process held: a remote agent answering 429 got its
retries past its ``max_concurrency``, exactly when it was overloaded.

Used by a worker started with ``-P threads`` whose broker is Redis, unless OpenTelemetry is
on (Celery's tracer makes the spans, so every task takes Celery's way).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Hashable
from datetime import UTC, datetime
from typing import Any

import redis
import redis.asyncio

from broker import jsoncodec, redisclients
from broker.observability import metrics
from broker.tasks.dispatch import BEHIND, RUN_TASK, TENANT_HEADER
from workers.card_runs import bound_of
from workers.transport import BATCH, TAKE

log = logging.getLogger("reach.worker")
BRPOP_TIMEOUT_S = 1  # how long a change of queues may wait for the pending BRPOP, as kombu's
RETRY_S = 1.0
# KEYS[1] the list, KEYS[2] the unacked hash, KEYS[3] its index; ARGV[1] a message taken and
# recorded as unacked: back at the end of the list BRPOP takes from, no longer unacked.
PUT_BACK = """
local tag = cjson.decode(ARGV[1])['properties']['delivery_tag']
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[3], tag)
redis.call('HDEL', KEYS[2], tag)
"""
# KEYS[1] the queue's last list, KEYS[2] the unacked hash, KEYS[3] its index; ARGV[1] a
# message's tag, ARGV[2] the message: behind every message of the queue, no longer unacked.
SET_ASIDE = """
redis.call('LPUSH', KEYS[1], ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
"""
# After setting a message aside, the next take waits for a run to end, at most this long: the
# messages set aside are not taken again at once, and another tenant's wait no longer.
SHARE_WAIT_S = 0.25
CELERY_WAY = "reach_celery_way"  # a message's property: it skips the direct path

Run = tuple[str, str, str]  # task id, queue, worker hostname


def plain(content_type: str, headers: dict[str, Any], revoked: Any, events_on: bool) -> bool:
    """Whether a run message may skip Celery's request: JSON, no countdown (Celery's timer
    holds those), not expired and not revoked (Celery drops those), and task events off
    (Flower turns them on, and they come from Celery's requests)."""
    if content_type != "application/json" or headers.get("eta"):
        return False
    if headers.get("id") in revoked:
        return False
    expires = headers.get("expires")
    if expires:
        try:
            if datetime.fromisoformat(expires) <= datetime.now(UTC):
                return False
        except (TypeError, ValueError):
            return False
    return not events_on


def _due_in(eta: Any) -> float | None:
    """Seconds until a countdown's ``eta`` (ISO 8601, as Celery writes it); None when it does
    not read as one (Celery's consumer is left to make of it what it does)."""
    try:
        at = datetime.fromisoformat(eta)
    except (TypeError, ValueError):
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return (at - datetime.now(UTC)).total_seconds()


def share_cap(slots: int, share: float) -> int:
    """The most of a process's ``slots`` one tenant's runs may hold: ``share`` of them,
    rounded up (below 10 slots, a share of 0.9 keeps none back), at least one."""
    return max(1, min(slots, math.ceil(slots * share - 1e-9)))


def tenant_of(headers: dict[str, Any]) -> str | None:
    """Whose task a run message runs (``dispatch.TENANT_HEADER``); None for a message without
    one (published before it was added, or not by the broker): it counts for nobody's share.
    A countdown's message holds no slot (Celery's timer holds it), so it counts neither."""
    tenant = headers.get(TENANT_HEADER)
    if headers.get("eta") or not isinstance(tenant, str) or not tenant:
        return None
    return tenant


def events_on(dispatcher: Any) -> bool:
    """Whether Celery sends task events (a monitor such as Flower asked for them)."""
    return bool(
        dispatcher is not None
        and dispatcher.enabled
        and (not dispatcher.groups or "task" in dispatcher.groups)
    )


class LoopConsumer:
    """Takes the run queues' messages on the event loop and starts their runs there."""

    def __init__(self, direct: Any, broker_url: str, slots_share: float = 1.0) -> None:
        self.direct = direct
        self.broker_url = broker_url
        self.slots_share = slots_share
        self._lock = threading.Lock()
        self._consumer: Any = None
        self._keys: dict[str, str] = {}  # list key -> queue, for the queues consumed
        self._last: dict[str, str] = {}  # queue -> its last list (``dispatch.BEHIND``)
        self._unacked = ("unacked", "unacked_index")
        self._slots = 1
        self._held: dict[str, tuple[str, bytes | str]] = {}  # tag: (list key, message)
        # Tags handed to Celery's consumer (``_to_celery``): each holds its slot until Celery
        # acks or rejects it (``settled``), as its own prefetch limit would.
        self._with_celery: set[str] = set()
        self._tenant_of: dict[str, str] = {}  # tag -> tenant, of each message holding a slot
        self._holding: dict[str, int] = {}  # tenant -> the slots its runs hold
        self._aside: list[tuple[str, str, str]] = []  # (last list, tag, message) to set aside
        self._card_of: dict[str, Hashable] = {}  # tag -> its card, of each message holding a slot
        self._card_runs: dict[Hashable, int] = {}  # card -> the slots its runs hold
        self._full: set[Hashable] = set()  # cards holding their max_concurrency of runs
        # (card, tenant) -> the runs of a card of a max_concurrency that the tenant holds
        self._card_holding: dict[tuple[Hashable, str], int] = {}
        self._crowded = False  # the last take set messages aside
        # tag -> (list key, message, queue, its timer): countdowns held until they are due
        self._later: dict[str, tuple[str, dict[str, Any], str, asyncio.TimerHandle]] = {}
        self._acks: list[str] = []
        self._taker: asyncio.Task[None] | None = None
        self._taking = False  # a BRPOP or its batch is out: cancelling could lose what it takes
        self._room: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._redis: redis.asyncio.Redis | None = None
        self._acker: redis.asyncio.Redis | None = None
        self._sending: set[asyncio.Task[None]] = set()

    # -- the consumer's side (Celery's thread) -----------------------------------------------

    def owns(self, queue: str) -> bool:
        """Whether a queue's messages are taken here: those of the capabilities served here."""
        return self.direct.runner.registry.for_queue(queue) is not None

    def follow(self, consumer: Any) -> None:
        """Serve this consumer's run queues (its consumer bootstep started): its channel
        leaves their ``BRPOP`` to this one from now on."""
        channel = consumer.task_consumer.channel
        with self._lock:
            self._consumer = consumer
            self._slots = max(1, int(consumer.pool.limit or 1))
            self._unacked = (channel.unacked_key, channel.unacked_index_key)
        channel.loop_consumer = self
        channel._update_queue_cycle()
        loop = self.direct.runner.calls.loop
        if self._room is not None:  # a new channel: the old one's deliveries settle no more
            loop.call_soon_threadsafe(self._forget_celerys)
        if self._taker is None:
            ready = concurrent.futures.Future[None]()

            def start() -> None:
                self._room, self._changed = asyncio.Event(), asyncio.Event()
                self._taker = loop.create_task(self._take_forever(), name="reach-loop-consumer")
                ready.set_result(None)

            loop.call_soon_threadsafe(start)
            ready.result(timeout=10)

    def consume(self, channel: Any, queues: list[str]) -> None:
        """The run queues the channel consumes now (called when they change)."""
        keys = {
            channel._q_for_pri(queue, priority): queue
            for priority in channel.priority_steps
            for queue in sorted(queues)
        }
        last = {queue: channel._q_for_pri(queue, BEHIND) for queue in queues}
        with self._lock:
            changed = set(self._keys.values()) != set(queues)
            self._keys = keys
            self._last = last
        if changed:
            log.info("run queues taken on the event loop: %s", ", ".join(sorted(queues)) or "none")
        if self._changed is not None:
            self.direct.runner.calls.loop.call_soon_threadsafe(self._changed.set)

    def pause(self) -> None:
        """Stop taking (the consumer stops: a warm shutdown, or a lost connection)."""
        with self._lock:
            self._keys = {}

    # -- the loop's side -----------------------------------------------------------------------

    async def _take_forever(self) -> None:
        order: list[str] = []  # the run queues, in kombu's fair cycle
        while True:
            try:
                await self._wait_for_room()
                with self._lock:
                    keys = self._keys
                if not keys:
                    assert self._changed is not None
                    self._changed.clear()
                    async with asyncio.timeout(BRPOP_TIMEOUT_S):
                        await self._changed.wait()
                    continue
                open_keys = keys
                if self._full:  # leave out the queues whose card holds its max_concurrency
                    open_keys = {
                        k: q for k, q in keys.items() if self._card(q)[0] not in self._full
                    }
                if not open_keys:
                    await self._wait_for_a_release()
                    continue
                queues = list(dict.fromkeys(open_keys.values()))
                order = [q for q in order if q in queues] + [q for q in queues if q not in order]
                # a queue left out comes back at a run's end: asked again soon, not in 1 s
                wait_s = BRPOP_TIMEOUT_S if len(open_keys) == len(keys) else SHARE_WAIT_S
                await self._take(order, open_keys, wait_s)
                if self._crowded:
                    await self._wait_for_a_release()
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                continue
            except Exception as exc:  # Redis away: kombu's consumer would reconnect too
                log.warning("the loop consumer could not take messages (%r); again in 1s", exc)
                await self._reconnect_later()

    async def _reconnect_later(self) -> None:
        broken, self._redis = self._redis, None
        if broken is not None:
            try:
                await broken.aclose()
            except Exception:
                log.debug("closing the loop consumer's broken connection failed", exc_info=True)
        await asyncio.sleep(RETRY_S)

    def _in_flight(self) -> int:
        return len(self._held) + len(self._with_celery)

    async def _wait_for_room(self) -> None:
        assert self._room is not None
        while self._in_flight() >= self._slots:
            self._room.clear()
            await self._room.wait()

    async def _wait_for_a_release(self) -> None:
        """Until a run ends (a slot, maybe of the tenant whose messages were set aside), at
        most ``SHARE_WAIT_S``."""
        assert self._room is not None
        self._room.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHARE_WAIT_S):
                await self._room.wait()

    def _card(self, queue: str) -> tuple[Hashable, int | None]:
        """The card serving ``queue`` here, and its ``max_concurrency`` (``card_runs``)."""
        spec = self.direct.runner.registry.for_queue(queue)
        return (queue, None) if spec is None else bound_of(spec.card)

    def _room_in(self, queue: str) -> int:
        """How many more runs ``queue``'s card may start here (``BATCH`` or more: no bound)."""
        card, bound = self._card(queue)
        if bound is None:
            return BATCH + 1
        return bound - self._card_runs.get(card, 0)

    async def _take(self, order: list[str], keys: dict[str, str], wait_s: float) -> None:
        if self._redis is None:
            self._redis = redis.asyncio.Redis.from_url(
                self.broker_url,
                single_connection_client=True,
                client_name=f"reach-loop-consumer:{self._consumer.hostname}",
                **redisclients.QUIET,
            )
        self._taking = True
        try:
            await self._take_from(self._redis, order, keys, wait_s)
        finally:
            self._taking = False

    async def _take_from(
        self,
        client: redis.asyncio.Redis,
        order: list[str],
        keys: dict[str, str],
        wait_s: float = BRPOP_TIMEOUT_S,
    ) -> None:
        answer = await client.brpop(brpop_keys(keys, order), timeout=wait_s)
        if not answer:  # nothing waits: nothing of a tenant's to set aside either
            self._crowded = False
            return
        raw_key, item = answer
        key = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
        with self._lock:
            still = self._keys
        if key not in still:  # no longer consumed here (paused, shutting down): put it back
            await client.rpush(key, item)
            return
        order.append(order.pop(order.index(keys[key])))  # kombu's fair cycle
        if self._in_flight() >= self._slots or self._room_in(keys[key]) <= 0:
            # a countdown came due during the wait and took the room this take was for
            await client.rpush(key, item)
            return
        # one at a time while a tenant holds its share: not a batch of its to set aside
        room = 0 if self._crowded else self._slots - self._in_flight() - 1
        room = min(room, self._room_in(keys[key]) - 1)  # within the card's max_concurrency
        unacked, index = self._unacked
        taking = client.eval(
            TAKE, 3, key, unacked, index, item, max(0, min(BATCH, room)), time.time()
        )
        self._start(key, item, still[key])  # starts while the script runs
        taken = await taking
        with self._lock:
            stopped = not self._keys
        if stopped:  # the worker stops taking: they wait for the next one, in their order
            for more in reversed(taken):
                await client.eval(PUT_BACK, 3, key, unacked, index, more)
        else:
            for more in taken:
                self._start(key, more, still[key])
        await self._set_aside(client)

    async def _set_aside(self, client: redis.asyncio.Redis) -> None:
        """Send the messages ``_start`` set aside behind their queues' others (after the
        script that recorded them as unacked)."""
        aside, self._aside = self._aside, []
        self._crowded = bool(aside)
        if not aside:
            return
        unacked, index = self._unacked
        async with client.pipeline(transaction=False) as pipe:
            for last, tag, message in aside:
                pipe.eval(SET_ASIDE, 3, last, unacked, index, tag, message)
            await pipe.execute()
        metrics.runs_set_aside.inc(len(aside))

    def _start(self, key: str, item: bytes | str, queue: str) -> None:
        try:
            message = jsoncodec.loads(item)
            tag = str(message["properties"]["delivery_tag"])
        except (TypeError, ValueError, KeyError):  # kombu could not read it either
            log.error("a message on %s that is not kombu's was dropped: %.200r", queue, item)
            return
        headers = message.get("headers") or {}
        if headers.get("eta"):
            due_in = _due_in(headers["eta"])
            if due_in is not None and due_in > 0:
                self._hold_until_due(tag, key, message, queue, due_in)
                return
            if due_in is not None:  # due: a run like any other from here
                del headers["eta"]
                item = json.dumps(message)
        tenant = tenant_of(headers)
        card, bound = self._card(queue)
        if tenant is not None and self._past_share(tenant, card, bound):
            self._aside.append((self._last.get(queue, key), tag, self._behind(message)))
            return
        self._held[tag] = (key, item)
        if tenant is not None:
            self._tenant_of[tag] = tenant
            self._holding[tenant] = self._holding.get(tenant, 0) + 1
            if bound is not None:
                held = self._card_holding.get((card, tenant), 0)
                self._card_holding[(card, tenant)] = held + 1
        if not headers.get("eta"):  # a countdown Celery's timer holds (``_to_celery``) holds none
            self._card_of[tag] = card
            runs = self._card_runs[card] = self._card_runs.get(card, 0) + 1
            if bound is not None and runs >= bound:
                self._full.add(card)
        run = self._run_of(message)
        if run is None:
            self._to_celery(tag, message, queue)
            return

        def celerys_way() -> None:
            self._to_celery(tag, message, queue, direct_failed=True)

        if self.direct.is_async(run[1]):
            self.direct.start(run, lambda _: self._ack(tag), celerys_way)
        else:
            loop = asyncio.get_running_loop()
            self.direct.submit_sync(
                run,
                lambda: loop.call_soon_threadsafe(self._ack, tag),
                lambda: loop.call_soon_threadsafe(celerys_way),
                self._consumer.pool.executor,
            )

    def _hold_until_due(
        self, tag: str, key: str, message: dict[str, Any], queue: str, due_in: float
    ) -> None:
        """Hold a countdown's message (unacked, no slot) until it is due (``_due``)."""
        timer = asyncio.get_running_loop().call_later(due_in, self._due, tag)
        self._later[tag] = (key, message, queue, timer)

    def _due(self, tag: str) -> None:
        """A countdown is due: it starts as a message taken now would. Its tenant holding its
        share, it waits behind the queue's others (as ``_set_aside``); with no slot or no
        room in its card here now, or its queue no longer taken here (a drain), it goes first
        in its queue, for the next take that has room, here or in another process."""
        held = self._later.pop(tag, None)
        if held is None:  # put back meanwhile
            return
        key, message, queue, _ = held
        headers = message.setdefault("headers", {})
        headers.pop("eta", None)  # a run like any other from here
        with self._lock:
            consumed = queue in self._keys.values()
        if not consumed or self._in_flight() >= self._slots or self._room_in(queue) <= 0:
            self._send_back(PUT_BACK, key, json.dumps(message))
            return
        tenant = tenant_of(headers)
        if tenant is not None and self._past_share(tenant, *self._card(queue)):
            last = self._last.get(queue, key)
            self._send_back(SET_ASIDE, last, tag, self._behind(message))
            metrics.runs_set_aside.inc()
            return
        self._start(key, json.dumps(message), queue)

    def _send_back(self, script: str, key: str, *args: str) -> None:
        """Run ``PUT_BACK`` or ``SET_ASIDE`` for one message, from the loop, in the
        background (a warm shutdown waits for it, as for acks)."""
        task = asyncio.get_running_loop().create_task(self._sent_back(script, key, *args))
        self._sending.add(task)  # the loop holds its tasks weakly
        task.add_done_callback(self._sending.discard)

    async def _sent_back(self, script: str, key: str, *args: str) -> None:
        if self._acker is None:
            self._acker = redis.asyncio.Redis.from_url(self.broker_url, **redisclients.QUIET)
        unacked, index = self._unacked
        try:
            await self._acker.eval(script, 3, key, unacked, index, *args)
        except Exception:  # as an ack that fails: it stays unacked, and comes again
            log.exception("a due countdown was not put back on %s: it will come again", key)

    def _past_share(self, tenant: str, card: Hashable, bound: int | None) -> bool:
        """Whether the tenant's runs hold their share of the process's slots already, or of
        the card's ``max_concurrency`` (a card of 10 runs keeps one for the other tenants)."""
        if self._holding.get(tenant, 0) >= share_cap(self._slots, self.slots_share):
            return True
        held = self._card_holding.get((card, tenant), 0)
        return bound is not None and held >= share_cap(bound, self.slots_share)

    @staticmethod
    def _behind(message: dict[str, Any]) -> str:
        """The message as it waits in its queue's last list (kombu reads a restored message's
        list from its priority)."""
        message.setdefault("properties", {})["priority"] = BEHIND
        return json.dumps(message)

    def _let_go(self, tag: str) -> None:
        """A message no longer holds its slot: its tenant's share has it back."""
        tenant = self._tenant_of.pop(tag, None)
        if tenant is not None:
            left = self._holding.get(tenant, 1) - 1
            if left > 0:
                self._holding[tenant] = left
            else:
                self._holding.pop(tenant, None)
        card = self._card_of.pop(tag, None)
        if tenant is not None and (card, tenant) in self._card_holding:
            held = self._card_holding.pop((card, tenant)) - 1
            if held > 0:
                self._card_holding[(card, tenant)] = held
        if card is not None:
            self._full.discard(card)
            runs = self._card_runs.get(card, 1) - 1
            if runs > 0:
                self._card_runs[card] = runs
            else:
                self._card_runs.pop(card, None)

    def _run_of(self, message: dict[str, Any]) -> Run | None:
        """The run a plain run message asks for, if its handler is served here."""
        from celery.worker import state

        headers = message.get("headers") or {}
        consumer = self._consumer
        if headers.get("task") != RUN_TASK or not plain(
            str(message.get("content-type")),
            headers,
            state.revoked,
            events_on(consumer.event_dispatcher),
        ):
            return None
        properties = message.get("properties") or {}
        body = message.get("body") or ""
        try:
            if properties.get("body_encoding") == "base64":
                body = base64.b64decode(body)
        except (TypeError, ValueError):
            return None
        return self.direct.run_of(body, consumer.hostname, sync=True)  # type: ignore[no-any-return]

    def _to_celery(
        self, tag: str, message: dict[str, Any], queue: str, direct_failed: bool = False
    ) -> None:
        """Celery's consumer takes it, as if its channel had taken it: recorded as unacked
        already, delivered on the consumer's thread. Its slot stays taken until Celery acks
        or rejects it: handed over without its prefetch limit, a worker with task events on
        (Flower turns them on) took every message of its queues at once. Except a countdown's
        (a retry's back-off), which Celery's timer holds until it is due: as Celery raises
        its prefetch limit for each, it holds no slot meanwhile."""
        self._held.pop(tag, None)
        assert self._room is not None
        if (message.get("headers") or {}).get("eta"):
            self._let_go(tag)
            self._room.set()
        else:
            self._with_celery.add(tag)
        if direct_failed:
            message["properties"][CELERY_WAY] = True
        consumer = self._consumer

        def deliver() -> None:
            channel = consumer.task_consumer.channel
            channel.qos.recorded.add(tag)
            channel.connection._deliver(message, queue)

        consumer.hub.call_soon(deliver)

    def settled(self, tag: str) -> None:
        """Celery acked or rejected a message (any thread): if it was handed over here, its
        slot is free."""
        if tag in self._with_celery:
            with contextlib.suppress(RuntimeError):  # the loop closed: the worker is stopping
                self.direct.runner.calls.loop.call_soon_threadsafe(self._release, tag)

    def _release(self, tag: str) -> None:
        if tag in self._with_celery:
            self._with_celery.discard(tag)
            self._let_go(tag)
            assert self._room is not None
            self._room.set()

    def _forget_celerys(self) -> None:
        """The channel they were delivered on is gone, its unacked messages put back."""
        for tag in self._with_celery:
            self._let_go(tag)
        self._with_celery.clear()
        assert self._room is not None
        self._room.set()

    def _ack(self, tag: str) -> None:
        if self._held.pop(tag, None) is None:
            return
        self._let_go(tag)
        assert self._room is not None
        self._room.set()
        self._acks.append(tag)
        if len(self._acks) == 1:
            asyncio.get_running_loop().call_soon(self._send_acks)

    def _send_acks(self) -> None:
        acks, self._acks = self._acks, []
        task = asyncio.get_running_loop().create_task(self._acked(acks))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _acked(self, tags: list[str]) -> None:
        if self._acker is None:
            self._acker = redis.asyncio.Redis.from_url(self.broker_url, **redisclients.QUIET)
        unacked, index = self._unacked
        try:
            async with self._acker.pipeline(transaction=False) as pipe:
                pipe.zrem(index, *tags)
                pipe.hdel(unacked, *tags)
                await pipe.execute()
        except Exception:  # as kombu's ack_log_error: they stay unacked, and come again
            log.exception("%d acks not sent: those messages will be delivered again", len(tags))

    async def _settled(self) -> None:
        while self._acks or self._sending:
            await asyncio.sleep(0)
            if self._sending:
                await asyncio.wait(set(self._sending))

    # -- stopping --------------------------------------------------------------------------

    def settle(self, timeout_s: float = 10.0) -> None:
        """Until the acks of the runs that ended are sent (a warm shutdown, after the pool
        stopped); then the countdowns still held go back on their queues."""
        loop = self.direct.runner.calls.loop
        try:
            asyncio.run_coroutine_threadsafe(self._settled(), loop).result(timeout_s)
        except Exception:
            log.exception("acks not all sent at shutdown: those messages come again")
        if self._later:
            self.put_back(timeout_s)

    def _later_ones(self) -> dict[str, tuple[str, str]]:
        """The countdowns held, let go of: (list key, message) by tag. On the loop."""
        later, self._later = self._later, {}
        for _, _, _, timer in later.values():
            timer.cancel()
        return {tag: (key, json.dumps(message)) for tag, (key, message, _, _) in later.items()}

    def put_back(self, timeout_s: float = 10.0) -> int:
        """Put every message still held back on its queue, marked redelivered (a cold
        shutdown, as kombu's channel restores its unacked messages when it closes)."""
        loop = self.direct.runner.calls.loop

        async def held() -> dict[str, tuple[str, bytes | str]]:
            for _ in range(int(2 * BRPOP_TIMEOUT_S / 0.05)):  # what it takes comes back
                if not self._taking:
                    break
                await asyncio.sleep(0.05)
            if self._taker is not None:
                self._taker.cancel()
            taken, self._held = dict(self._held), {}
            for tag in taken:
                self._let_go(tag)
            return taken | self._later_ones()

        self.pause()

        try:
            taken = asyncio.run_coroutine_threadsafe(held(), loop).result(timeout_s)
        except Exception:
            log.exception("the messages held could not be listed: they come again later")
            return 0
        if not taken:
            return 0
        unacked, index = self._unacked
        client = redis.Redis.from_url(self.broker_url, socket_timeout=timeout_s)
        try:
            with client.pipeline(transaction=False) as pipe:
                for key, item in taken.values():
                    message = json.loads(item)
                    message.setdefault("headers", {})["redelivered"] = True
                    message["properties"].setdefault("delivery_info", {})["redelivered"] = True
                    pipe.eval(PUT_BACK, 3, key, unacked, index, json.dumps(message))
                pipe.execute()
        except Exception:
            log.exception("%d messages not put back: they come again later", len(taken))
            return 0
        finally:
            client.close()
        log.info("%d messages in flight put back on their queues", len(taken))
        return len(taken)


def loop_consumer_step(loop_consumer: LoopConsumer) -> type:
    """A consumer bootstep: while the consumer runs, ``loop_consumer`` takes its run queues."""
    from celery import bootsteps

    class LoopConsumerStep(bootsteps.StartStopStep):  # type: ignore[misc]
        requires = ("celery.worker.consumer.tasks:Tasks",)

        def start(self, consumer: Any) -> None:
            if usable(consumer):
                loop_consumer.follow(consumer)

        def stop(self, consumer: Any) -> None:
            loop_consumer.pause()

        def shutdown(self, consumer: Any) -> None:
            loop_consumer.pause()

    return LoopConsumerStep


def usable(consumer: Any) -> bool:
    """Whether this consumer's run queues can be taken on the loop: the direct pool, an event
    loop of Celery's (the hub), and this package's Redis transport without a key prefix."""
    from workers.pool import TaskPool
    from workers.transport import Channel

    channel = getattr(getattr(consumer, "task_consumer", None), "channel", None)
    return (
        isinstance(consumer.pool, TaskPool)
        and consumer.pool.direct is not None
        and consumer.hub is not None
        and isinstance(channel, Channel)
        and not channel.global_keyprefix
    )


def brpop_keys(keys: dict[str, str], order: list[str]) -> list[str]:
    """The lists to ``BRPOP``, as kombu asks them: every queue's first list in the cycle's
    ``order``, then every queue's next. A list of a lower priority (a tenant's tasks queued
    behind the others', ``dispatch.BEHIND``) is taken only when no queue holds a higher one.
    ``keys``: list key -> queue, each queue's lists in priority order."""
    lists: dict[str, list[str]] = {}
    for key, queue in keys.items():
        lists.setdefault(queue, []).append(key)
    steps = max(map(len, lists.values()), default=0)
    return [
        lists[queue][step] for step in range(steps) for queue in order if step < len(lists[queue])
    ]
