"""What a worker does to a task row: claim it, report progress, record the outcome.

Every write is conditional on the status it expects, so a redelivered message or a late write
never moves a task backwards or out of a final state. Claims and finishes take many tasks in
one statement (their rows as one JSON parameter, ``jsonb_to_recordset``), so a worker with
many tasks in flight groups them (``grouping.ThreadGrouped``): a statement applies whole or
not at all, so a crash between groups loses nothing and a group never half happens.

A claim waits for its commit to reach the disk only when its agent is not idempotent. That
claim is what keeps such a task from running twice (a redelivered message finds it running,
and a lost worker's task ends ``worker_lost``). An idempotent agent's claim may be lost by a
Postgres crash without harm: the task is queued again, its message is gone (acked when the
finish found the task not running), and the sweep publishes it again (``stale_queued``), so
it runs again, which its agent allows. A finish is always flushed, and it flushes every
commit before it, the lazy claim included.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    CTE,
    Column,
    ColumnElement,
    Connection,
    Engine,
    Integer,
    Select,
    TableValuedAlias,
    Text,
    and_,
    any_,
    bindparam,
    case,
    column,
    exists,
    func,
    null,
    or_,
    select,
    text,
    true,
    tuple_,
    union_all,
    update,
)
from sqlalchemy import cast as sa_cast
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

from broker import sessions
from broker.db.batches import picked_once
from broker.db.engines import LoopConnection, ThreadConnection
from broker.db.models import FINAL_COLUMNS, as_task_row, in_sources
from broker.db.models import tasks_table as tasks
from broker.db.models import webhooks_table as webhooks
from broker.tasks.dispatch import VISIBILITY_TIMEOUT_S
from broker.tasks.resource import (
    CLAIM,
    EXPIRE_UNSTARTED,
    FAIL,
    FINAL,
    LOSE,
    MESSAGE_MAX,
    OVERRUN,
    QUEUED,
    RETRY,
    RUNNING,
    SUCCEED,
    Move,
    TaskRow,
    task_error,
)
from broker.tasks.turns import IS_DUE, session_heads
from broker.webhooks import outbox


@dataclass(frozen=True)
class Claimed:
    task_id: uuid.UUID
    capability: str
    payload: Any
    trace_id: str
    attempt: int
    deadline_at: datetime | None
    session_id: str | None
    metadata: dict[str, Any]
    result_ttl_s: int
    queue: str
    max_attempts: int | None
    tenant: str
    # {"revision", "state", "written"} of its session as the claim found it (``sessions.
    # snapshot_of``); None without a live one.
    session: dict[str, Any] | None = None
    payload_size: int = 0  # its payload's bytes as JSON, as stored at submit


def moment() -> Any:
    """When a move takes effect: the clock as its statement runs (``started_at``,
    ``finished_at``). Not ``now()``, the start of its transaction: a statement's snapshot is
    taken after that, so a turn claimed as the turn before it finished would read as started
    before that turn had finished (``test_state_machine.py``)."""
    return func.clock_timestamp()


def expiry() -> Any:
    """When a task that ends now expires: its result kept ``result_ttl_s`` from its end."""
    return moment() + func.make_interval(0, 0, 0, 0, 0, 0, tasks.c.result_ttl_s)


# Returned with every final state: whether the tenant has a subscription, judged in the same
# statement (one index probe, no round trip), so one created before it is never missed.
_TENANT_SUBSCRIBES = (
    exists()
    .where(webhooks.c.tenant == tasks.c.tenant, webhooks.c.disabled_at.is_(None))
    .correlate(tasks)
    .label("tenant_subscribes")
)


# What a claim reads back, each column labelled with the name ``Claimed`` gives it.
_RENAMED = {"task_id": "id", "attempt": "attempts"}
_CLAIMED_COLUMNS = [
    tasks.c[_RENAMED.get(f.name, f.name)].label(f.name)
    for f in fields(Claimed)
    if f.name != "session"
] + [
    sessions.snapshot_of(
        tasks.c.session_id, tasks.c.tenant, tasks.c.session_written_at.is_not(None)
    ).label("session")
]


def _rows(name: str, *columns: Any) -> TableValuedAlias:
    """The rows of one JSON array parameter, ``rows``, as a table: ``jsonb_to_recordset``."""
    records = func.jsonb_to_recordset(bindparam("rows", type_=JSONB))
    return records.table_valued(*columns).render_derived(name=name, with_types=True)


# The same tasks' ids as an array, ``ids``: the planner cannot see into the JSON, and joined
# only to it, it scanned the whole table for the few rows it thought were queued. By their
# primary key they are found by an index scan however large the table is.
_IDS = any_(bindparam("ids", type_=ARRAY(UUID(as_uuid=True))))


def _params(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"rows": rows, "ids": [uuid.UUID(r["task_id"]) for r in rows]}


_CLAIMS = _rows(
    "claims",
    column("task_id", UUID),
    column("agent_id", Text),
    column("version", Text),
    column("instance", Text),
    column("tenants", JSONB),
)
# How long past its claim a task's row outlives its run: no worker accepts a hard time limit
# that reaches the broker's redelivery timeout, a lost worker's task goes back to its queue
# within its lease, and a retry waits at most 300 s for its next claim.
RUN_HOLD_S = VISIBILITY_TIMEOUT_S


def held_expiry() -> Any:
    """When a task just claimed expires at the soonest: ``RUN_HOLD_S`` and its
    ``result_ttl_s`` from now (or later, if it was due later).

    Its ``expires_at`` was set at submit, ``result_ttl_s`` after it, so that a task that never
    runs is gone then. Left so, a task running past it read as gone, its key was free for a
    second task run beside it, a session's next turn started beside it, and the janitor
    deleted its row, so its outcome had nowhere to go. Moved here, past any end of the run
    (its final write sets it again, ``expiry``), every reader that takes ``expires_at <=
    now()`` as gone is right about a task a worker holds, with no change of its own. The
    agent's timeout would be a tighter bound, but not one for a handler its pool cannot stop
    nor for a lease longer than a margin; this one bounds them all, and costs the claim no
    parameter and no round trip."""
    hold = func.make_interval(0, 0, 0, 0, 0, 0, tasks.c.result_ttl_s + RUN_HOLD_S)
    return func.greatest(tasks.c.expires_at, moment() + hold)


# Statements are built once: building one per task cost a worker more CPU than running it.
_CLAIM = (
    update(tasks)
    .where(
        tasks.c.id == _IDS,
        tasks.c.id == _CLAIMS.c.task_id,
        in_sources(CLAIM),
        # The card's tenants (JSON null: every tenant's) admit the task's.
        or_(_CLAIMS.c.tenants.is_(None), _CLAIMS.c.tenants.has_key(tasks.c.tenant)),
        tasks.c.expires_at > func.now(),
        or_(tasks.c.deadline_at.is_(None), tasks.c.deadline_at > func.now()),
        # A retry's back-off holds whatever message comes first: a sweep's copy of a
        # countdown a busy worker held ran the next attempt at once (``retry_not_due``).
        or_(tasks.c.retry_at.is_(None), tasks.c.retry_at <= func.now()),
        IS_DUE,
    )
    .values(
        status=CLAIM.target,
        started_at=moment(),
        expires_at=held_expiry(),
        attempts=tasks.c.attempts + 1,
        agent_id=_CLAIMS.c.agent_id,
        agent_version=_CLAIMS.c.version,
        instance=_CLAIMS.c.instance,
    )
    .returning(*_CLAIMED_COLUMNS)
)
# The same claim, committed without waiting for the flush (``synchronous_commit`` off for its
# own transaction only: the statement sets it, so no round trip is added). One flush fewer
# on every idempotent task's way to its handler: about 0.9 ms after the half second of quiet
# a model call leaves (``docs/performance.md``).
_CLAIM_LAZY = _CLAIM.where(func.set_config("synchronous_commit", "off", True) == "off")


@contextlib.contextmanager
def _autocommit(engine: Engine) -> Iterator[Connection]:
    """A connection without BEGIN and COMMIT: each statement here is atomic by itself."""
    with engine.connect() as conn:
        yield conn.execution_options(isolation_level="AUTOCOMMIT")


@dataclass(frozen=True)
class Claim:
    """A claim of one task by one agent instance. ``durable``: committed to disk before the
    handler may start; an idempotent agent's need not be (see the module's doc).
    ``tenants``: the card's; a task of any other tenant is not claimed (None: every
    tenant's card)."""

    task_id: uuid.UUID
    agent_id: str
    version: str
    instance: str
    durable: bool = True
    tenants: tuple[str, ...] | None = None


