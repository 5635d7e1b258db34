"""A cancel request that reaches Postgres after its statement ended cancels nothing else: a
statement that finished as its deadline passed gives up its connection
(``LoopConnection._drop``), so the request, when it lands, finds that backend gone, not the
next statement.

Before, the connection was kept and the next statement on it was cancelled now and then (4
in 400 statements that ended at their deadline, in a review): a tenant's figure read failed
with ``QueryCanceled``, answered as an outage (503), though Postgres had answered at once.
Here a loopback proxy the test owns makes that lateness certain: it takes a cancel request,
tells the client it was sent, and delivers it only when the test says: once the statement
has ended and the next one is running.
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import literal_column, make_url, select
from sqlalchemy.sql import func

from broker.db.engines import LoopConnection
from broker.settings import Settings
from tests.integration.test_api_outages import CuttableProxy
from tests.integration.test_lost_replies import pipe

CANCEL_REQUEST_CODE = 80877102  # the protocol's CancelRequest
# The first statement passes its deadline and ends before its cancel request lands; the next
# is running when it does: it is seen running, then the request is delivered and has landed
# (Postgres acts on it as it reads it), then the next statement ends.
FIRST_SLEEP_S, FIRST_TIMEOUT_S = 0.3, 0.1
NEXT_SLEEP_S = 3.0
HANG_S = 60  # bounds each await; each ends in seconds


class LateCancelProxy(CuttableProxy):
    """TCP to Postgres; a cancel request is taken, its connection closed at once (so the client
    counts it sent), and delivered to Postgres once ``deliver`` is set; ``landed`` is set once
    Postgres has acted on it."""

    def __init__(self, database_url: str) -> None:
        super().__init__(database_url)
        # Plain TCP, so that a cancel request is the first thing its connection sends.
        self.url = (
            make_url(self.url)
            .update_query_dict({"sslmode": "disable"})
            .render_as_string(hide_password=False)
        )
        self.deliver, self.landed = threading.Event(), threading.Event()
        self.delivered = 0  # cancel requests passed on, on the proxy's loop

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        head = await client_r.readexactly(8)
        length, code = struct.unpack("!II", head)
        if code != CANCEL_REQUEST_CODE:
            await self._forward(head, client_r, client_w)
            return
        request = head + await client_r.readexactly(length - 8)
        client_w.close()
        await asyncio.to_thread(self.deliver.wait, HANG_S)
        pg_r, pg_w = await asyncio.open_connection(*self.upstream)
        pg_w.write(request)
        await pg_w.drain()
        await pg_r.read()  # Postgres closes it once it has acted on the request
        pg_w.close()
        self.delivered += 1
        self.landed.set()

    async def _forward(
        self, head: bytes, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        pg_r, pg_w = await asyncio.open_connection(*self.upstream)
        pg_w.write(head)

        await asyncio.gather(pipe(client_r, pg_w), pipe(pg_r, client_w))


@pytest.fixture
def proxy(settings: Settings) -> Iterator[LateCancelProxy]:
    with LateCancelProxy(settings.database_url) as proxy:
        yield proxy


def sleeping(seconds: float) -> Any:
    return select(func.pg_sleep(seconds), literal_column("pg_backend_pid()"))


def test_a_cancel_request_landing_after_its_statement_ended_cancels_nothing_else(
    proxy: LateCancelProxy, settings: Settings
) -> None:
    async def scenario() -> tuple[Any, Any, int]:
        db = LoopConnection(proxy.url)
        try:
            # Given a statement that passes its deadline (its cancel request goes out, and the
            # proxy holds it) and ends before the request lands
            first = await asyncio.wait_for(
                db.execute(sleeping(FIRST_SLEEP_S), {}, timeout_s=FIRST_TIMEOUT_S), HANG_S
            )
            # When the request lands while the next statement runs
            following_run = asyncio.create_task(db.execute(sleeping(NEXT_SLEEP_S), {}))
            await asyncio.wait_for(asyncio.to_thread(sleep_seen, settings), HANG_S)
            proxy.deliver.set()
            await asyncio.to_thread(proxy.landed.wait, HANG_S)
            delivered = proxy.delivered
            try:
                following: Any = await asyncio.wait_for(following_run, HANG_S)
            except psycopg.errors.QueryCanceled as exc:
                following = exc
            return first, following, delivered
        finally:
            proxy.deliver.set()
            await asyncio.wait_for(db.close(), HANG_S)

    first, following, delivered = asyncio.run(scenario())

    assert len(first) == 1  # it ended with its row, its deadline passed meanwhile
    assert delivered == 1  # the request landed while the next statement ran
    # Then the next statement is not cancelled by it
    assert not isinstance(following, BaseException), following


def sleep_seen(settings: Settings) -> None:
    """Until a statement sleeping ``NEXT_SLEEP_S`` runs in the test's database."""
    url = make_url(settings.database_url).set(drivername="postgresql")
    with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as conn:
        while True:
            running = conn.execute(
                "select count(*) from pg_stat_activity where datname = current_database()"
                " and state = 'active' and query like '%pg_sleep%' and pid <> pg_backend_pid()"
            ).fetchone()
            if running is not None and running[0]:
                return
            time.sleep(0.02)
