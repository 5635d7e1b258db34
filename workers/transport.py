"""kombu's Redis transport, taking messages in batches: the worker's intake.

kombu takes one message per ``BRPOP`` and then records it as unacked in a second round trip
(``QoS.append``). Both run on the worker's main thread. In a threads-pool process with
hundreds of tasks in flight, every one of those round trips means winning the GIL back, and
the main thread took messages at about 200 a second with the queue full and half its slots
free (``docs/performance.md``).

Here, once a ``BRPOP`` answers, one script takes up to ``BATCH`` more messages from the same
list and records each as unacked, atomically, exactly as ``QoS.append`` would (the same
unacked hash entry, the same index score). So there is no moment at which a message is
neither in its list nor in the unacked hash, where kombu's own pair of round trips has one.
The prefetch limit still holds: a batch never takes more than the free slots.

It also shares one client per connection pool where kombu made one per call (below).

Used by the workers when the broker is Redis (``broker_transport``); the API only publishes.
"""

from __future__ import annotations

import json
import time
from queue import Empty
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

BATCH = 32  # messages one script call takes at most, beyond the one BRPOP gave

# KEYS[1] the list, KEYS[2] the unacked hash, KEYS[3] its index; ARGV[1] how many, ARGV[2] the
# time. Each message is recorded as kombu's QoS.append records it: [message, exchange, key].
_TAKE = """
local items = redis.call('RPOP', KEYS[1], ARGV[1])
if not items then return {} end
for _, item in ipairs(items) do
  local properties = cjson.decode(item)['properties']
  local tag, delivery = properties['delivery_tag'], properties['delivery_info']
  redis.call('ZADD', KEYS[3], ARGV[2], tag)
  redis.call('HSET', KEYS[2], tag, '[' .. item .. ',' .. cjson.encode(delivery['exchange'])
    .. ',' .. cjson.encode(delivery['routing_key']) .. ']')
end
return items
"""


class QoS(kombu_redis.QoS):
    """Messages the batch script recorded as unacked are only noted in memory on delivery."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self.recorded: set[str] = set()

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
            self.connection._deliver(json.loads(item), queue)
        finally:
            self._in_poll = None  # type: ignore[assignment]
            self._flush_brpop_reauth()  # type: ignore[no-untyped-call]
        self._take_more(key, queue)
        return True

    def _take_more(self, key: bytes, queue: str) -> None:
        """Deliver up to ``BATCH`` more messages of the list that just answered, recorded as
        unacked by the script that takes them."""
        qos = self.qos
        count = min(BATCH, qos.room())
        if count <= 0 or self.global_keyprefix:
            return
        script = self.__dict__.get("_take_script")
        if script is None:
            script = self.__dict__["_take_script"] = self.client.register_script(_TAKE)
        keys = [key, qos.unacked_key, qos.unacked_index_key]
        for item in script(keys=keys, args=[count, time.time()]):
            message = json.loads(item)
            qos.recorded.add(message["properties"]["delivery_tag"])
            self.connection._deliver(message, queue)


class Transport(kombu_redis.Transport):
    Channel = Channel
