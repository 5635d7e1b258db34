"""kombu's Redis transport, taking messages in batches: the worker's intake.

kombu takes one message per ``BRPOP`` and then records it as unacked in a second round trip
(``QoS.append``). Both run on the worker's main thread. In a threads-pool process with
hundreds of tasks in flight, every one of those round trips means winning the GIL back, and
the main thread took messages at about 200 a second with the queue full and half its slots
free (``docs/performance.md``).

Here, once a ``BRPOP`` answers, one script records that message as unacked and takes up to
``BATCH`` more from the same list, recording each, atomically, exactly as ``QoS.append``
would (the same unacked hash entry, the same index score): the others are never neither in
their list nor in the unacked hash. The script is sent before the first message is handed to
the pool and its answer read after, so that task does not wait for a round trip (kombu's
record made a sync call wait about half a millisecond more). The prefetch limit still holds:
a batch never takes more than the free slots.

It also shares one client per connection pool where kombu made one per call (below), and
sends acks in batches. kombu removes each acked message from the unacked hash in a round trip
of its own, on the worker's main thread. When a wave of calls ends together (a bridge with 100
calls in flight), their acks went one after another before the hub took new messages. Acks
the hub runs in one turn of its loop now go out as one round trip before it polls again
(``QoS.ack``).

Used by the workers when the broker is Redis (``broker_transport``); the API only publishes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from queue import Empty
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from broker import redisclients

log = logging.getLogger("reach.worker")

# Messages one script call takes at most, beyond the one BRPOP gave (and never more than the
# free slots). With 1,000 calls queued for one bridge, 128 took 6-12 % off its CPU a call
# against 32: fewer round trips, and runs that start together group their claims, events
# and finishes into fewer statements (docs/performance.md). 512 gained little more and holds
# Redis longer per script.
BATCH = 128

# KEYS[1] the list, KEYS[2] the unacked hash, KEYS[3] its index; ARGV[1] the message BRPOP gave,
# ARGV[2] how many more to take, ARGV[3] the time. Each message is recorded as kombu's
# QoS.append records it: [message, exchange, routing key].
TAKE = """
local function record(item)
  local properties = cjson.decode(item)['properties']
  local tag, delivery = properties['delivery_tag'], properties['delivery_info']
  redis.call('ZADD', KEYS[3], ARGV[3], tag)
  redis.call('HSET', KEYS[2], tag, '[' .. item .. ',' .. cjson.encode(delivery['exchange'])
    .. ',' .. cjson.encode(delivery['routing_key']) .. ']')
end
record(ARGV[1])
if tonumber(ARGV[2]) < 1 then return {} end
local items = redis.call('RPOP', KEYS[1], ARGV[2])
if not items then return {} end
for _, item in ipairs(items) do record(item) end
return items
"""


class QoS(kombu_redis.QoS):
    """Messages the batch script recorded as unacked are only noted in memory on delivery."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self.recorded: set[str] = set()
        self.acked: list[str] = []  # acked in this turn of the hub's loop, not yet sent

    def ack(self, delivery_tag: str) -> None:
        """On the hub's thread, note it: ``send_acks`` removes every message acked in this
        turn of the loop from the unacked hash in one round trip, before the loop polls
        again. Anywhere else, at once, as kombu does.

        Until it is sent, the message is still recorded as unacked: a process that dies
        meanwhile has it delivered again, and the runner, finding its task final, only acks
        it (the same as a death just before kombu's own ack). A run that outlived its
        channel (a broker connection lost while it ran: the channel closed and put its
        unacked messages back) acks at once too; it crashed the worker reading the closed
        channel's connection."""
        connection = self.channel.connection
        if connection is not None and threading.get_ident() == connection.hub_thread:
            self.acked.append(delivery_tag)
            return
        super().ack(delivery_tag)  # type: ignore[no-untyped-call]
        self._settled(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        super().reject(delivery_tag, requeue)  # type: ignore[no-untyped-call]
        self._settled(delivery_tag)

    def _settled(self, delivery_tag: str) -> None:
        """The loop consumer frees the slot of a message it handed to Celery."""
        taker = getattr(self.channel, "loop_consumer", None)
        if taker is not None:
            taker.settled(delivery_tag)

    def send_acks(self) -> None:
        acked, self.acked = self.acked, []
        if not acked:
            return
        try:
            with self.pipe_or_acquire() as pipe:
                pipe.zrem(self.unacked_index_key, *acked).hdel(self.unacked_key, *acked)
                pipe.execute()
        except Exception:  # as kombu's ack_log_error: they stay unacked, and come again
            log.exception("%d acks not sent: those messages will be delivered again", len(acked))
        for tag in acked:
            virtual.QoS.ack(self, tag)  # type: ignore[no-untyped-call]
            self._settled(tag)

    def restore_unacked(self, client: Any = None) -> None:
        self.send_acks()  # acked ones are not restored
        super().restore_unacked(client)  # type: ignore[no-untyped-call]

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in self.recorded:
            self.recorded.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]
            return
        super().append(message, delivery_tag)  # type: ignore[no-untyped-call]

    def room(self) -> int:
        """How many more messages the prefetch limit lets this channel take."""
        if not self.prefetch_count:
            return BATCH
        return int(self.prefetch_count - (len(self._delivered) - len(self._dirty)))


