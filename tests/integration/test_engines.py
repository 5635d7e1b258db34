"""The workers' engine pings a pooled connection only when it sat idle; on both engines a
connection whose server process ended while it sat in the pool is replaced, not handed out,
and without a round trip when Postgres said so on the socket (``_gone``)."""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import Engine, text

from broker.db.engines import PING_IF_IDLE_S, async_engine, sync_engine
from broker.settings import Settings


def _backend_pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_a_connection_back_in_the_pool_is_reused_without_reconnecting(settings: Settings) -> None:
    engine = sync_engine(settings)
    try:
        first = _backend_pid(engine)
        assert {_backend_pid(engine) for _ in range(20)} == {first}
        time.sleep(PING_IF_IDLE_S + 0.2)  # pinged this time, and alive: still the same one
        assert _backend_pid(engine) == first
    finally:
        engine.dispose()


def _end(killer: Engine, pid: int) -> None:
    with killer.begin() as conn:
        conn.execute(text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid})


def test_a_connection_ended_in_the_pool_is_replaced_at_checkout_without_a_ping(
    settings: Settings,
) -> None:
    """Within the idle second no ping is sent: Postgres's last word on the socket tells."""
    engine, killer = sync_engine(settings), sync_engine(settings)
    try:
        first = _backend_pid(engine)
        _end(killer, first)
        assert _backend_pid(engine) != first
    finally:
        engine.dispose()
        killer.dispose()


def test_the_apis_engine_replaces_a_connection_ended_in_the_pool(settings: Settings) -> None:
    """The API sends no ping: the request after a Postgres restart is answered, not 503."""
    killer = sync_engine(settings)

    async def steps() -> tuple[int, int]:
        engine = async_engine(settings, pool_size=1)
        try:
            async with engine.connect() as conn:
                first = int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())
            await asyncio.to_thread(_end, killer, first)
            async with engine.connect() as conn:
                after = int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())
            return first, after
        finally:
            await engine.dispose()

    try:
        first, after = asyncio.run(steps())
    finally:
        killer.dispose()
    assert after != first