def claim(
    engine: Engine, task_id: uuid.UUID, *, agent_id: str, version: str, instance: str
) -> Claimed | None:
    """Move queued -> running and take the payload in one statement; None if not queued,
    past its deadline (see ``expire_overdue``) or waiting for an earlier turn of its session
    (``turns``)."""
    return claim_many(engine, [Claim(task_id, agent_id, version, instance)])[0]


def claim_many(db: Engine | ThreadConnection, claims: list[Claim]) -> list[Claimed | None]:
    """``claim`` for each, in one statement. A task named twice is claimed once, by the
    first: the others get None, as a redelivered message of a running task does. The
    statement is flushed to disk before it returns if any of them is ``durable``. ``db``: an
    engine, or a worker's own connection for its grouped claims."""
    return _claimed(claims, _rows_of(db, [(_claim_statement(claims), _claim_params(claims))]))


async def claim_many_async(conn: LoopConnection, claims: list[Claim]) -> list[Claimed | None]:
    """``claim_many`` from an event loop, on its own connection: the same statement."""
    rows = await conn.execute(_claim_statement(claims), _claim_params(claims))
    return _claimed(claims, rows)


def _claim_statement(claims: list[Claim]) -> Any:
    return _CLAIM if any(c.durable for c in claims) else _CLAIM_LAZY


