"""A worker's claims and finishes go out on psycopg connections of their own, without
SQLAlchemy's layers: ``LoopConnection`` for an event loop's, ``ThreadConnection`` for a
threads or prefork worker's. Each gives what the engine gives, and each survives its backend
ending, as a Postgres restart ends it."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from psycopg.adapt import PyFormat
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb
from sqlalchemy import (
    Engine,
    Text,
    bindparam,
    cast,
    column,
    func,
    literal_column,
    select,
    table,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import JSON
from sqlalchemy.sql import ClauseElement

from broker.db.engines import LoopConnection, ThreadConnection
from broker.outages import INFRASTRUCTURE_ERRORS
from broker.settings import Settings
from broker.tasks import execution
from broker.tasks.resource import task_error
from tests.eventually import eventually
from tests.integration.rows import a_task_row

TENANT = "own-connections"
BACKEND = select(func.pg_backend_pid().label("pid"))


class Own:
    """Either kind behind one sync face: a loop connection runs on a loop of the test's own,
    kept across calls, as a worker's loop keeps its."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind = kind
        self._runner = asyncio.Runner() if kind == "loop" else None
        self._loop_conn = LoopConnection(url) if kind == "loop" else None
        self._thread_conn = ThreadConnection(url) if kind == "thread" else None

    def execute(self, statement: ClauseElement, params: dict[str, Any]) -> list[DictRow]:
        if self._runner is not None and self._loop_conn is not None:
            return self._runner.run(self._loop_conn.execute(statement, params))
        assert self._thread_conn is not None
        return self._thread_conn.execute(statement, params)

    def claim_many(self, claims: list[execution.Claim]) -> list[execution.Claimed | None]:
        if self._runner is not None and self._loop_conn is not None:
            return self._runner.run(execution.claim_many_async(self._loop_conn, claims))
        assert self._thread_conn is not None
        return execution.claim_many(self._thread_conn, claims)

    def finish_many(self, finishes: list[execution.Finish]) -> list[Any]:
        if self._runner is not None and self._loop_conn is not None:
            return self._runner.run(execution.finish_many_async(self._loop_conn, finishes))
        assert self._thread_conn is not None
        return execution.finish_many(self._thread_conn, finishes)

    def written(self, value: Any) -> bytes:
        """What this connection sends for a JSONB parameter (its JSON binds go out as JSONB)."""
        own = self._loop_conn or self._thread_conn
        assert own is not None and own._connection is not None
        connection = own._connection
        dumper = connection.adapters.get_dumper(Jsonb, PyFormat.TEXT)(Jsonb, connection)
        return bytes(dumper.dump(Jsonb(value)))

    def pid(self) -> int:
        return int(self.execute(BACKEND, {})[0]["pid"])

    def close(self) -> None:
        if self._runner is not None and self._loop_conn is not None:
            self._runner.run(self._loop_conn.close())
            self._runner.close()
        elif self._thread_conn is not None:
            self._thread_conn.close()


@pytest.fixture(params=["loop", "thread"])
def own(request: pytest.FixtureRequest, settings: Settings) -> Iterator[Own]:
    conn = Own(request.param, settings.database_url)
    yield conn
    conn.close()


# A JSON parameter as Postgres got it (the json type keeps the text as sent), and a JSONB value
# holding an integer beyond 64 bits, read back.
AS_SENT = select(
    cast(bindparam("doc", type_=JSON), Text).label("sent"),
    literal_column("'{\"n\": 123456789012345678901234567890}'::jsonb").label("big"),
)
BIG = {"n": 123456789012345678901234567890}
COMPACT = '{"a":[1,"é"]}'  # the codec's (broker.jsoncodec); psycopg's own: {"a": [1, "\\u00e9"]}


def test_json_goes_out_through_the_codec_and_comes_back_exact(engine: Engine, own: Own) -> None:
    doc = {"a": [1, "é"]}
    with engine.connect() as conn:
        assert dict(conn.execute(AS_SENT, {"doc": doc}).mappings().one()) == {
            "sent": COMPACT,
            "big": BIG,
        }
    assert own.execute(AS_SENT, {"doc": doc})[0]["big"] == BIG
    assert own.written(doc) == COMPACT.encode()


def end_backend(engine: Engine, pid: int) -> None:
    """What a Postgres restart does to a connection: its backend ends (and is gone when this
    returns)."""
    with engine.connect() as admin:
        ended = admin.execute(text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid})
        assert ended.scalar_one() is True