class Channel(kombu_redis.Channel):
    QoS = QoS
    loop_consumer: Any = None  # a workers.loop_consumer.LoopConsumer taking the run queues

    def _update_queue_cycle(self) -> None:
        """kombu's ``BRPOP`` cycle, without the queues the loop consumer takes
        (``workers.loop_consumer``), which it is told of instead. Called whenever the queues
        consumed change."""
        taker = self.loop_consumer
        if taker is None:
            super()._update_queue_cycle()  # type: ignore[no-untyped-call]
            return
        owned = [queue for queue in self.active_queues if taker.owns(queue)]
        self._queue_cycle.update([queue for queue in self.active_queues if queue not in owned])
        taker.consume(self, owned)

    def close(self) -> None:
        if self._qos is not None:
            self._qos.send_acks()
        super().close()  # type: ignore[no-untyped-call]

    def _connparams(self, asynchronous: bool = False) -> Any:
        """kombu's, without redis-py's announcement of each connection
        (``broker.redisclients``)."""
        params = super()._connparams(asynchronous=asynchronous)  # type: ignore[no-untyped-call]
        return {**params, **redisclients.QUIET}

    def _create_client(self, asynchronous: bool = False) -> Any:
        """One client per connection pool, not one per call. kombu makes a new ``redis.Redis``
        for every ack and unacked record, whose constructor copies redis-py's table of
        response callbacks: in a threads worker that was a third of the main thread's time
        (``docs/performance.md``). A client is safe to share between threads: each command
        takes a connection from the pool."""
        if asynchronous:
            return super()._create_client(asynchronous=True)  # type: ignore[no-untyped-call]
        pool = self.pool
        cached = self.__dict__.get("_shared_client")
        if cached is None or cached[0] is not pool:
            client = super()._create_client()  # type: ignore[no-untyped-call]
            cached = self.__dict__["_shared_client"] = (pool, client)
        return cached[1]

    def _brpop_read(self, **options: Any) -> bool:
        try:
            try:
                answer = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # the next poll connects again
                raise
            if not answer:
                raise Empty()
            key, item = answer
            queue = key.decode().rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            message = json.loads(item)
            if self.global_keyprefix:  # kombu's own way: QoS.append records it, alone
                self.connection._deliver(message, queue)
            else:
                self._deliver_and_take(key, item, message, queue)
        finally:
            self._in_poll = None  # type: ignore[assignment]
            self._flush_brpop_reauth()  # type: ignore[no-untyped-call]
        return True

    def _deliver_and_take(self, key: bytes, item: bytes, message: Any, queue: str) -> None:
        """Deliver the message BRPOP gave, and up to ``BATCH`` more of its list, in one round
        trip that is sent before the first is delivered and read after.

        kombu records a message as unacked in a round trip of its own before it hands it on,
        and the task waited for it. Here the script that records it (and takes and records
        the others) is already in Redis's hands when the task starts, so the record still
        precedes the task's ack, but nothing waits for its answer."""
        qos = self.qos
        count = max(0, min(BATCH, qos.room() - 1))  # the first takes one of the free slots
        connection = self.client.connection
        keys = [key, qos.unacked_key, qos.unacked_index_key]
        connection.send_command("EVAL", TAKE, len(keys), *keys, item, count, time.time())
        tag = message["properties"]["delivery_tag"]
        qos.recorded.add(tag)
        try:
            self.connection._deliver(message, queue)
        except BaseException:
            qos.recorded.discard(tag)
            self._put_back_taken(connection)
            raise
        try:
            taken = self.client.parse_response(connection, "EVAL")
        except self.connection_errors:
            connection.disconnect()  # the next poll connects again
            raise
        for more in taken:
            message = json.loads(more)
            qos.recorded.add(message["properties"]["delivery_tag"])
            self.connection._deliver(message, queue)

    def _put_back_taken(self, connection: Any) -> None:
        """The first message was not delivered: the others the script took go back to the
        front of their list (recorded as unacked, they would wait for the visibility
        timeout)."""
        try:
            taken = self.client.parse_response(connection, "EVAL")
        except Exception:
            connection.disconnect()
            return
        for more in taken:
            tag = json.loads(more)["properties"]["delivery_tag"]
            self.qos.restore_by_tag(tag, leftmost=True)


class Transport(kombu_redis.Transport):
    Channel = Channel
    hub_thread: int | None = None  # the thread of the hub this transport is registered with

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """The hub's loop runs on the thread that registers its transport (Celery's
        ``asynloop``); ``send_acks`` runs on each of its turns, first thing in kombu's
        ``on_poll_start``. Not as a tick callback of its own: the hub keeps those in a set,
        in no fixed order, and when kombu's ran first it found the prefetch limit still full
        of acked messages and sent no ``BRPOP``, so the worker waited for its next wake-up
        (a prefork worker, whose slots are few, by tens of milliseconds a task)."""
        self.hub_thread = threading.get_ident()
        cycle: Any = self.cycle  # kombu's MultiChannelPoller
        if "on_poll_start" not in vars(cycle):  # once, if the transport registers again
            poll_start = cycle.on_poll_start

            def acks_then_poll_start() -> None:
                self.send_acks()  # the slots they free count for this turn's BRPOP
                poll_start()

            cycle.on_poll_start = acks_then_poll_start
        super().register_with_event_loop(connection, loop)  # type: ignore[no-untyped-call]

    def send_acks(self) -> None:
        """Every ack the hub ran in this turn of its loop, one round trip per channel (the
        hub calls it before it polls)."""
        for channel in list(self.channels):
            qos = channel._qos
            if qos is not None and qos.acked:
                qos.send_acks()