def _claim_params(claims: list[Claim]) -> dict[str, Any]:
    return _params(
        [
            {
                "task_id": str(c.task_id),
                "agent_id": c.agent_id,
                "version": c.version,
                "instance": c.instance,
                "tenants": None if c.tenants is None else list(c.tenants),
            }
            for c in claims
        ]
    )


def _rows_of(
    db: Engine | ThreadConnection, statements: list[tuple[Any, dict[str, Any]]]
) -> Iterator[Mapping[str, Any]]:
    """The rows the statements return, in turn, each statement atomic by itself: on a
    worker's own connection, or on one of the engine's."""
    if isinstance(db, ThreadConnection):
        for statement, params in statements:
            yield from db.execute(statement, params)
        return
    with _autocommit(db) as conn:
        for statement, params in statements:
            for row in conn.execute(statement, params):
                yield cast(Mapping[str, Any], row._mapping)


def _claimed(claims: list[Claim], rows: Iterable[Mapping[str, Any]]) -> list[Claimed | None]:
    found = {r["task_id"]: Claimed(**r) for r in rows}
    return [found.pop(c.task_id, None) for c in claims]


def report_progress(
    engine: Engine, task_id: uuid.UUID, progress: dict[str, Any], *, attempt: int | None = None
) -> bool:
    """The task's latest progress, while it runs (``attempt``: that attempt of it); False
    when it is not running (at that attempt) any more."""
    guard = [tasks.c.id == task_id, tasks.c.status == RUNNING]
    if attempt is not None:
        guard.append(tasks.c.attempts == attempt)
    with engine.begin() as conn:
        result = conn.execute(update(tasks).where(*guard).values(progress=progress))
    return result.rowcount == 1


FINISH_BYTES = 512  # a finish's own fields, an error with its message


@dataclass(frozen=True)
class Finish:
    """A final write: ``move`` with its ``outcome`` (the result of a success, the error
    otherwise). ``attempt``: only while the row is still at that attempt."""

    task_id: uuid.UUID
    move: Move
    outcome: Any
    attempt: int | None = None
    # A result's bytes as canonical JSON, as the worker measured it (None: not measured, and
    # a listing measures it as text).
    result_size: int | None = None

    @classmethod
    def succeeded(
        cls,
        task_id: uuid.UUID,
        result: Any,
        *,
        attempt: int | None = None,
        result_size: int | None = None,
    ) -> Finish:
        """A success; the error of an earlier, retried attempt is cleared."""
        return cls(task_id, SUCCEED, result, attempt, result_size)

    def weight(self) -> int:
        """About what it adds to its group's JSON parameter (``grouping``): a result's
        measured size; an error or an unmeasured result is small (a worker measures each)."""
        return FINISH_BYTES + (self.result_size or 0)

    @classmethod
    def failed(
        cls, task_id: uuid.UUID, error: dict[str, Any], *, attempt: int | None = None
    ) -> Finish:
        """Fail a running task, or a queued one that cannot be run (no such capability
        here). ``attempt``: a recovery acts on what it read a moment ago; meanwhile another
        recovery may have requeued the task and a worker started it again, and that newer
        attempt is not the lost one. A worker names the attempt it ran: one taken for lost
        (its worker paused past its lease) may end after the reaper gave the task to
        another, and its outcome is then stale."""
        return cls(task_id, FAIL, error, attempt)

    @classmethod
    def lost(cls, task_id: uuid.UUID, error: dict[str, Any], *, attempt: int) -> Finish:
        """Fail a running task at ``attempt`` whose worker is lost (``LOSE``)."""
        return cls(task_id, LOSE, error, attempt)

    @classmethod
    def expired(
        cls, task_id: uuid.UUID, error: dict[str, Any], *, attempt: int | None = None
    ) -> Finish:
        """A running task that overran its time (its deadline or its agent's timeout)."""
        return cls(task_id, OVERRUN, error, attempt)


def succeed(engine: Engine, task_id: uuid.UUID, result: Any) -> TaskRow | None:
    """The finished row, or None when the task was no longer running (cancelled, say)."""
    return finish_many(engine, [Finish.succeeded(task_id, result)])[0]


