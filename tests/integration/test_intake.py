"""The workers' Redis transport (``workers.transport``) against the real Redis: messages come
in batches, never past the prefetch limit, each recorded as unacked exactly as kombu records
one, so acks, and restores of what was never acked, work as they always did."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub

QUEUE = Queue("intake.test", Exchange("intake.test", type="direct"), routing_key="intake.test")
TRANSPORT = "workers.transport:Transport"


def publish(url: str, count: int) -> None:
    with Connection(url) as conn:
        producer = Producer(conn.channel())
        for n in range(count):
            producer.publish(
                {"n": n},
                exchange=QUEUE.exchange,
                routing_key="intake.test",
                declare=[QUEUE],
                serializer="json",
            )


@contextmanager
def consuming(url: str, prefetch: int) -> Iterator[tuple[Any, list[Any]]]:
    """A consumer with our transport and ``prefetch``, keeping what it gets unacked."""
    received: list[Any] = []
    with Connection(url, transport=TRANSPORT) as conn:
        channel = conn.channel()
        channel.basic_qos(0, prefetch, False)
        with Consumer(channel, [QUEUE], callbacks=[lambda _, m: received.append(m)]):
            for _ in range(1000):  # until nothing more comes
                try:
                    conn.drain_events(timeout=0.3)
                except TimeoutError:
                    break
            yield channel, received


@contextmanager
def turning(channel: Any) -> Iterator[Hub]:
    """A hub the channel's transport is registered with, as Celery's consumer registers it
    (the hub's loop then runs on this thread)."""
    hub = Hub()
    transport = channel.connection
    transport.register_with_event_loop(transport, hub)
    try:
        yield hub
    finally:
        hub.close()


def test_a_batch_takes_no_more_than_the_free_slots_and_records_each_as_kombu_would(
    own_redis: str,
) -> None:
    publish(own_redis, 50)
    client = redis.Redis.from_url(own_redis)
    with consuming(own_redis, prefetch=10) as (channel, received):
        # exactly the prefetch limit came, in order, the rest still queued
        assert [m.payload["n"] for m in received] == list(range(10))
        assert client.llen("intake.test") == 40
        # each one recorded as unacked, as kombu's QoS.append records it
        unacked = client.hgetall(channel.qos.unacked_key)
        assert {tag.decode() for tag in unacked} == {m.delivery_tag for m in received}
        for message in received:
            stored = json.loads(unacked[message.delivery_tag.encode()])
            assert stored == [message._raw, "intake.test", "intake.test"]
        assert client.zcard(channel.qos.unacked_index_key) == 10
        # acked, they leave the unacked records
        for message in received[:4]:
            message.ack()
        assert client.hlen(channel.qos.unacked_key) == 6
    # and the six never acked go back to the queue when the consumer closes
    assert client.llen("intake.test") == 46
    assert client.hlen("unacked") == 0


def brpops(client: redis.Redis) -> int:
    """BRPOP calls the Redis server has answered (every client's: other workers' idle polls
    add about one a second each)."""
    return int(client.info("commandstats").get("cmdstat_brpop", {}).get("calls", 0))


def test_with_room_for_all_every_message_comes_once_in_a_few_round_trips(own_redis: str) -> None:
    publish(own_redis, 200)
    client = redis.Redis.from_url(own_redis)
    before = brpops(client)
    with consuming(own_redis, prefetch=500) as (_, received):
        assert sorted(m.payload["n"] for m in received) == list(range(200))
        for message in received:
            message.ack()
    assert client.hlen("unacked") == 0
    # kombu alone sends one BRPOP a message: 200
    assert brpops(client) - before < 60


def test_acks_share_one_client_instead_of_making_one_per_message(
    own_redis: str, monkeypatch: Any
) -> None:
    """kombu builds a ``redis.Redis`` for each ack; its constructor was a third of a threads
    worker's main thread. Here 100 acks make at most a couple of clients."""
    publish(own_redis, 100)
    made = []
    original = redis.Redis.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(1)
        original(self, *args, **kwargs)

    with consuming(own_redis, prefetch=100) as (channel, received):
        assert len(received) == 100
        monkeypatch.setattr(redis.Redis, "__init__", counting)
        for message in received:
            message.ack()
        monkeypatch.undo()
        assert not redis.Redis.from_url(own_redis).hlen(channel.qos.unacked_key)
    assert len(made) <= 2, len(made)


def test_acks_on_the_hubs_thread_go_out_together_when_the_hub_turns(
    own_redis: str, monkeypatch: Any
) -> None:
    """Given 30 messages acked on the thread of the hub the transport is registered with, I
    expect them still recorded as unacked until the hub's loop turns, then all removed in one
    round trip; and an ack from another thread removed at once, as kombu does."""
    publish(own_redis, 31)
    client = redis.Redis.from_url(own_redis)
    pipelines = []
    original = redis.client.Pipeline.execute

    hub_thread = threading.get_ident()  # the hub turns on this thread below

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == hub_thread:  # not other tests' threads still running
            pipelines.append([(str(c[0][0]), str(c[0][1])) for c in self.command_stack])
        return original(self, *args, **kwargs)

    with consuming(own_redis, prefetch=100) as (channel, received), turning(channel) as hub:
        assert len(received) == 31
        elsewhere = threading.Thread(target=received[30].ack)
        elsewhere.start()
        elsewhere.join()
        assert client.hlen(channel.qos.unacked_key) == 30  # the other thread's, at once

        monkeypatch.setattr(redis.client.Pipeline, "execute", counting)
        for message in received[:30]:
            message.ack()
        assert client.hlen(channel.qos.unacked_key) == 30  # noted, not yet sent
        next(hub.create_loop())  # one turn: the acks go before it polls
        monkeypatch.undo()
        assert client.hlen(channel.qos.unacked_key) == 0
        assert client.zcard(channel.qos.unacked_index_key) == 0
        unacked = [
            p for p in pipelines if ("ZREM", channel.qos.unacked_index_key) in p
        ]  # one ZREM and one HDEL, for all 30
        assert unacked == [
            [("ZREM", channel.qos.unacked_index_key), ("HDEL", channel.qos.unacked_key)]
        ], pipelines


def test_acks_that_free_the_prefetch_limit_are_sent_before_the_next_brpop_is_decided(
    own_redis: str,
) -> None:
    """Given a channel whose prefetch limit is full and whose messages were acked on the
    hub's thread, I expect kombu's poll start (which sends a ``BRPOP`` only while the limit
    has room) to find the acks sent and the room free, whatever order the hub runs its tick
    callbacks in: else the worker waits for its next wake-up with work in the queue."""
    publish(own_redis, 3)
    client = redis.Redis.from_url(own_redis)
    with consuming(own_redis, prefetch=2) as (channel, received), turning(channel):
        assert len(received) == 2
        for message in received:
            message.ack()
        assert not channel.qos.can_consume()  # noted only: the limit looks full
        channel._in_poll = False
        channel.connection.cycle.on_poll_start()  # kombu's tick callback, run first
        assert client.hlen(channel.qos.unacked_key) == 0
        assert channel.qos.can_consume()
        assert channel._in_poll  # it asked Redis for more


def test_acks_not_yet_sent_are_sent_when_the_channel_closes(own_redis: str) -> None:
    """Given acks noted on the hub's thread and a channel closed before the hub turned, I
    expect them sent, not restored to the queue as if never acked."""
    publish(own_redis, 5)
    client = redis.Redis.from_url(own_redis)
    with Connection(own_redis, transport=TRANSPORT) as conn:
        channel = conn.channel()
        channel.basic_qos(0, 10, False)
        received: list[Any] = []
        hub = Hub()
        conn.transport.register_with_event_loop(conn.connection, hub)
        with Consumer(channel, [QUEUE], callbacks=[lambda _, m: received.append(m)]):
            for _ in range(20):
                try:
                    conn.drain_events(timeout=0.3)
                except TimeoutError:
                    break
            assert len(received) == 5
            for message in received:
                message.ack()
            assert client.hlen(channel.qos.unacked_key) == 5
        channel.close()
        hub.close()
    assert client.hlen("unacked") == 0
    assert client.llen("intake.test") == 0


def test_a_delivery_that_fails_puts_back_what_its_batch_took(own_redis: str) -> None:
    """Given five queued messages and a consumer whose first delivery fails, I expect the
    four its batch took back in the list at once, not left unacked until the visibility
    timeout, and all five there again once the consumer closes."""
    publish(own_redis, 5)
    client = redis.Redis.from_url(own_redis)

    def refuse(_: Any, message: Any) -> None:
        raise RuntimeError("delivery failed")

    with Connection(own_redis, transport=TRANSPORT) as conn:
        channel = conn.channel()
        channel.basic_qos(0, 10, False)
        with Consumer(channel, [QUEUE], callbacks=[refuse]):
            with pytest.raises(RuntimeError, match="delivery failed"):
                conn.drain_events(timeout=2)
            assert client.llen("intake.test") == 4
            assert client.hlen(channel.qos.unacked_key) == 1  # the one delivered
    assert client.llen("intake.test") == 5
    assert client.hlen("unacked") == 0
