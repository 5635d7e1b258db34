"""Every status write runs the move of ``broker.tasks.resource`` it stands for, on real
row in each status, the operation moves it to the move's target exactly when its status is
one of the move's sources, and leaves it alone otherwise."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from psycopg.types.json import Jsonb
from sqlalchemy import Engine, select, text

from broker.db.engines import async_engine
from broker.db.models import tasks_table
from broker.settings import Settings
from broker.tasks import cancellation, execution
from broker.tasks.resource import (
    CANCEL,
    CLAIM,
    EXPIRE_UNSTARTED,
    FAIL,
    LOSE,
    MOVES,
    OVERRUN,
    RETRY,
    STATUSES,
    SUCCEED,
    Move,
    task_error,
)
from tests.integration.rows import a_task_row

TENANT = "state-machine"

ERROR = task_error("boom", "it broke")

Operation = Callable[[Engine, Settings, uuid.UUID], Any]


def cancel(engine: Engine, settings: Settings, task_id: uuid.UUID) -> Any:
    async def run() -> Any:
        api_engine = async_engine(settings, pool_size=1)
        try:
            return await cancellation.cancel(api_engine, TENANT, task_id, patterns=("*",))
        finally:
            await api_engine.dispose()

    return asyncio.run(run())


OPERATIONS: dict[str, tuple[Move, Operation]] = {
    "claim": (
        CLAIM,
        lambda e, _, t: execution.claim(e, t, agent_id="a", version="1", instance="i"),
    ),
    "requeue": (RETRY, lambda e, _, t: execution.requeue(e, t, ERROR)),
    "succeed": (SUCCEED, lambda e, _, t: execution.succeed(e, t, {"ok": True})),
    "fail": (FAIL, lambda e, _, t: execution.fail(e, t, ERROR)),
    # (the attempt a row made here is at: none yet)
    "fail_lost": (LOSE, lambda e, _, t: execution.fail_lost(e, t, ERROR, attempt=0)),
    "cancel": (CANCEL, cancel),
    "expire": (OVERRUN, lambda e, _, t: execution.expire(e, t, ERROR)),
    "expire_overdue": (EXPIRE_UNSTARTED, lambda e, _, t: execution.expire_overdue(e, t)),
}


def a_task(engine: Engine, status: str, *, overdue: bool) -> uuid.UUID:
    """A task row in ``status``; ``overdue``: its deadline has passed (else it has none)."""
    deadline_at = datetime.now(UTC) - timedelta(seconds=1) if overdue else None
    return a_task_row(engine, tenant=TENANT, status=status, deadline_at=deadline_at)


def status_of(engine: Engine, task_id: uuid.UUID) -> str:
    with engine.connect() as conn:
        query = select(tasks_table.c.status).where(tasks_table.c.id == task_id)
        return str(conn.execute(query).scalar_one())


def test_given_the_operations_expect_one_for_every_move() -> None:
    used = [move for move, _ in OPERATIONS.values()]
    assert len(used) == len(set(used)) and set(used) == set(MOVES)


@pytest.mark.parametrize("status", STATUSES)
@pytest.mark.parametrize("name", OPERATIONS)
def test_given_a_task_in_each_status_expect_the_operation_to_make_exactly_its_move(
    engine: Engine, settings: Settings, name: str, status: str
) -> None:
    move, operation = OPERATIONS[name]
    # Given a task in ``status`` (past its deadline for the one move that needs it)
    task_id = a_task(engine, status, overdue=move is EXPIRE_UNSTARTED)
    # When the operation runs
    outcome = operation(engine, settings, task_id)
    # I expect the move made from its sources, and nothing changed from any other status
    if status in move.sources:
        assert outcome is not None
        assert status_of(engine, task_id) == move.target
    else:
        assert outcome is None
        assert status_of(engine, task_id) == status


@pytest.mark.parametrize(
    "recover",
    [
        lambda e, t, seen: execution.requeue(e, t, ERROR, attempt=seen),
        lambda e, t, seen: execution.fail(e, t, ERROR, attempt=seen),
        lambda e, t, seen: execution.fail_lost(e, t, ERROR, attempt=seen),
    ],
    ids=["requeue", "fail", "fail_lost"],
)
def test_given_a_recovery_of_an_attempt_that_was_started_again_expect_no_move(
    engine: Engine, recover: Callable[[Engine, uuid.UUID, int], Any]
) -> None:
    # given a running task whose first attempt a recovery read as lost, and which another
    # recovery requeued and a worker started again meanwhile (its second attempt)
    task_id = a_task(engine, "queued", overdue=False)
    assert execution.claim(engine, task_id, agent_id="a", version="1", instance="dead")
    assert execution.requeue(engine, task_id, ERROR, attempt=1) is not None
    assert execution.claim(engine, task_id, agent_id="a", version="1", instance="alive")
    # when the first recovery acts on what it read (attempt 1)
    moved = recover(engine, task_id, 1)
    # expect nothing moved: the running attempt 2 is not the lost one
    assert moved is None
    assert status_of(engine, task_id) == "running"
    # and a recovery of attempt 2 itself still moves it
    assert recover(engine, task_id, 2) is not None


def result_of(engine: Engine, task_id: uuid.UUID) -> Any:
    with engine.connect() as conn:
        query = select(tasks_table.c.result.is_(None), tasks_table.c.result)
        return tuple(conn.execute(query.where(tasks_table.c.id == task_id)).one())


def test_given_claims_together_expect_one_statement_to_claim_each_queued_task_once(
    engine: Engine,
) -> None:
    # given three queued tasks, one running, one named twice among the claims
    queued = [a_task(engine, "queued", overdue=False) for _ in range(3)]
    running = a_task(engine, "running", overdue=False)
    ids = [queued[0], running, queued[1], queued[0], queued[2]]
    claims = [execution.Claim(t, f"agent-{i}", "2", f"node-{i}") for i, t in enumerate(ids)]
    # when they are claimed as one group
    claimed = execution.claim_many(engine, claims)
    # expect each queued task claimed once, by its first claim, with that claim's instance
    assert [c.task_id if c else None for c in claimed] == [
        queued[0],
        None,
        queued[1],
        None,
        queued[2],
    ]
    assert [c.attempt for c in claimed if c] == [1, 1, 1]
    with engine.connect() as conn:
        rows = conn.execute(
            select(tasks_table.c.id, tasks_table.c.instance, tasks_table.c.agent_id).where(
                tasks_table.c.id.in_(queued)
            )
        )
        assert {r.id: (r.instance, r.agent_id) for r in rows} == {
            queued[0]: ("node-0", "agent-0"),
            queued[1]: ("node-2", "agent-2"),
            queued[2]: ("node-4", "agent-4"),
        }
    assert status_of(engine, running) == "running"


def test_given_a_private_cards_claims_expect_only_its_tenants_tasks_taken_and_no_other_run(
    engine: Engine,
) -> None:
    # given a queued task of the card's tenant and one of another tenant, claimed together by
    # a card naming its tenants (and by a card of every tenant's, for a third)
    mine = a_task_row(engine, tenant="owner")
    theirs = a_task_row(engine, tenant=TENANT)
    anyones = a_task_row(engine, tenant=TENANT)
    private = ("owner", "other-owner")
    claims = [
        execution.Claim(mine, "bot", "2", "i", tenants=private),
        execution.Claim(theirs, "bot", "2", "i", tenants=private),
        execution.Claim(anyones, "bot", "1", "j"),
    ]
    claimed = execution.claim_many(engine, claims)
    # then the other tenant's task is not taken by the private card, nor shown to it
    assert [c.task_id if c else None for c in claimed] == [mine, None, anyones]
    assert status_of(engine, theirs) == "queued"
    assert execution.queued_outsider(engine, mine, private) is None
    assert execution.queued_outsider(engine, theirs, private) is not None
    # and once refused from the card's own queue it fails, never claimed: no agent shown
    assert execution.fail_outsider(engine, mine, private) is None  # running, and the owner's
    failed = execution.fail_outsider(engine, theirs, private)
    assert failed is not None and failed["status"] == "failed"
    assert (failed["error"]["code"], failed["agent_id"], failed["attempts"]) == (
        "agent_not_found",
        None,
        0,
    )
    assert execution.fail_outsider(engine, theirs, private) is None  # final: once


def test_given_a_turn_claimed_as_the_one_before_it_finished_expect_it_to_read_as_started_after(
    engine: Engine,
) -> None:
    # given turn 1 of a session running and turn 2 waiting for it
    session = f"s-{uuid.uuid4().hex}"
    first = a_task_row(engine, tenant=TENANT, status="running", turn=(session, 1))
    second = a_task_row(engine, tenant=TENANT, turn=(session, 2))
    claims = [execution.Claim(second, "a", "1", "i")]
    # when the claim's transaction begins before turn 1 finishes and its statement runs after
    # (the gap every statement has between its start and its snapshot, made wide)
    with engine.connect() as conn, conn.begin():
        conn.execute(text("SELECT 1"))
        assert execution.succeed(engine, first, {"ok": True}) is not None
        claimed = conn.execute(execution._CLAIM, execution._claim_params(claims)).all()
    # then the claim saw turn 1 final and took turn 2, and the rows say it began after
    assert [r.task_id for r in claimed] == [second]
    with engine.connect() as conn:
        times = select(tasks_table.c.id, tasks_table.c.started_at, tasks_table.c.finished_at)
        rows = {r.id: r for r in conn.execute(times.where(tasks_table.c.id.in_([first, second])))}
    assert rows[second].started_at > rows[first].finished_at


@pytest.mark.parametrize(
    ("durable", "commit"), [((False, False), "off"), ((False, True), "on"), ((True, True), "on")]
)
def test_given_claims_expect_their_commit_to_wait_for_the_disk_unless_no_claim_is_durable(
    engine: Engine, durable: tuple[bool, bool], commit: str
) -> None:
    # given two queued tasks, claimed together, durably or not
    ids = [a_task(engine, "queued", overdue=False) for _ in durable]
    claims = [
        execution.Claim(t, "a", "1", "i", durable=d) for t, d in zip(ids, durable, strict=True)
    ]
    # when the group's statement runs in a transaction
    with engine.connect() as conn, conn.begin() as transaction:
        rows = conn.execute(execution._claim_statement(claims), execution._claim_params(claims))
        claimed = {r.task_id for r in rows}
        setting = conn.execute(text("SHOW synchronous_commit")).scalar_one()
        transaction.rollback()
    # expect both claimed, and the commit flushed unless every claim may be lost
    assert claimed == set(ids)
    assert setting == commit


def test_given_finishes_of_every_kind_together_expect_each_to_make_its_own_move(
    engine: Engine,
) -> None:
    # given four running tasks and a queued one
    ok, null, broke, late = (a_task(engine, "running", overdue=False) for _ in range(4))
    queued = a_task(engine, "queued", overdue=False)
    finishes = [
        execution.Finish.succeeded(ok, {"n": 1}),
        execution.Finish.succeeded(null, None),
        execution.Finish.failed(broke, ERROR, attempt=0),
        execution.Finish.expired(late, ERROR),
        execution.Finish.succeeded(queued, {"n": 2}),
        execution.Finish.failed(ok, ERROR),
    ]
    # when they are written as one group
    rows = execution.finish_many(engine, finishes)
    # expect each running task final once, with its own outcome, and the queued one untouched
    assert [r["status"] if r else None for r in rows] == [
        "succeeded",
        "succeeded",
        "failed",
        "expired",
        None,
        None,
    ]
    assert rows[0] is not None and rows[0]["result"] == {"n": 1}
    assert result_of(engine, null) == (False, None)  # a JSON null, not a missing result
    assert rows[2] is not None and rows[2]["error"] == ERROR
    assert status_of(engine, ok) == "succeeded" and status_of(engine, queued) == "queued"


def test_given_final_writes_expect_every_column_back_but_the_payload_which_stays_stored(
    engine: Engine, settings: Settings
) -> None:
    # given a running task, an overdue queued one and a queued one, each with 64 KB of payload
    payload = {"doc": "x" * 65_536}
    running = a_task_row(engine, tenant=TENANT, status="running", payload=payload)
    overdue = a_task_row(
        engine,
        tenant=TENANT,
        payload=payload,
        deadline_at=datetime.now(UTC) - timedelta(seconds=1),
    )
    queued = a_task_row(engine, tenant=TENANT, payload=payload)
    # when the final writes end them: the worker's finish and expiry, and the API's cancel
    (finished,) = execution.finish_many(engine, [execution.Finish.succeeded(running, {"n": 1})])
    expired = execution.expire_overdue(engine, overdue)
    cancelled = cancel(engine, settings, queued)
    # expect every other column back (and the worker's whether the tenant subscribes), no
    # payload, and the payload still stored (``GET /tasks/{id}?include=payload`` reads it)
    columns = {c.name for c in tasks_table.columns} - {"payload"}
    for row, wanted in (
        (finished, columns | {"tenant_subscribes"}),
        (expired, columns | {"tenant_subscribes"}),
        (cancelled, columns),
    ):
        assert row is not None and set(row) == wanted, row and set(row) ^ wanted
    assert finished is not None and finished["result"] == {"n": 1}
    assert expired is not None and expired["status"] == "expired"
    assert cancelled is not None and cancelled["status"] == "cancelled"
    with engine.connect() as conn:
        ids = [running, overdue, queued]
        query = select(tasks_table.c.payload).where(tasks_table.c.id.in_(ids))
        assert list(conn.execute(query).scalars()) == [payload] * 3


def test_given_a_large_table_expect_claims_and_finishes_to_find_their_rows_by_primary_key(
    engine: Engine,
) -> None:
    """A claim joined only to its JSON rows was planned as a scan of the whole table for the
    few rows the statistics call queued: fine on a new database, a read of every row per
    group on a full one. With their ids as an array, both statements use the primary key."""
    template = a_task(engine, "succeeded", overdue=False)
    copies = text(
        "INSERT INTO tasks SELECT (jsonb_populate_record(t, jsonb_build_object("
        "'id', gen_random_uuid()))).* FROM tasks t, generate_series(1, 5000) WHERE t.id = :id"
    )
    with engine.begin() as conn:
        conn.execute(copies, {"id": template})
    try:
        with engine.connect() as conn:
            conn.execute(text("ANALYZE tasks"))
            rows = [{"task_id": str(uuid.uuid4()), "agent_id": "a", "version": "1"}]
            claim = {"rows": [{**rows[0], "instance": "i"}], "ids": [uuid.UUID(rows[0]["task_id"])]}
            finish = {
                "rows": [{"task_id": rows[0]["task_id"], "outcome": {"v": 1}, "attempt": None}],
                "ids": claim["ids"],
            }
            for statement, params in (
                (execution._CLAIM, claim),
                (execution._CLAIM_LAZY, claim),
                (execution._finish_statement(SUCCEED, False), finish),
                (execution._finish_statement(FAIL, True), finish),
            ):
                compiled = statement.compile(dialect=engine.dialect)
                values = compiled.construct_params(params)
                values["rows"] = Jsonb(values["rows"])
                explained = conn.exec_driver_sql(f"EXPLAIN {compiled}", values)
                plan = "\n".join(r[0] for r in explained)
                assert "Seq Scan on tasks" not in plan, plan
                assert "Index Cond: (id = ANY" in plan, plan
    finally:
        with engine.begin() as conn:
            conn.execute(tasks_table.delete().where(tasks_table.c.tenant == TENANT))


# Many finished tasks of one day and a few running ones: (id, status, instance, started_at).
MANY_FINISHED = text(
    "INSERT INTO tasks (id, tenant, capability, queue, status, payload, payload_digest,"
    " payload_size, trace_id, result_ttl_s, created_at, started_at, finished_at, expires_at,"
    " instance)"
    " SELECT gen_random_uuid(), :tenant, 'echo', 'echo',"
    "  CASE WHEN i % 500 = 0 THEN 'running' ELSE 'succeeded' END, '{}', 'd', 2, 'trace', 60,"
    "  now() - interval '1 minute', now() - interval '1 minute',"
    "  CASE WHEN i % 500 = 0 THEN NULL ELSE now() END, now() + interval '1 day',"
    "  'w' || (i % 7) || '@host'"
    " FROM generate_series(1, :n) AS i"
)


def test_the_reaper_and_the_lease_keepers_read_only_the_running_tasks(engine: Engine) -> None:
    """The reaper (every instance's) and each lease keeper and bridge (its own) read the
    running tasks every few seconds. Filtered on status alone they were a scan of the whole
    table: 262 ms for the reaper at 2 million rows, every 5 s. They read a partial index of
    the running rows instead."""
    # Given 50,000 finished tasks and 100 running ones, the statistics fresh (rolled back at
    # the end: nothing is left for other tests)
    with engine.connect() as conn:
        conn.execute(MANY_FINISHED, {"tenant": TENANT, "n": 50_000})
        conn.execute(text("ANALYZE tasks"))
        plans = {}
        # When the reaper's and one instance's read are planned
        for instance, started_before_s in ((None, 1.0), ("w3@host", 2.0)):
            compiled = execution.running_query(instance, started_before_s).compile(
                dialect=engine.dialect
            )
            explained = conn.exec_driver_sql(f"EXPLAIN {compiled}", compiled.construct_params())
            plans[instance] = "\n".join(r[0] for r in explained)
        # Then both read the index of running tasks, the instance's a range of it, and they
        # find exactly the running rows
        reaped = execution.running_query(None, 1.0).where(tasks_table.c.tenant == TENANT)
        kept = execution.running_query("w3@host", 2.0).where(tasks_table.c.tenant == TENANT)
        found = (len(conn.execute(reaped).all()), len(conn.execute(kept).all()))
        conn.rollback()
    for instance, plan in plans.items():
        assert "Seq Scan on tasks" not in plan, plan
        assert "ix_tasks_running_instance_started_at" in plan, plan
        cond = next(line for line in plan.splitlines() if "Index Cond" in line)
        assert ("instance" in cond) is (instance is not None), plan
    # 100 running rows, over seven instances by i % 7 (i a multiple of 500)
    assert found == (100, sum(1 for i in range(500, 50_001, 500) if i % 7 == 3))
