"""``bench.remote.held_aside``: a tenant's queued messages out of their queue while bridges
start, and back in one step, in their order, on real Postgres and Redis."""

from __future__ import annotations

import pytest
import redis
from sqlalchemy import Engine

from bench.remote import held_aside
from broker.tasks.dispatch import BEHIND, redis_list
from reach.localservices import libpq_url
from tests.integration.rows import a_task_row

TENANT = "bench-held-aside"


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def test_the_queue_is_empty_inside_and_whole_again_after(
    engine: Engine, database_url: str, redis_url: str, client: redis.Redis
) -> None:
    # Given three tasks queued in one queue, one of them behind the other tenants' (a list of
    # its own), and another tenant's message in the same queue
    queue = "bench.aside"
    for _ in range(3):
        a_task_row(engine, tenant=TENANT, capability=queue)
    first, behind = redis_list(queue), redis_list(queue, BEHIND)
    client.delete(first, behind)
    client.lpush(first, b"m1", b"m2")
    client.lpush(behind, b"m3")
    # When they are held aside
    with held_aside(libpq_url(database_url), redis_url, TENANT, 3):
        # Then the queue holds nothing a bridge could take meanwhile
        assert client.llen(first) == client.llen(behind) == 0
    # And afterwards every message is back in its list, in its order
    assert client.lrange(first, 0, -1) == [b"m2", b"m1"]
    assert client.lrange(behind, 0, -1) == [b"m3"]
    client.delete(first, behind)


def one_queued(engine: Engine, client: redis.Redis, queue: str, message: bytes) -> str:
    """``queue`` holding one task's message, its row in Postgres."""
    a_task_row(engine, tenant=TENANT, capability=queue)
    client.delete(queue)
    client.lpush(queue, message)
    return queue


def test_a_count_other_than_the_accepted_fails_and_gives_the_messages_back(
    engine: Engine, database_url: str, redis_url: str, client: redis.Redis
) -> None:
    queue = one_queued(engine, client, "bench.aside-short", b"only")
    aside = held_aside(libpq_url(database_url), redis_url, TENANT, 2)
    with pytest.raises(RuntimeError, match="1 messages held aside of 2 accepted"), aside:
        pass
    assert client.lrange(queue, 0, -1) == [b"only"]
    client.delete(queue)


def test_a_queue_filled_meanwhile_is_not_overwritten(
    engine: Engine, database_url: str, redis_url: str, client: redis.Redis
) -> None:
    queue = one_queued(engine, client, "bench.aside-filled", b"held")
    aside = held_aside(libpq_url(database_url), redis_url, TENANT, 1)
    with pytest.raises(RuntimeError, match="was not empty"), aside:
        client.lpush(queue, b"new")  # a message that came while the bridges started
    assert client.lrange(queue, 0, -1) == [b"new"]
    client.delete(queue, f"bench:aside:{queue}")
