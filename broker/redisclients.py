"""Redis clients as the broker makes them.

redis-py announces each new connection with ``CLIENT SETINFO`` (its name and version), and
reads its own version from the package metadata for every connection it makes: 0.4 ms of
CPU here, and a round trip before the connection's first command. A pool that grows under
a burst (the API's, a worker's with hundreds of calls in flight) paid both for every
connection. The broker's connections skip that announcement (``driver_info=None``); a
``CLIENT LIST`` still shows the names the broker gives some of them.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis

# The connection keyword that turns the announcement off (redis-py's own default is on).
QUIET: dict[str, Any] = {"driver_info": None}


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    return redis.Redis.from_url(url, **QUIET, **kwargs)


def async_client(url: str, **kwargs: Any) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, **QUIET, **kwargs)


def async_blocking_pool(url: str, **kwargs: Any) -> aioredis.BlockingConnectionPool:
    return aioredis.BlockingConnectionPool.from_url(url, **QUIET, **kwargs)