def test_rows_come_back_only_from_a_statement_that_returns_them(engine: Engine, own: Own) -> None:
    task_id = a_task_row(engine, tenant=TENANT)
    tasks = table("tasks", column("id"), column("attempts"))
    bump = update(tasks).where(tasks.c.id == bindparam("tid")).values(attempts=tasks.c.attempts + 1)
    assert own.execute(bump, {"tid": task_id}) == []  # no RETURNING: no rows, not an error
    returning = bump.returning(tasks.c.attempts)
    assert own.execute(returning, {"tid": uuid.uuid4()}) == []  # RETURNING, nothing matched
    assert own.execute(returning, {"tid": task_id}) == [{"attempts": 2}]


def test_given_claims_and_finishes_on_an_own_connection_expect_what_the_engine_gives(
    engine: Engine, own: Own
) -> None:
    deadline_at = datetime.now(UTC) + timedelta(minutes=5)
    payload = {"text": "é", "n": [1, 2.5, None]}
    ids = [
        a_task_row(engine, tenant=TENANT, payload=payload, deadline_at=deadline_at)
        for _ in range(4)
    ]
    by_engine, on_own = ids[:2], ids[2:]

    def claims(of: list[uuid.UUID]) -> list[execution.Claim]:
        return [execution.Claim(t, "agent", "1", "node", durable=False) for t in of]

    def finishes(of: list[uuid.UUID]) -> list[execution.Finish]:
        return [
            execution.Finish.succeeded(of[0], {"answer": ["é", 1]}),
            execution.Finish.failed(of[1], task_error("boom", "it broke"), attempt=1),
        ]

    claimed_by_engine = execution.claim_many(engine, claims(by_engine))
    finished_by_engine = execution.finish_many(engine, finishes(by_engine))
    claimed_on_own = own.claim_many(claims(on_own))
    finished_on_own = own.finish_many(finishes(on_own))

    moments = {"id", "task_id", "trace_id", "created_at", "started_at", "finished_at", "expires_at"}

    def same_but_own(a: Any, b: Any) -> None:
        """The same keys and types; the same values but each task's own and its moments."""
        a, b = dict(a), dict(b)
        assert a.keys() == b.keys()
        for key in a:
            assert type(a[key]) is type(b[key]), key
            if key not in moments:
                assert a[key] == b[key], key

    for ours, theirs in zip(claimed_on_own, claimed_by_engine, strict=True):
        assert ours is not None and theirs is not None
        same_but_own(ours.__dict__, theirs.__dict__)
        assert ours.payload == payload and ours.deadline_at == deadline_at
    for row, engine_row in zip(finished_on_own, finished_by_engine, strict=True):
        assert row is not None and engine_row is not None
        same_but_own(row, engine_row)
    assert [r["status"] for r in finished_on_own if r] == ["succeeded", "failed"]
    assert finished_on_own[0] is not None and finished_on_own[0]["result"] == {"answer": ["é", 1]}


def test_given_a_healthy_connection_expect_it_kept_across_statements_and_quiet(
    own: Own,
) -> None:
    first = own.pid()
    assert {own.pid() for _ in range(20)} == {first}
    time.sleep(1.2)  # quiet, as between a model call's claim and finish
    assert own.pid() == first


def test_given_a_connection_past_a_thousand_descriptors_expect_it_kept(own: Own) -> None:
    """A process with many sockets open (the bridge holds a thousand calls) opens its
    connections past ``select``'s limit of 1,024 descriptors: the look before a statement
    still sees a healthy connection as healthy, and does not reopen it every time."""
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        first = own.pid()
        assert {own.pid() for _ in range(5)} == {first}
    finally:
        for fd in held:
            os.close(fd)


def test_given_a_backend_ended_while_idle_expect_the_next_statement_on_a_new_connection(
    engine: Engine, own: Own
) -> None:
    """Postgres's last word waits on the idle socket: the connection is opened again before
    the statement, which does not fail (it did, once, before the look)."""
    first = own.pid()
    end_backend(engine, first)
    assert own.pid() != first


def test_given_a_backend_ended_under_a_statement_expect_one_outage_then_a_new_connection(
    engine: Engine, own: Own
) -> None:
    first = own.pid()
    failed: list[BaseException] = []

    def sleep() -> None:
        try:
            own.execute(select(func.pg_sleep(30)), {})
        except BaseException as exc:
            failed.append(exc)

    sleeper = threading.Thread(target=sleep)
    sleeper.start()
    eventually(lambda: active(engine, first), "the statement running")
    end_backend(engine, first)
    sleeper.join(timeout=30)
    assert not sleeper.is_alive()
    assert len(failed) == 1 and isinstance(failed[0], INFRASTRUCTURE_ERRORS)
    assert own.pid() != first


def active(engine: Engine, pid: int) -> bool:
    with engine.connect() as conn:
        state = conn.execute(
            text("SELECT state FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        ).scalar_one_or_none()
    return state == "active"
