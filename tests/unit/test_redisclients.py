"""The broker's Redis connections skip redis-py's ``CLIENT SETINFO`` announcement, and with it
the package-metadata read redis-py makes for every new connection (``broker.redisclients``)."""

from __future__ import annotations

import asyncio

from kombu import Connection

from broker import redisclients

URL = "redis://127.0.0.1:6379/15"  # the transport's channel pings it; the clients send nothing


def test_the_clients_connections_have_no_driver_info() -> None:
    sync = redisclients.sync_client(URL)
    assert sync.connection_pool.make_connection().driver_info is None

    async def made() -> object:
        client = redisclients.async_client(URL)
        pool = redisclients.async_blocking_pool(URL, max_connections=2)
        return (
            client.connection_pool.make_connection().driver_info,
            pool.make_connection().driver_info,
        )

    assert asyncio.run(made()) == (None, None)


def test_a_redis_py_default_connection_would_announce_itself() -> None:
    """What the factories turn off is on by default (so the test above can fail)."""
    import redis

    assert redis.Redis.from_url(URL).connection_pool.make_connection().driver_info is not None


def test_the_workers_kombu_transport_connects_quietly() -> None:
    with Connection(URL, transport="workers.transport:Transport") as connection:
        channel = connection.default_channel
        assert channel._connparams()["driver_info"] is None
        assert channel._connparams(asynchronous=True)["driver_info"] is None