def fail(
    engine: Engine, task_id: uuid.UUID, error: dict[str, Any], *, attempt: int | None = None
) -> TaskRow | None:
    return finish_many(engine, [Finish.failed(task_id, error, attempt=attempt)])[0]


def fail_lost(
    engine: Engine, task_id: uuid.UUID, error: dict[str, Any], *, attempt: int
) -> TaskRow | None:
    """Fail the task while still running at ``attempt`` (``Finish.lost``)."""
    return finish_many(engine, [Finish.lost(task_id, error, attempt=attempt)])[0]


def expire(engine: Engine, task_id: uuid.UUID, error: dict[str, Any]) -> TaskRow | None:
    return finish_many(engine, [Finish.expired(task_id, error)])[0]


_FINISHES = _rows(
    "finishes",
    column("task_id", UUID),
    column("outcome", JSONB),
    column("attempt", Integer),
    column("result_size", Integer),
)


@functools.cache
def _finish_statement(move: Move, of_attempt: bool) -> Any:
    """Make ``move`` for each of the rows, recording its outcome (the result or the error; a
    success clears the error an earlier attempt left). ``of_attempt``: only while the row is
    still at its ``attempt``."""
    outcome = "result" if move is SUCCEED else "error"
    values: dict[str, Any] = {
        "status": move.target,
        "finished_at": moment(),
        "expires_at": expiry(),
        # Boxed ({"v": value}): a JSON null in a record would read as SQL NULL.
        outcome: _FINISHES.c.outcome["v"],
    }
    if move is SUCCEED:
        values["error"] = null()
        # Kept beside the result, so a listing's budget adds it (``queries.list_tasks``).
        values["result_size"] = _FINISHES.c.result_size
    guard = [tasks.c.id == _IDS, tasks.c.id == _FINISHES.c.task_id, in_sources(move)]
    if of_attempt:
        guard.append(tasks.c.attempts == _FINISHES.c.attempt)
    # Not the payload (``FINAL_COLUMNS``): nothing reads it once the task has ended, and
    # reading it back cost every finish its whole JSON again. 100 finishes of tasks with
    # 64 KB payloads took 51-98 ms with it and 13 ms without (``docs/performance.md``).
    final = update(tasks).where(*guard).values(values)
    # The webhooks' fanout owed is recorded by the same statement (``outbox``).
    return outbox.recording(final.returning(*FINAL_COLUMNS, _TENANT_SUBSCRIBES))


def finish_many(db: Engine | ThreadConnection, finishes: list[Finish]) -> list[TaskRow | None]:
    """Each finish's row as it ended, or None where the move did not apply (the task was no
    longer running: cancelled, say). One statement for each kind of move among them: one in
    all, at most three (a success, a failure, an overrun; the rare recovery's own). A task
    named twice is finished once, by the first. ``db``: as ``claim_many``'s."""
    found = {r["id"]: cast(TaskRow, dict(r)) for r in _rows_of(db, _finish_statements(finishes))}
    return [found.pop(f.task_id, None) for f in finishes]


async def finish_many_async(conn: LoopConnection, finishes: list[Finish]) -> list[TaskRow | None]:
    """``finish_many`` from an event loop, on its own connection: the same statements."""
    found: dict[uuid.UUID, TaskRow] = {}
    for statement, params in _finish_statements(finishes):
        for r in await conn.execute(statement, params):
            found[r["id"]] = cast(TaskRow, r)
    return [found.pop(f.task_id, None) for f in finishes]


def _finish_statements(finishes: list[Finish]) -> list[tuple[Any, dict[str, Any]]]:
    """One statement and its rows for each kind of move among ``finishes``."""
    kinds: dict[tuple[Move, bool], list[dict[str, Any]]] = {}
    for f in finishes:
        row = {
            "task_id": str(f.task_id),
            "outcome": {"v": f.outcome},
            "attempt": f.attempt,
            "result_size": f.result_size,
        }
        kinds.setdefault((f.move, f.attempt is not None), []).append(row)
    return [
        (_finish_statement(move, of_attempt), _params(rows))
        for (move, of_attempt), rows in kinds.items()
    ]


def expire_overdue(engine: Engine, task_id: uuid.UUID) -> TaskRow | None:
    """A queued task whose deadline passed before it started ends expired, never run; one
    that ran before (a retry waiting for a worker, a lost run put back) says so, and what
    its last attempt came to: it read "not started", and its last error was gone."""
    query = _ended_unstarted(_OVERDUE, tasks.c.id == task_id, tasks.c.deadline_at <= func.now())
    with engine.begin() as conn:
        row = conn.execute(query).first()
    return as_task_row(row) if row is not None else None


