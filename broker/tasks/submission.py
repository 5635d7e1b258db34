"""Accepting a task: write the row (idempotently), then publish its message.

The row is committed before the message goes out, so a worker can never see a message
whose row is not yet visible. If the publish fails, the row is removed again and the caller
gets 503: nothing is accepted that is not on its way. A task of a session takes its turn in
the transaction that inserts it (``turns``), so it goes in alone, not in a group.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import anyio
from sqlalchemy import (
    ColumnElement,
    bindparam,
    column,
    delete,
    func,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import JSONB, insert
from sqlalchemy.ext.asyncio import AsyncEngine

from broker import jsonbody, sessions
from broker.db.engines import LoopConnection
from broker.db.models import FINAL_COLUMNS, as_task_row
from broker.db.models import tasks_table as tasks
from broker.errors import BadRequest, ReachError, Unavailable
from broker.grouping import Grouped
from broker.observability import metrics
from broker.settings import Settings
from broker.tasks import events, turns
from broker.tasks.dispatch import Dispatcher, redis_run_message, send_run
from broker.tasks.envelope import Envelope
from broker.tasks.resource import FINAL, QUEUED, TaskRow, new_task_id
from broker.tenancy.heavy import OneAtATime
from broker.tenancy.keys import Principal
from broker.tenancy.usage import ROW_BYTES, QuotaExceeded, Quotas, task_bytes

log = logging.getLogger("reach.api")

# Built once: constructing and caching the statement per request cost more than running it.
# RETURNING only the id (did the insert happen?): the row is what was sent, plus the
# defaults below; fetching and decoding all 30 columns back cost a third of the insert.
_INSERT = (
    insert(tasks)
    .on_conflict_do_nothing(
        index_elements=["tenant", "capability", "idempotency_key"],
        index_where=tasks.c.idempotency_key.is_not(None),
    )
    .returning(tasks.c.id)
)
# A new row's columns that ``_values`` does not set: all NULL but these server defaults.
_NEW_ROW = {column.name: None for column in tasks.c} | {"attempts": 0}
# The columns ``_values`` sets: a group's rows carry these.
_COLUMNS = (
    "id",
    "tenant",
    "capability",
    "queue",
    "status",
    "payload",
    "payload_digest",
    "payload_size",
    "max_attempts",
    "priority",
    "trace_id",
    "session_id",
    "source",
    "metadata",
    "metadata_size",
    "idempotency_key",
    "callback",
    "result_ttl_s",
    "created_at",
    "deadline_at",
    "expires_at",
)

GROUP_MAX_ROWS = 100


def _as_json(value: Any) -> Any:
    """A column's value as the JSON parameter carries it (Postgres reads it back typed)."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


# A group's rows as one JSON array parameter, ``rows``: one statement, built once, whatever
# the group's size (as the worker's claims and finishes are, ``execution``). A JSON null in
# it reads as SQL NULL; SQLAlchemy writes None to a JSONB column as JSON null, and so does
# this, by ``COALESCE``.
_JSON_COLUMNS = {c for c in _COLUMNS if isinstance(tasks.c[c].type, JSONB)}
_JSON_NULL: ColumnElement[Any] = literal_column("'null'::jsonb")
_NEW = (
    func.jsonb_to_recordset(bindparam("rows", type_=JSONB))
    .table_valued(*(column(c, tasks.c[c].type) for c in _COLUMNS))
    .render_derived(name="new", with_types=True)
)
_INSERT_GROUP = (
    insert(tasks)
    .from_select(
        _COLUMNS,
        select(
            *(
                func.coalesce(_NEW.c[c], _JSON_NULL) if c in _JSON_COLUMNS else _NEW.c[c]
                for c in _COLUMNS
            )
        ),
    )
    .on_conflict_do_nothing(
        index_elements=["tenant", "capability", "idempotency_key"],
        index_where=tasks.c.idempotency_key.is_not(None),
    )
    .returning(tasks.c.id)
)


def _row_weight(row: dict[str, Any]) -> int:
    """About what a row adds to its group's JSON parameter (``grouping``)."""
    return ROW_BYTES + int(row["payload_size"]) + int(row["metadata_size"])


