"""A tenant's figure read gives up after its own timeout (``PostgresHeld``, ``READ_TIMEOUT_S``)
when Postgres says nothing at all, as behind a partition: here a loopback proxy the test owns
stops passing bytes either way.

Before, the statement in flight ended only when psycopg gave up on it: its timeout, then 5 s
for a cancel request that could not get through and 5 s more for the statement, the
connection held meanwhile. The reads grouped behind it waited under no timeout of their own
until then (with a 2 s timeout, reads begun at 0, 0.5, 3 and 6 s failed after 12, 13.5, 11
and 8 s), and a fresh tenant's first submit with them. A statement blocked by a lock, Postgres
answering, is cancelled on the server and its connection kept, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, insert, text

from broker.db.models import tenant_usage_table
from broker.settings import Settings
from broker.tenancy.usage import PostgresHeld
from tests.integration.test_api_outages import CuttableProxy
from tests.integration.test_lost_replies import pipe

TIMEOUT_S = 1.0
# The contract is "gives up after its timeout"; a read still waiting at this bound has not
# given up (before, each took 10 s past its timeout and more). Not a measure of speed.
GAVE_UP_BY_S = 5.0
HANG_S = 60  # bounds the waits for facts; each holds in milliseconds
# Reads begun at these moments while Postgres is silent: alone, queued behind the first
# statement, while that statement's cancel request goes unanswered, and behind the next
# statement, which is opening a connection that Postgres never answers.
STARTS_S = (0.0, 0.5, 1.3, 2.5)
STILL_WAITING = "still waiting"
TENANT = "silent-held-0"
HELD = 4321


class FreezingProxy(CuttableProxy):
    """TCP to Postgres; while frozen nothing passes either way and a new connection is taken
    but gets no word, as behind a partition. Thawed, what it held goes on."""

    def __init__(self, database_url: str) -> None:
        super().__init__(database_url)
        self.flowing = asyncio.Event()  # the proxy loop's
        self.flowing.set()

    def freeze(self) -> None:
        self._on_proxy_loop(self.flowing.clear)

    def thaw(self) -> None:
        self._on_proxy_loop(self.flowing.set)

    def _on_proxy_loop(self, change: Callable[[], None]) -> None:
        async def run() -> None:
            change()

        asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        await self.flowing.wait()
        pg_r, pg_w = await asyncio.open_connection(*self.upstream)

        async def when_flowing(data: bytes) -> bytes:
            await self.flowing.wait()
            return data

        await asyncio.gather(pipe(client_r, pg_w, when_flowing), pipe(pg_r, client_w, when_flowing))


@pytest.fixture
def proxy(settings: Settings) -> Iterator[FreezingProxy]:
    with FreezingProxy(settings.database_url) as proxy:
        yield proxy
        proxy.thaw()


@pytest.fixture
def held_bytes(engine: Engine) -> Iterator[int]:
    """``TENANT`` holds ``HELD`` bytes (one shard, as the triggers would have written)."""
    with engine.begin() as conn:
        conn.execute(insert(tenant_usage_table), [{"tenant": TENANT, "shard": 0, "bytes": HELD}])
    yield HELD
    with engine.begin() as conn:
        conn.execute(tenant_usage_table.delete().where(tenant_usage_table.c.tenant == TENANT))


async def outcome(read: Awaitable[int], bound_s: float = GAVE_UP_BY_S) -> Any:
    """What ``read`` gave: its figure, what it raised, or ``STILL_WAITING`` at ``bound_s``."""
    try:
        return await asyncio.wait_for(read, bound_s)
    except TimeoutError:
        return STILL_WAITING
    except psycopg.OperationalError as exc:
        return exc


def test_given_postgres_silent_each_figure_read_gives_up_after_its_timeout_and_the_next_answers(
    settings: Settings, proxy: FreezingProxy, held_bytes: int
) -> None:
    async def read_at(held: PostgresHeld, start_s: float, tenant: str) -> Any:
        await asyncio.sleep(start_s)
        return await outcome(held(tenant))

    async def scenario() -> tuple[int, list[Any], Any]:
        held = PostgresHeld(proxy.url, timeout_s=TIMEOUT_S)
        try:
            warm = await outcome(held(TENANT), HANG_S)
            proxy.freeze()
            silent = await asyncio.gather(
                *(read_at(held, start, f"silent-held-new-{i}") for i, start in enumerate(STARTS_S))
            )
            proxy.thaw()
            return warm, silent, await outcome(held(TENANT), HANG_S)
        finally:
            await asyncio.wait_for(held.close(), HANG_S)

    warm, silent, thawed = asyncio.run(scenario())

    assert warm == held_bytes
    assert [type(r) for r in silent] == [psycopg.OperationalError] * len(STARTS_S), silent
    assert thawed == held_bytes


async def backend_state(engine: Engine, pid: int) -> Any:
    def look() -> Any:
        with engine.connect() as conn:
            return conn.execute(
                text("SELECT state, wait_event_type FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": pid},
            ).one()

    return tuple(await asyncio.to_thread(look))


def test_given_a_figure_read_blocked_by_a_lock_its_statement_is_cancelled_and_its_connection_kept(
    settings: Settings, engine: Engine, held_bytes: int
) -> None:
    async def scenario() -> tuple[Any, Any, Any, int, int]:
        held = PostgresHeld(settings.database_url, timeout_s=TIMEOUT_S)
        try:
            assert await outcome(held(TENANT), HANG_S) == held_bytes
            pid = held._db._connection.info.backend_pid
            with engine.connect() as blocker, blocker.begin():
                blocker.execute(text("LOCK TABLE tenant_usage IN ACCESS EXCLUSIVE MODE"))
                blocked = await outcome(held(TENANT), HANG_S)
                # Cancelled on the server: the backend waits for the lock no more, idle.
                deadline = asyncio.get_running_loop().time() + HANG_S
                while (state := await backend_state(engine, pid)) != ("idle", "Client"):
                    assert asyncio.get_running_loop().time() < deadline, state
                    await asyncio.sleep(0.05)
            after = await outcome(held(TENANT), HANG_S)
            return blocked, state, after, pid, held._db._connection.info.backend_pid
        finally:
            await held.close()

    blocked, state, after, pid, pid_after = asyncio.run(scenario())

    assert isinstance(blocked, psycopg.OperationalError), blocked
    assert state == ("idle", "Client")
    assert after == held_bytes
    assert pid_after == pid  # the same connection answered