_LAST = func.concat(
    "; attempt ",
    tasks.c.attempts,
    ": ",
    tasks.c.error["code"].astext,
    ": ",
    tasks.c.error["message"].astext,
)
_OVERDUE = case(
    (
        tasks.c.attempts > 0,
        func.jsonb_build_object(
            "code",
            "deadline_exceeded",
            "message",
            func.left(
                func.concat(
                    "its attempt ",
                    tasks.c.attempts + 1,
                    " did not start before its deadline",
                    case((tasks.c.error["code"].astext.is_not(None), _LAST), else_=""),
                ),
                MESSAGE_MAX,
            ),
            "retryable",
            False,
        ),
    ),
    else_=sa_cast(task_error("deadline_exceeded", "not started before its deadline"), JSONB),
)


def _ended_unstarted(error: Any, *where: Any) -> Any:
    """The queued tasks ``where`` picks, expired with ``error``, never run: their rows, with
    the fanouts they owe recorded (``outbox``)."""
    query = (
        update(tasks)
        .where(*where, in_sources(EXPIRE_UNSTARTED))
        .values(
            status=EXPIRE_UNSTARTED.target,
            error=error,
            finished_at=moment(),
            expires_at=expiry(),
        )
        .returning(*FINAL_COLUMNS, _TENANT_SUBSCRIBES)
    )
    return outbox.recording(query)


def expire_unstarted(engine: Engine, *, within_s: float, batch: int) -> list[TaskRow]:
    """Queued tasks whose ``expires_at`` comes within ``within_s`` (0: has passed) end
    expired, never run (``ttl_exceeded``), ``batch`` at most: nobody started them within
    their ``result_ttl_s``. The sweep and the janitor call it (``recovery.end_unstarted``),
    and the janitor deletes only final tasks. Before, the row went while queued: accepted,
    then gone, with no final state, event, webhook or callback, and a turn of its session
    waiting behind it read its session's order as broken."""
    error = task_error("ttl_exceeded", "not started within its result_ttl_s")
    due = func.now() + func.make_interval(0, 0, 0, 0, 0, 0, within_s)
    picked = (
        select(tasks.c.id)
        .where(tasks.c.status == QUEUED, tasks.c.expires_at <= due)
        .order_by(tasks.c.expires_at)
        .limit(batch)
        .with_for_update(skip_locked=True)
    )
    query = _ended_unstarted(error, tasks.c.id.in_(picked_once(picked)))
    with engine.begin() as conn:
        return [as_task_row(row) for row in conn.execute(query)]


def fail_outsider(engine: Engine, task_id: uuid.UUID, tenants: tuple[str, ...]) -> TaskRow | None:
    """A queued task of a tenant outside ``tenants`` (a card's, which refused its claim) ends
    failed, never run: the card's tenants changed after routing sent it to the card's queue,
    which no card it may use takes from. None when the task is not such a one."""
    error = task_error("agent_not_found", "no agent its tenant may use serves its queue")
    query = (
        update(tasks)
        .where(
            tasks.c.id == task_id,
            in_sources(FAIL),
            tasks.c.status == QUEUED,
            tasks.c.tenant.not_in(tenants),
        )
        .values(status=FAIL.target, error=error, finished_at=moment(), expires_at=expiry())
        .returning(*FINAL_COLUMNS, _TENANT_SUBSCRIBES)
    )
    with engine.begin() as conn:
        row = conn.execute(outbox.recording(query)).first()
    return as_task_row(row) if row is not None else None


def queued_outsider(
    engine: Engine, task_id: uuid.UUID, tenants: tuple[str, ...]
) -> dict[str, Any] | None:
    """(trace_id, deadline_at, tenant) of a queued task of a tenant outside ``tenants``; None
    when the task is not such a one."""
    query = select(tasks.c.trace_id, tasks.c.deadline_at, tasks.c.tenant).where(
        tasks.c.id == task_id, tasks.c.status == QUEUED, tasks.c.tenant.not_in(tenants)
    )
    with _autocommit(engine) as conn:
        row = conn.execute(query).first()
    return dict(row._mapping) if row is not None else None


def requeue(
    engine: Engine,
    task_id: uuid.UUID,
    error: dict[str, Any],
    *,
    attempt: int | None = None,
    queue: str | None = None,
    delay_s: float = 0.0,
) -> TaskRow | None:
    """running -> queued for another attempt, keeping the last error visible. ``attempt``:
    only if the row is still at that attempt (see ``fail``). ``queue``: where it now waits,
    when not where it waited before (an instance's queue: that instance may be gone).
    ``delay_s``: how long its message is held back (a retry's countdown); the row's
    ``retry_at`` says when it is due, so the sweep does not take it for lost before then
    (``stale_query``)."""
    guard = [tasks.c.id == task_id, in_sources(RETRY)]
    if attempt is not None:
        guard.append(tasks.c.attempts == attempt)
    due = moment() + func.make_interval(0, 0, 0, 0, 0, 0, delay_s)
    values: dict[str, Any] = {
        "status": RETRY.target,
        "error": error,
        "instance": None,
        "retry_at": due,
        # Waiting again, it is kept its TTL from when it is due, as a submit is from its
        # submit: the claim's hold (``held_expiry``, hours) is for a run, and left so it kept a
        # task requeued after a crash (its quota bytes, its key, its session's next turn) for
        # hours past its TTL, never run.
        "expires_at": due + func.make_interval(0, 0, 0, 0, 0, 0, tasks.c.result_ttl_s),
    }
    if queue is not None:
        values["queue"] = queue
    query = update(tasks).where(*guard).values(values).returning(*tasks.c)
    with engine.begin() as conn:
        row = conn.execute(query).first()
    return as_task_row(row) if row is not None else None