class GroupInsert:
    """Inserts task rows; rows that arrive together go out in one INSERT ... SELECT from their
    JSON (``grouping``): under load, one round trip and one commit for many submits. The groups go
    out one after another on a psycopg connection of their own (``LoopConnection``), without
    SQLAlchemy's per-statement layers: half a millisecond of each submit's wait, alone."""

    def __init__(self, engine: AsyncEngine, max_rows: int = GROUP_MAX_ROWS) -> None:
        self.engine = engine
        self._db = LoopConnection(engine.url)
        # A session's submits, one at a time in this process (``_insert_turn``).
        self.turns = OneAtATime()
        self._insert = Grouped(
            self._insert_many,
            max_items=max_rows,
            name="inserts",
            retry_alone=True,
            weigh=_row_weight,
        )

    async def insert(self, values: dict[str, Any]) -> bool:
        """True when the row went in; False when its idempotency key was already taken."""
        return await self._insert(values)

    async def close(self) -> None:
        await self._db.close()

    async def _insert_many(self, rows: list[dict[str, Any]]) -> list[bool]:
        params = {"rows": [{c: _as_json(row[c]) for c in _COLUMNS} for row in rows]}
        inserted = {r["id"] for r in await self._db.execute(_INSERT_GROUP, params)}
        return [row["id"] in inserted for row in rows]


@dataclass(frozen=True)
class Accepted:
    row: TaskRow
    replayed: bool


def _ttl_s(envelope: Envelope, settings: Settings) -> int:
    return min(envelope.result_ttl_s or settings.result_ttl_s, settings.max_result_ttl_s)


def _values(
    principal: Principal,
    envelope: Envelope,
    queue: str,
    trace_id: str,
    settings: Settings,
    callback: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], int]:
    """The new task's row, and the bytes it will hold (``usage.task_bytes``)."""
    digest, size = jsonbody.digest(envelope.payload)
    if size > settings.max_payload_bytes:
        raise BadRequest(
            f"payload is {size} bytes, the limit is {settings.max_payload_bytes}",
            code="payload_too_large",
        )
    metadata_size = 2  # {}
    if envelope.metadata:
        metadata_size = jsonbody.sent_size(jsonbody.canonical(envelope.metadata))
        if metadata_size > settings.max_metadata_bytes:
            raise BadRequest(
                f"metadata is {metadata_size} bytes, the limit is {settings.max_metadata_bytes}",
                code="metadata_too_large",
            )
    now = datetime.now(UTC)
    ttl_s = _ttl_s(envelope, settings)
    deadline_at = None
    if envelope.deadline_ms is not None:
        deadline_at = now + timedelta(milliseconds=envelope.deadline_ms)
    row = {
        "id": new_task_id(),
        "tenant": principal.tenant,
        "capability": envelope.capability,
        "queue": queue,
        "status": QUEUED,
        "payload": envelope.payload,
        "payload_digest": digest,
        "payload_size": size,
        "max_attempts": envelope.max_attempts,
        "priority": envelope.priority,
        "trace_id": trace_id,
        "session_id": envelope.session_id,
        "source": envelope.source,
        "metadata": envelope.metadata,
        "metadata_size": metadata_size,
        "idempotency_key": envelope.idempotency_key,
        "callback": callback,
        "result_ttl_s": ttl_s,
        "created_at": now,
        "deadline_at": deadline_at,
        # A task that never starts is gone after its TTL; its claim holds it while it runs
        # (``execution.held_expiry``), and its end restarts the clock.
        "expires_at": now + timedelta(seconds=ttl_s),
    }
    return row, task_bytes(size, metadata_size)


