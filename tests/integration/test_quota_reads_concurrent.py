"""Tenants whose byte figures are due together: their reads share one psycopg connection of
the API's own (``PostgresHeld`` on a ``LoopConnection``).

Two coroutines on one connection interleaved their statements, and each one's look for a
connection gone (``_gone``) read the other's reply as the server's last word and closed the
connection under it: 500s ("connection pointer is NULL"), a read that never returned (and so
every new tenant's first submit waited for it), and libpq crashing the API process. Here many
tenants' first submits go in at once through the real API, round after round; the connection
takes many statements at once; and a read that Postgres does not answer fails as an outage
does, 503, instead of holding every submit behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import httpx
import psycopg
import pytest
from sqlalchemy import Connection, Engine, Integer, bindparam, insert, text

from broker.db.engines import LoopConnection
from broker.db.models import tenant_usage_table
from broker.settings import Settings
from broker.tenancy.usage import PostgresHeld
from tests.integration.conftest import KeyMaker, client_for
from tests.integration.stack import ServedApp
from tests.integration.test_tenant_quota import quota_app

TENANTS = 20
ROUNDS = 5
HANG_S = 60  # bounds a hang of the old code; the reads here take milliseconds
ENVELOPE = {"capability": "test.nobody", "payload": {}, "queue_if_unavailable": True}
T = TypeVar("T")


def bounded(work: Awaitable[T]) -> T:
    """Run ``work`` on a loop of its own; a hang fails the test instead of holding the run."""

    async def run() -> T:
        return await asyncio.wait_for(work, HANG_S)

    return asyncio.run(run())


async def first_submits(url: str, tokens: list[str]) -> list[int | str]:
    """Each token's tenant submits once, all at the same moment: its status, or what failed."""
    async with httpx.AsyncClient(base_url=url, timeout=HANG_S) as http:

        async def one(token: str) -> int | str:
            headers = {"Authorization": f"Bearer {token}"}
            try:
                return (await http.post("/tasks", json=ENVELOPE, headers=headers)).status_code
            except httpx.HTTPError as exc:
                return type(exc).__name__

        return list(await asyncio.gather(*(one(token) for token in tokens)))


def test_many_fresh_tenants_submitting_at_once_all_get_in_round_after_round(
    settings: Settings, make_key: KeyMaker
) -> None:
    # Every submit reads its tenant's figure (no figure is trusted for a while), so every
    # round's twenty reads are out together.
    app = quota_app(settings, tenant_max_held_bytes=10**9)
    with ServedApp(app) as served:
        for round_ in range(ROUNDS):
            tokens = [make_key()[1] for _ in range(TENANTS)]
            answers = asyncio.run(first_submits(served.url, tokens))
            assert answers == [202] * TENANTS, f"round {round_}: {answers}"
        assert served.thread.is_alive()
        with client_for(served, make_key()[1]) as http:
            assert http.post("/tasks", json=ENVELOPE).status_code == 202


ECHO = text("SELECT CAST(:n AS integer) AS n").bindparams(bindparam("n", type_=Integer))


def test_given_many_callers_running_statements_on_one_loop_connection_expect_their_own_answers(
    settings: Settings,
) -> None:
    # Each coroutine's next statement goes out while the others' replies are on the way: the
    # moment the old look for a connection gone closed it under them.
    async def statements_of(db: LoopConnection, caller: int) -> list[int]:
        return [(await db.execute(ECHO, {"n": caller * 100 + i}))[0]["n"] for i in range(10)]

    async def callers() -> list[list[int]]:
        db = LoopConnection(settings.database_url)
        try:
            return list(await asyncio.gather(*(statements_of(db, c) for c in range(TENANTS))))
        finally:
            await db.close()

    assert bounded(callers()) == [[c * 100 + i for i in range(10)] for c in range(TENANTS)]


@pytest.fixture
def figures(engine: Engine) -> Iterator[dict[str, int]]:
    """Tenants with known bytes held (one shard each, as the triggers would have written),
    and one that holds nothing."""
    known = {f"concurrent-held-{i}": 1000 + i for i in range(TENANTS)}
    with engine.begin() as conn:
        conn.execute(
            insert(tenant_usage_table),
            [{"tenant": tenant, "shard": 0, "bytes": n} for tenant, n in known.items()],
        )
    yield {**known, "concurrent-held-none": 0}
    with engine.begin() as conn:
        conn.execute(
            tenant_usage_table.delete().where(tenant_usage_table.c.tenant.in_(list(known)))
        )


def test_given_many_tenants_read_at_once_expect_each_its_own_figure(
    settings: Settings, figures: dict[str, int]
) -> None:
    async def reads_of(held: PostgresHeld, tenant: str) -> list[int]:
        return [await held(tenant) for _ in range(ROUNDS)]

    async def readers() -> dict[str, list[int]]:
        held = PostgresHeld(settings.database_url)
        try:
            read = await asyncio.gather(*(reads_of(held, tenant) for tenant in figures))
            return dict(zip(figures, read, strict=True))
        finally:
            await held.close()

    assert bounded(readers()) == {tenant: [n] * ROUNDS for tenant, n in figures.items()}


@contextmanager
def usage_locked(engine: Engine) -> Iterator[Connection]:
    """``tenant_usage`` locked by another transaction: a read of it waits for as long as this
    holds, as it would on a Postgres that stopped answering."""
    with engine.connect() as conn, conn.begin():
        conn.execute(text("LOCK TABLE tenant_usage IN ACCESS EXCLUSIVE MODE"))
        yield conn


def test_given_postgres_not_answering_a_figure_read_fails_as_an_outage_and_the_next_answers(
    settings: Settings, engine: Engine, figures: dict[str, int]
) -> None:
    held = PostgresHeld(settings.database_url)
    held.timeout_s = 0.5
    tenant = next(iter(figures))

    async def read() -> Any:
        try:
            return await held(tenant)
        except psycopg.OperationalError as exc:
            return exc

    async def close() -> None:
        await held.close()

    with asyncio.Runner() as runner:  # one loop, as the API's: the connection is kept
        with usage_locked(engine):
            failed = runner.run(asyncio.wait_for(read(), HANG_S))
        assert isinstance(failed, psycopg.OperationalError), failed
        assert runner.run(asyncio.wait_for(read(), HANG_S)) == figures[tenant]
        runner.run(close())


def test_given_postgres_not_answering_a_fresh_tenants_submit_gets_503_then_gets_in(
    settings: Settings, engine: Engine, make_key: KeyMaker
) -> None:
    app = quota_app(settings, tenant_max_held_bytes=10**9)
    app.state.services.intake.quota.rows.held.timeout_s = 0.5
    with ServedApp(app) as served, client_for(served, make_key()[1]) as http:
        with usage_locked(engine):
            refused = http.post("/tasks", json=ENVELOPE)
        assert refused.status_code == 503, refused.text
        assert refused.json()["code"] == "service_unavailable"
        assert http.post("/tasks", json=ENVELOPE).status_code == 202
