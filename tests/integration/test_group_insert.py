"""Group commit of submits, against the real Postgres: rows that arrive together go out in one
statement, each caller still gets its own answer, and one bad row fails only its own caller."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from psycopg import errors as pg_errors
from sqlalchemy import func, literal_column, select
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.db.engines import async_engine
from broker.db.models import tasks_table as tasks
from broker.settings import Settings
from broker.tasks.resource import new_task_id
from broker.tasks.submission import _INSERT, GroupInsert


def _row(tenant: str, **changes: Any) -> dict[str, Any]:
    now = datetime.now(UTC)
    return {
        "id": new_task_id(),
        "tenant": tenant,
        "capability": "echo",
        "queue": "echo",
        "status": "queued",
        "payload": {"n": 1},
        "payload_digest": "0" * 64,
        "payload_size": 7,
        "max_attempts": None,
        "priority": None,
        "trace_id": "1" * 32,
        "session_id": None,
        "source": None,
        "metadata": {},
        "metadata_size": 2,
        "idempotency_key": None,
        "callback": None,
        "result_ttl_s": 600,
        "created_at": now,
        "deadline_at": None,
        "expires_at": now + timedelta(seconds=600),
    } | changes


Body = Callable[[GroupInsert, str], Awaitable[None]]


def _run(settings: Settings, body: Body, max_rows: int = 100) -> None:
    """``body(inserter, tenant)`` on an engine of its own, with a tenant of its own."""
    tenant = f"group-{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        engine = async_engine(settings)
        inserter = GroupInsert(engine, max_rows=max_rows)
        try:
            await body(inserter, tenant)
        finally:
            await inserter.close()
            await engine.dispose()

    asyncio.run(main())


async def _stored(engine: AsyncEngine, tenant: str) -> int:
    async with engine.connect() as conn:
        query = select(func.count()).select_from(tasks).where(tasks.c.tenant == tenant)
        return int((await conn.execute(query)).scalar_one())


async def _transactions(engine: AsyncEngine, tenant: str) -> int:
    """How many transactions wrote the tenant's rows (each statement is one: autocommit)."""
    async with engine.connect() as conn:
        query = select(func.count(literal_column("xmin::text").distinct())).where(
            tasks.c.tenant == tenant
        )
        return int((await conn.execute(query)).scalar_one())


def test_rows_arriving_together_go_out_in_fewer_statements(settings: Settings) -> None:
    async def body(inserter: GroupInsert, tenant: str) -> None:
        answers = await asyncio.gather(*(inserter.insert(_row(tenant)) for _ in range(60)))
        assert answers == [True] * 60
        # All 60 were waiting before the flusher first ran: one statement for the lot.
        assert await _transactions(inserter.engine, tenant) == 1
        assert await _stored(inserter.engine, tenant) == 60

    _run(settings, body)


def test_one_idempotency_key_twice_in_one_group_inserts_once(settings: Settings) -> None:
    async def body(inserter: GroupInsert, tenant: str) -> None:
        rows = [_row(tenant)] + [_row(tenant, idempotency_key="k-1") for _ in range(2)]
        answers = await asyncio.gather(*(inserter.insert(row) for row in rows))
        assert answers[0] is True
        assert sorted(answers[1:]) == [False, True]
        assert await _stored(inserter.engine, tenant) == 2

    _run(settings, body)


@pytest.mark.parametrize(
    ("bad", "refusal"),
    [
        # the status CHECK constraint refuses it
        ({"status": "not-a-status"}, pg_errors.CheckViolation),
        # too long for its column: refused, never cut short
        ({"source": "s" * 129}, pg_errors.StringDataRightTruncation),
    ],
)
def test_a_bad_row_fails_only_its_own_caller(
    settings: Settings, bad: dict[str, Any], refusal: type[Exception]
) -> None:
    async def body(inserter: GroupInsert, tenant: str) -> None:
        rows = [_row(tenant) for _ in range(6)]
        rows[3].update(bad)
        answers = await asyncio.gather(
            *(inserter.insert(row) for row in rows), return_exceptions=True
        )
        assert [a for i, a in enumerate(answers) if i != 3] == [True] * 5
        assert isinstance(answers[3], refusal), repr(answers[3])
        assert await _stored(inserter.engine, tenant) == 5

    _run(settings, body)


def test_a_cancelled_caller_does_not_stop_the_others(settings: Settings) -> None:
    async def body(inserter: GroupInsert, tenant: str) -> None:
        calls = [asyncio.ensure_future(inserter.insert(_row(tenant))) for _ in range(10)]
        await asyncio.sleep(0)
        calls[5].cancel()
        done = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(done[5], asyncio.CancelledError)
        assert [a for i, a in enumerate(done) if i != 5] == [True] * 9
        # The cancelled caller's row may or may not have gone in; the others all did.
        assert await _stored(inserter.engine, tenant) in (9, 10)

    _run(settings, body)


@pytest.mark.parametrize("rows", [1, 250])
def test_every_caller_is_answered_whatever_the_group_size(settings: Settings, rows: int) -> None:
    async def body(inserter: GroupInsert, tenant: str) -> None:
        answers = await asyncio.gather(*(inserter.insert(_row(tenant)) for _ in range(rows)))
        assert answers == [True] * rows
        assert await _stored(inserter.engine, tenant) == rows
        # Groups of at most 100 rows: 100, 100 and 50.
        assert await _transactions(inserter.engine, tenant) == -(-rows // 100)

    _run(settings, body)


def test_a_row_goes_in_as_sqlalchemys_insert_writes_it(settings: Settings) -> None:
    """The group's INSERT goes out on psycopg alone (``LoopConnection``): the same row, JSON
    nulls included, as SQLAlchemy's own insert of the same values."""

    async def body(inserter: GroupInsert, tenant: str) -> None:
        # A deadline to come: one passed had the sweeper end the task while the test read it
        deadline = datetime.now(UTC) + timedelta(hours=1)
        changes = {"payload": None, "callback": None, "deadline_at": deadline}
        ours, theirs = _row(tenant, **changes), _row(tenant, **changes)
        assert await inserter.insert(ours) is True
        async with inserter.engine.connect() as conn:
            await conn.execute(_INSERT, [theirs])
            await conn.commit()
            rows = {
                r["id"]: r
                for r in (await conn.execute(select(tasks).where(tasks.c.tenant == tenant)))
                .mappings()
                .all()
            }
            null_kinds = select(
                tasks.c.id, func.jsonb_typeof(tasks.c.payload), func.jsonb_typeof(tasks.c.callback)
            ).where(tasks.c.tenant == tenant)
            kinds = {r[0]: tuple(r[1:]) for r in await conn.execute(null_kinds)}
        own = {"id", "created_at", "deadline_at", "expires_at"}
        mine, sqlalchemys = rows[ours["id"]], rows[theirs["id"]]
        assert {k: v for k, v in mine.items() if k not in own} == {
            k: v for k, v in sqlalchemys.items() if k not in own
        }
        assert mine["deadline_at"] == ours["deadline_at"]
        assert kinds[ours["id"]] == kinds[theirs["id"]] == ("null", "null")

    _run(settings, body)