async def submit(
    inserter: GroupInsert,
    dispatcher: Dispatcher,
    event_log: events.EventLog,
    principal: Principal,
    envelope: Envelope,
    *,
    queue: str,
    trace_id: str,
    settings: Settings,
    quota: Quotas,
    callback: dict[str, Any] | None = None,
    behind: bool = False,
) -> Accepted:
    """``callback``: the task's callback as stored (``Intake.submit`` gives it). ``behind``:
    its message waits behind the other tenants' in the queue (``QueueBound.check``).
    ``quota``: what the tenant's tasks may hold; a replay of a task already accepted gets it
    even past the quota."""
    values, size = _values(principal, envelope, queue, trace_id, settings, callback)
    engine = inserter.engine
    try:
        await quota.take(principal.tenant, size)
    except QuotaExceeded:
        replayed = await _replay(engine, values) if values["idempotency_key"] else None
        if replayed is None:
            raise
        return replayed
    try:
        row = await _write(inserter, values, settings.session_max_unfinished_turns)
    except BaseException:
        quota.give_back(principal.tenant, size)
        raise
    if isinstance(row, Accepted):  # a replay: nothing new is held
        quota.give_back(principal.tenant, size)
        return row
    try:
        # The queued event goes first, so it precedes whatever the worker appends. With the
        # broker on the same Redis, the message goes out in that same call.
        push = None
        if dispatcher.direct:
            push = redis_run_message(
                dispatcher.app,
                row["id"],
                queue,
                trace_id=trace_id,
                tenant=principal.tenant,
                deadline_at=row["deadline_at"],
                behind=behind,
            )
        await event_log.append_async(
            row["id"],
            events.STATUS,
            {"status": QUEUED},
            trace_id=trace_id,
            tenant=principal.tenant,
            ttl_s=row["result_ttl_s"] + events.EVENTS_SLACK_S,
            push=push,
        )
        if push is None:
            await anyio.to_thread.run_sync(
                lambda: send_run(
                    dispatcher.app,
                    row["id"],
                    queue,
                    trace_id=trace_id,
                    tenant=principal.tenant,
                    deadline_at=row["deadline_at"],
                    behind=behind,
                )
            )
    except Exception as exc:
        # A reply that never came (a timeout) may be of a call Redis ran: the message may be
        # out. The row is withdrawn only while still queued; a task a worker has claimed was
        # published, and the caller is told so, not 503 (which a caller answers by submitting
        # again: the work would run twice). A queued one withdrawn here finds no row if its
        # message was out after all, and does not run.
        #
        # Not a task with an idempotency key: from its commit on, a submit with the same key
        # was answered with it (a caller's retry of this very request, its first attempt
        # timed out), and that caller would hold a task that never runs. It stays, queued:
        # the sweeper publishes it if its message is not in its queue (``recovery.sweep``).
        if values["idempotency_key"] is not None:
            log.warning(
                "task %s: publishing it failed (%r); kept, for the sweeper to publish",
                row["id"],
                exc,
            )
        elif await _withdraw(engine, row["id"]):
            quota.give_back(principal.tenant, size)
            raise Unavailable("the task queue cannot be reached", code="queue_unavailable") from exc
        else:
            log.warning(
                "task %s: the queue's reply was lost (%r), and a worker had claimed it: accepted",
                row["id"],
                exc,
            )
    return Accepted(row=row, replayed=False)


async def _write(
    inserter: GroupInsert, values: dict[str, Any], max_turns: int
) -> TaskRow | Accepted:
    """The new task's row, or the task its idempotency key already made (even when its
    session holds its ``max_turns`` unfinished turns now)."""
    engine = inserter.engine
    # A few rounds: submits racing for an expired task's key each find the row, and only
    # one deletes it; a slow one could read it once more before that delete committed.
    for _ in range(4):
        if values["session_id"] is not None:
            try:
                inserted = await _insert_turn(inserter, values, max_turns)
            except (turns.SessionTurnsExceeded, sessions.SessionNotLive):
                # (its session gone since: the turn it took is still the retry's answer)
                replayed = await _replay(engine, values) if values["idempotency_key"] else None
                if replayed is None:
                    raise
                return replayed
        else:
            inserted = await inserter.insert(values)
        if inserted:
            return _accepted_row(values)
        replayed = await _replay(engine, values)
        if replayed is not None:
            return replayed
        # The key's task had expired (or was purged): the key is free, try again.
    raise Unavailable("idempotency key is being released, retry", code="conflict_retry")


def _accepted_row(values: dict[str, Any]) -> TaskRow:
    """The new task's row as its submit answers it: every column but its payload, as a
    replay's (``_replay``). A sync wait, a stream and a protocol's call hold the row for as
    long as they last, and a payload of 1 MiB of JSON is some 20 MiB of Python objects."""
    return cast(TaskRow, {k: v for k, v in (_NEW_ROW | values).items() if k != "payload"})


async def _insert_turn(inserter: GroupInsert, values: dict[str, Any], max_turns: int) -> bool:
    """Insert a session's task with the session's next turn (set in ``values``), in one
    transaction; False when its idempotency key was already taken (no turn is used up).
    SessionNotLive when the session is unknown, expired or another tenant's;
    SessionTurnsExceeded when it holds ``max_turns`` unfinished turns already. The count is
    taken with the session's row locked (``ALLOCATE``), so submits to one session count one
    after another, each seeing the turns the ones before it committed.

    In this process they first wait their turn (``inserter.turns``) without a connection, so
    at most one of the pool's waits for the row (held through a payload's insert, up to
    1 MiB): were each to wait holding its own, one session's submits (up to 256 waiting
    requests) would hold every connection of the pool, and every other tenant would wait."""
    session_id = values["session_id"]
    turn_of_session = inserter.turns.turn(values["tenant"], f"turn {session_id}")
    async with turn_of_session, inserter.engine.connect() as conn:
        turn = await conn.scalar(
            turns.ALLOCATE, {"turn_session": session_id, "turn_tenant": values["tenant"]}
        )
        if turn is None:
            raise sessions.SessionNotLive(
                "session_id names no live session of this tenant",
                errors=[{"field": "session_id", "message": "no live session of this tenant"}],
            )
        counted = await conn.execute(turns.UNFINISHED, {"session": session_id, "cap": max_turns})
        if counted.scalar_one() >= max_turns:
            await conn.rollback()
            metrics.rejections.labels("session_turns_exceeded").inc()
            raise turns.SessionTurnsExceeded(
                f"session {session_id} already holds {max_turns} unfinished turns"
                " (REACH_SESSION_MAX_UNFINISHED_TURNS); submit again once some have finished",
                retry_after_s=turns.RETRY_AFTER_S,
                limit_turns=max_turns,
            )
        values["session_turn"] = turn
        if (await conn.execute(_INSERT, values)).first() is None:
            await conn.rollback()
            return False
        await conn.commit()
    return True