def rehome(engine: Engine, queue: str, home: str) -> list[dict[str, Any]]:
    """Queued tasks of ``queue`` (an instance's, that stopped taking work) now wait in
    ``home``: (id, trace_id, deadline_at, tenant) of each, to publish there."""
    query = (
        update(tasks)
        .where(tasks.c.queue == queue, tasks.c.status == QUEUED)
        .values(queue=home)
        .returning(tasks.c.id, tasks.c.trace_id, tasks.c.deadline_at, tasks.c.tenant)
    )
    with engine.begin() as conn:
        return [dict(r._mapping) for r in conn.execute(query)]


def trace_of(engine: Engine, task_id: uuid.UUID) -> dict[str, str]:
    """The task's ``trace_id`` and ``tenant`` ({} when it is gone), for the log lines of a
    message that found it not to run: they are bound once a claim succeeds."""
    query = select(tasks.c.trace_id, tasks.c.tenant).where(tasks.c.id == task_id)
    with _autocommit(engine) as conn:
        row = conn.execute(query).first()
    return {} if row is None else {"trace_id": row.trace_id, "tenant": row.tenant}


def queued_message(engine: Engine, task_id: uuid.UUID) -> dict[str, Any] | None:
    """``trace_id``, ``deadline_at`` and ``tenant`` of a queued task, to send its message
    again with; None for a task not queued."""
    query = select(tasks.c.trace_id, tasks.c.deadline_at, tasks.c.tenant).where(
        tasks.c.id == task_id, tasks.c.status == QUEUED
    )
    with _autocommit(engine) as conn:
        row = conn.execute(query).first()
    return None if row is None else dict(row._mapping)


RETRY_DUE_SLACK_S = 2.0


def retry_not_due(engine: Engine, task_id: uuid.UUID) -> dict[str, Any] | None:
    """A queued task whose retry is not due yet (its claim refused it): ``due_in_s``, and its
    ``trace_id``, ``deadline_at`` and ``tenant`` to send its message again with; None for
    any other task."""
    due_in_s = func.extract("epoch", tasks.c.retry_at - func.now())
    # A retry that came due since the claim refused it (the claim's clock read a moment
    # before this one's) is one too: sent again at once, not left for the sweep.
    slack = func.make_interval(0, 0, 0, 0, 0, 0, RETRY_DUE_SLACK_S)
    query = select(
        due_in_s.label("due_in_s"), tasks.c.trace_id, tasks.c.deadline_at, tasks.c.tenant
    ).where(
        tasks.c.id == task_id,
        tasks.c.status == QUEUED,
        tasks.c.expires_at > func.now(),
        tasks.c.retry_at > func.now() - slack,
    )
    with _autocommit(engine) as conn:
        row = conn.execute(query).first()
    return None if row is None else {**row._mapping, "due_in_s": max(float(row.due_in_s), 0.0)}


def final_row(engine: Engine, task_id: uuid.UUID) -> TaskRow | None:
    """The task if it is final (and not expired): what a redelivered message finds."""
    query = select(tasks).where(
        tasks.c.id == task_id,
        or_(*(tasks.c.status == s for s in FINAL)),
        tasks.c.expires_at > func.now(),
    )
    with _autocommit(engine) as conn:
        row = conn.execute(query).first()
    return as_task_row(row) if row is not None else None


def finished_between(
    engine: Engine, *, after: datetime, before_s: float, limit: int
) -> list[tuple[uuid.UUID, datetime]]:
    """(id, finished_at) of unexpired tasks finished after ``after`` and at least ``before_s``
    ago, oldest first (an index range on ``finished_at``)."""
    query = (
        select(tasks.c.id, tasks.c.finished_at)
        .where(
            tasks.c.finished_at > after,
            tasks.c.finished_at <= func.now() - func.make_interval(0, 0, 0, 0, 0, 0, before_s),
            tasks.c.expires_at > func.now(),
        )
        .order_by(tasks.c.finished_at)
        .limit(limit)
    )
    with _autocommit(engine) as conn:
        return [(r.id, r.finished_at) for r in conn.execute(query)]


