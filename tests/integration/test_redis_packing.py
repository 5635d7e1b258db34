"""The broker's asyncio Redis connections pack commands with hiredis, as redis-py's sync ones
do (``broker.redisclients``): what they send arrives as sent."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import DataError

from broker import redisclients

ECHO = "return ARGV"


def test_an_asyncio_client_packs_with_hiredis_and_its_arguments_arrive_as_sent(
    redis_url: str,
) -> None:
    async def sent() -> tuple[str, list[bytes]]:
        client = redisclients.async_client(redis_url)
        try:
            args = ["é ✓", b"\x00\xff", 42, 1.5, 1796214317.3990417, memoryview(b"mv"), -(2**70)]
            kind = client.connection_pool.connection_class.__name__
            return kind, await client.eval(ECHO, 0, *args)
        finally:
            await client.aclose()

    kind, echoed = asyncio.run(sent())
    assert kind.startswith("Hiredis")
    assert echoed == [
        "é ✓".encode(),
        b"\x00\xff",
        b"42",
        b"1.5",
        b"1796214317.3990417",
        b"mv",
        str(-(2**70)).encode(),
    ]


def test_a_blocking_pool_packs_with_hiredis_and_refuses_what_is_not_a_value(
    redis_url: str,
) -> None:
    async def refused() -> None:
        pool = redisclients.async_blocking_pool(redis_url, max_connections=2)
        client = redisclients.aioredis.Redis(connection_pool=pool)
        try:
            assert pool.connection_class.__name__.startswith("Hiredis")
            with pytest.raises(DataError):
                await client.set("reach-test-packing", None)  # type: ignore[arg-type]
            assert await client.ping()
        finally:
            await client.aclose()

    asyncio.run(refused())