async def _replay(engine: AsyncEngine, values: dict[str, Any]) -> Accepted | None:
    """Same key seen before: the same payload in the same session (or none) gets the first
    task; another payload, or another session, an error. A session's task is a turn of that
    session: handing a submit to session B the task made for session A would tell B's caller
    its turn was taken when B got none.

    None when that task is gone: purged, or expired, which reads as gone everywhere else, so
    its row is deleted here as the janitor would (only while still expired: two replays
    racing delete it once) and the key is free for a new task. As the janitor would: only
    once it reached its final state. One still queued past its expiry (the janitor behind)
    stays, to end as ``ttl_exceeded``, told as every final state is; meanwhile the key is
    being released (``conflict_retry``), and after that the replay is that task's.
    """
    # What the comparison needs first: a request of a few bytes with another payload costs
    # no read of the first task's payload or result (up to megabytes, decoded on the loop).
    compared = (tasks.c.id, tasks.c.payload_digest, tasks.c.session_id)
    query = select(*compared, (tasks.c.expires_at <= func.now()).label("expired")).where(
        tasks.c.tenant == values["tenant"],
        tasks.c.capability == values["capability"],
        tasks.c.idempotency_key == values["idempotency_key"],
    )
    async with engine.connect() as conn:
        existing = (await conn.execute(query)).first()
        if existing is None:
            return None
        if existing.expired:
            gone = delete(tasks).where(
                tasks.c.id == existing.id,
                tasks.c.expires_at <= func.now(),
                tasks.c.status.in_(FINAL),
            )
            await conn.execute(gone)
            await conn.commit()
            return None
    differs = None
    if existing.payload_digest != values["payload_digest"]:
        differs = "payload"
    elif existing.session_id != values["session_id"]:
        differs = "session_id"
    if differs is not None:
        metrics.idempotency.labels("conflict").inc()
        raise BadRequest(
            f"this idempotency key was used with a different {differs}",
            code="idempotency_key_reused",
        )
    # The first task as it stands, every column but its payload (as a final write reads it).
    first = select(*FINAL_COLUMNS).where(tasks.c.id == existing.id)
    async with engine.connect() as conn:
        found = (await conn.execute(first)).first()
    if found is None:  # purged between the two reads: the key is free
        return None
    metrics.idempotency.labels("replayed").inc()
    return Accepted(row=as_task_row(found), replayed=True)


async def replay_of(
    engine: AsyncEngine, principal: Principal, envelope: Envelope
) -> Accepted | None:
    """The task ``envelope``'s idempotency key already made (``_replay``), for a submit that
    checks of new work refused; None without a key, without such a task, or when it cannot
    be read (the refusal stands)."""
    if envelope.idempotency_key is None:
        return None
    values = {
        "tenant": principal.tenant,
        "capability": envelope.capability,
        "idempotency_key": envelope.idempotency_key,
        "payload_digest": jsonbody.digest(envelope.payload)[0],
        "session_id": envelope.session_id,
    }
    try:
        return await _replay(engine, values)
    except ReachError:
        raise  # the key used with another payload: that is the answer
    except Exception:
        log.exception("reading the task of idempotency key %r failed", envelope.idempotency_key)
        return None


async def _withdraw(engine: AsyncEngine, task_id: uuid.UUID) -> bool:
    """Delete the task's row while it is still queued; False when a worker has claimed it
    (or it is gone): its message went out."""
    async with engine.begin() as conn:
        deleted = await conn.execute(
            delete(tasks).where(tasks.c.id == task_id, tasks.c.status == QUEUED)
        )
    return bool(deleted.rowcount)