def rows_of(engine: Engine, task_ids: list[uuid.UUID]) -> list[TaskRow]:
    with _autocommit(engine) as conn:
        return [as_task_row(r) for r in conn.execute(select(tasks).where(tasks.c.id.in_(task_ids)))]


def overdue_queued(engine: Engine, *, limit: int) -> list[uuid.UUID]:
    """Queued tasks past their deadline (``overdue_query``)."""
    with engine.connect() as conn:
        return [r.id for r in conn.execute(overdue_query(limit))]


def overdue_query(limit: int) -> Select[Any]:
    """Queued tasks past their deadline: their message may have expired in the broker, or they
    waited for an earlier turn of their session, which holds no message of theirs anywhere.

    Shared out as ``stale_queued`` does, by tenant: each tenant with such tasks gets its
    ``limit / tenants`` earliest, at least one; past ``limit`` tenants, every tenant's first
    before any tenant's second. The tenants come from one probe each of
    ``ix_tasks_queued_tenant_deadline_at`` and the tasks from a range of it. Before, any
    ``limit`` of them were taken, found by reading every queued task: one tenant's parked
    turns past their deadline filled every sweep, and another's waited."""
    found = _queued_groups(
        (tasks.c.tenant,), tasks.c.deadline_at, tasks.c.deadline_at.is_not(None), name="deadline"
    )
    groups = select(found).where(found.c.first <= func.now()).cte("overdue_groups")
    share = select((limit + func.count() - 1) // func.greatest(func.count(), 1)).select_from(groups)
    earliest = (
        select(tasks.c.id, tasks.c.deadline_at)
        .where(
            tasks.c.status == QUEUED,
            tasks.c.tenant == groups.c.tenant,
            tasks.c.deadline_at <= func.now(),
        )
        .order_by(tasks.c.deadline_at)
        .limit(share.scalar_subquery())
        .lateral("earliest")
    )
    nth = func.row_number().over(partition_by=groups.c.tenant, order_by=earliest.c.deadline_at)
    taken = (
        select(earliest, nth.label("nth"))
        .select_from(groups.join(earliest, true()))
        .subquery("taken")
    )
    return select(taken.c.id).order_by(taken.c.nth, taken.c.deadline_at).limit(limit)


def stale_queued(engine: Engine, *, older_than_s: float, limit: int) -> list[dict[str, Any]]:
    """Queued tasks waiting for at least ``older_than_s`` (``stale_query``)."""
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(stale_query(older_than_s, limit))]


def stale_query(older_than_s: float, limit: int) -> Select[Any]:
    """Queued tasks waiting a while: candidates for a message the broker lost. A turn
    still waiting for an earlier one of its session is not: its message would be dropped.
    Nor is a task queued again whose retry is not due yet, nor one whose requeue is recent
    (``waited_since``).

    Shared fairly, so that one tenant's backlog (or one queue's) never hides another's lost
    task: each (tenant, queue) with such tasks gets its ``limit / groups`` oldest, at least
    one; past ``limit`` groups, every tenant's first before any tenant's second. The groups
    come from one probe each of ``ix_tasks_queued_tenant_queue_created_at``; a group's tasks
    outside any session from a range of ``ix_tasks_queued_no_session_tenant_queue_created_at``,
    its turns from the first unfinished turn of each session (``session_heads``). So a
    sweep reads ``limit`` rows, a row a group and a row a session with unfinished turns, never
    the turns waiting behind those: it read each of them and asked of each whether it was
    due, 0.8 s a sweep for 1,000 sessions of 100 turns."""
    before = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, older_than_s)
    queued = _queued_groups((tasks.c.tenant, tasks.c.queue), tasks.c.created_at, name="queued")
    groups = select(queued).where(queued.c.first < before).cte("stale_groups")
    count = func.count()
    share = select((limit + count - 1) // func.greatest(count, 1)).select_from(groups)
    columns = ("id", "queue", "trace_id", "deadline_at", "session_id", "created_at")
    alone = (
        select(*(tasks.c[c] for c in columns))
        .where(
            tasks.c.status == QUEUED,
            tasks.c.session_id.is_(None),
            tasks.c.tenant == groups.c.tenant,
            tasks.c.queue == groups.c.queue,
            waited_since(tasks, before),
        )
        .order_by(tasks.c.created_at)
        .limit(share.scalar_subquery())
        .lateral("alone")
    )
    heads = session_heads()
    head = tasks.alias("head")  # a head's ``retry_at``, by its primary key
    found = union_all(
        select(alone, groups.c.tenant).select_from(groups.join(alone, true())),
        select(*(heads.c[c] for c in (*columns, "tenant")))
        .select_from(heads.join(head, head.c.id == heads.c.id))
        .where(heads.c.status == QUEUED, waited_since(head, before)),
    ).subquery("found")
    nth = func.row_number().over(
        partition_by=(found.c.tenant, found.c.queue), order_by=found.c.created_at
    )
    ranked = select(found, nth.label("nth")).subquery("ranked")
    taken = select(ranked).where(ranked.c.nth <= share.scalar_subquery()).subquery("taken")
    in_tenant = func.row_number().over(
        partition_by=taken.c.tenant, order_by=(taken.c.nth, taken.c.created_at)
    )
    return (
        select(taken.c.id, taken.c.queue, taken.c.trace_id, taken.c.deadline_at)
        .add_columns(taken.c.session_id, taken.c.tenant)
        .order_by(in_tenant, taken.c.created_at)
        .limit(limit)
    )


def waited_since(row: Any, before: Any) -> ColumnElement[bool]:
    """The queued task ``row`` (``tasks`` or an alias of it) has waited since ``before``:
    accepted before it and, if queued again (``requeue``), due before it. A retry's message
    is held back for its delay in the worker that published it (kombu's unacked messages,
    not its queue's list), so the sweep took a task retried after 60 s for lost 3 s after
    its first attempt and ran it at once. ``created_at`` stays the indexed bound: a
    ``retry_at`` is never before it."""
    return and_(row.c.created_at < before, or_(row.c.retry_at.is_(None), row.c.retry_at < before))


def _queued_groups(
    key: tuple[Column[Any], ...], order: Column[Any], *where: ColumnElement[bool], name: str
) -> CTE:
    """Each ``key`` (such as (tenant, queue)) holding queued tasks (of ``where``), with the
    least ``order`` of its tasks as ``first``: a loose scan of a partial index of queued tasks
    on ``key`` and ``order``, one probe a group (Postgres has no skip scan)."""
    first = (
        select(*key, order.label("first"))
        .where(tasks.c.status == QUEUED, *where)
        .order_by(*key, order)
        .limit(1)
    )
    found = first.cte(f"{name}_groups", recursive=True)
    after = first.where(tuple_(*key) > tuple_(*(found.c[c.key] for c in key))).lateral("after")
    return found.union_all(select(after).select_from(found.join(after, true())))


def running_tasks(
    engine: Engine, *, instance: str | None = None, started_before_s: float = 0
) -> list[dict[str, Any]]:
    """Running tasks (of one instance), started at least ``started_before_s`` ago: a range
    of ``ix_tasks_running_instance_started_at``, however many finished rows the table holds."""
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(running_query(instance, started_before_s))]


def running_query(instance: str | None, started_before_s: float) -> Select[Any]:
    query = select(
        tasks.c.id,
        tasks.c.instance,
        tasks.c.queue,
        tasks.c.attempts,
        tasks.c.max_attempts,
        tasks.c.agent_id,
        tasks.c.agent_version,  # the card it ran under decides what its loss comes to
        tasks.c.trace_id,
        tasks.c.tenant,
        tasks.c.result_ttl_s,  # its requeue event's log is kept for it
    ).where(
        tasks.c.status == RUNNING,
        tasks.c.started_at < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, started_before_s),
    )
    if instance is not None:
        query = query.where(tasks.c.instance == instance)
    return query


# Only a task that reached its final state goes: one still queued or running past its
# expiry (the janitor behind, a reaper yet to come) ends first, told as every final state is
# (``expire_unstarted``, the reaper). Before, a backlog larger than one run's time to end went
# with no final state: 38,000 of 80,000 queued tasks in one run at the default settings.
_PURGE = text(
    "WITH picked AS MATERIALIZED ("
    " SELECT id FROM tasks WHERE expires_at <= now() AND status = ANY(:final)"
    " ORDER BY expires_at LIMIT :batch FOR UPDATE SKIP LOCKED)"
    " DELETE FROM tasks WHERE id IN (SELECT id FROM picked)"
)


def purge_expired(engine: Engine, *, batch: int, budget_s: float) -> int:
    """Delete expired rows of final tasks in batches of ``batch``, each its own short
    transaction, until none is left or ``budget_s`` is spent. A budget of time, not of
    batches: at 2 million rows a batch of 1,000 takes about 8 ms, so one run keeps pace with
    any intake the API takes, where a cap of 100 batches a minute stopped at 1,667 rows/s
    (``python -m bench.retention``)."""
    params = {"batch": batch, "final": sorted(FINAL)}
    removed = 0
    stop_at = time.monotonic() + budget_s
    while True:
        with engine.begin() as conn:
            count = conn.execute(_PURGE, params).rowcount
        removed += count
        if count < batch or time.monotonic() >= stop_at:
            return removed
