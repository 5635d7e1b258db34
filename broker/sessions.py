"""Sessions: a conversation's state, kept as snapshots with a revision that only grows.

A write names the revision it read (``If-Match``); a stale one is refused with the current
revision (412 ``revision_conflict``), so two writers never lose each other's work. The last
revisions are kept with the task that wrote each, when a task did; the write that adds one
deletes those older than the last ``revisions_kept``, so a session's history is bounded
however long it lives. Every write extends the idle TTL; an expired session reads as gone.
One tenant never sees another's (404).

The reads and the compare-and-set take a connection of either kind: the API (async) runs
them with ``AsyncConnection.run_sync``, the workers (``ctx.session``) on their own.
The order its tasks run in is ``broker.tasks.turns``'s.
"""

from __future__ import annotations

import re
import secrets
import sys
import uuid
from datetime import datetime
from types import SimpleNamespace
from typing import Any, cast

from sqlalchemy import (
    Connection,
    Engine,
    bindparam,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncEngine

from broker import jsonbody
from broker.db.batches import picked_once
from broker.db.models import session_revisions_table as revisions
from broker.db.models import sessions_table as sessions
from broker.db.models import tasks_table as tasks
from broker.db.paging import Budget, first_rows, json_bytes, newest_created_first
from broker.errors import BadRequest, Conflict, InvalidEnvelope, NotFound, ReachError
from broker.tasks.resource import RUNNING
from broker.tasks.turns import HELD_BY_A_TURN, IDLE_SINCE_ITS_LAST_TURN, JUST_ENDED, LIVE
from broker.tenancy.heavy import OneAtATime
from broker.timestamps import iso

ID_PREFIX = "sess_"
ID_MAX = 128
PATCHABLE = ("state", "metadata")


class SessionNotFound(NotFound):
    code = "session_not_found"


class SessionNotLive(InvalidEnvelope):
    """An envelope's ``session_id`` names no live session of the caller's tenant: the envelope
    cannot be processed (422), where a session route answers 404 with the same code."""

    code = "session_not_found"


class SessionLimitReached(Conflict):
    """The tenant holds as many live sessions as it may (409): delete one, or let one expire."""

    code = "session_limit_reached"


class SessionTooLarge(BadRequest):
    code = "session_too_large"


class RevisionConflict(ReachError):
    """The write named a revision that is not the current one (412)."""

    code = "revision_conflict"


class PreconditionRequired(ReachError):
    """A write without ``If-Match`` (428)."""

    code = "precondition_required"


class SessionInvalid(BadRequest):
    code = "session_invalid"


class TaskNotRunning(Conflict):
    """A task wrote to its session after it stopped running (cancelled, say)."""

    code = "task_not_running"


class TaskPastDeadline(Conflict):
    """A task wrote to its session after its deadline passed."""

    code = "deadline_exceeded"


def new_id() -> str:
    return ID_PREFIX + secrets.token_urlsafe(12)


def render(row: Any) -> dict[str, Any]:
    return {
        "session_id": row.id,
        "revision": row.revision,
        "state": row.state,
        "metadata": row.metadata,
        "created_at": iso(row.created_at),
        "updated_at": iso(row.updated_at),
        "expires_at": iso(row.expires_at),
    }


# One member of an HTTP list of entity tags, empty members allowed, and what ends it.
_MEMBER = re.compile(r'[ \t]*(?:(?:W/)?"([^"]*)")?[ \t]*(,|\Z)', re.ASCII)
_REVISION = re.compile(r"[0-9]{1,18}", re.ASCII)
ANY_REVISION = None  # ``If-Match: *``: the session as it is now, whatever its revision


def etag(revision: int) -> str:
    return f'"{revision}"'


def revision_of(if_match: str | None) -> frozenset[int] | None:
    """The revisions an ``If-Match`` (RFC 9110, 13.1.1) names: each tag of its list, ``"7"``
    (or ``W/"7"``: a proxy may weaken a tag), or ANY_REVISION for ``*``; PreconditionRequired
    when there is none. A tag that is not one of ours, or a header that is not a list of
    tags, names no revision and so matches none (RevisionConflict, with the current one,
    follows). Python's ``int`` read ``"1_0"`` as 10 and other scripts' digits as ours.
    A bare revision, ``7``, as the HTTP contract's table writes it, is read as ``"7"``: it
    was refused 412 "which If-Match does not name" when it named the current revision."""
    if if_match is None or not if_match.strip():
        raise PreconditionRequired("a write needs If-Match with the revision it read")
    if if_match.strip() == "*":
        return ANY_REVISION
    if _REVISION.fullmatch(if_match.strip()):
        return frozenset({int(if_match.strip())})
    found: set[int] = set()
    at = 0
    while True:
        member = _MEMBER.match(if_match, at)
        if member is None:
            return frozenset()
        tag = member.group(1)
        if tag is not None and _REVISION.fullmatch(tag):
            found.add(int(tag))
        if not member.group(2):
            break
        at = member.end()
    return frozenset(found)


def check_size(state: Any, metadata: Any, max_bytes: int) -> None:
    """At most ``max_bytes``, and JSON Postgres keeps (SessionInvalid otherwise). A request's
    body was parsed strictly already; an agent's ``ctx.session.update`` was not: NaN, a value
    that is not JSON, a lone surrogate or nesting too deep to write fail here, and a NUL, which
    JSON writes but Postgres refuses, fails the string check."""
    try:
        # Any depth the interpreter writes: strings, NaN and what is not JSON alone refused.
        depth = sys.getrecursionlimit()
        written = (jsonbody.written(v, max_depth=depth) for v in (state, metadata))
        size = sum(map(jsonbody.sent_size, written))
    except BadRequest as exc:
        raise SessionInvalid(exc.message) from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise SessionInvalid(f"state and metadata must be JSON: {exc}") from None
    if size > max_bytes:
        raise SessionTooLarge(
            f"the session would hold {size} bytes; at most {max_bytes}", max_bytes=max_bytes
        )


def _expiry(ttl_s: Any) -> Any:
    return func.now() + func.make_interval(0, 0, 0, 0, 0, 0, ttl_s)


async def create(
    engine: AsyncEngine,
    tenant: str,
    *,
    state: dict[str, Any],
    metadata: dict[str, Any],
    ttl_s: int,
    max_bytes: int,
    max_per_tenant: int,
    turns: OneAtATime,
) -> dict[str, Any]:
    """A new session at revision 1; SessionLimitReached when the tenant already holds
    ``max_per_tenant`` live ones (expired ones do not count: the janitor deletes them).

    A tenant's creations take the tenant's lock in Postgres, so the limit holds across
    processes; in this process they first wait their turn in ``turns``, without a connection,
    so at most one of the pool's waits for that lock. Were each to wait holding its own, a
    tenant's waiting requests (up to 256) would hold every connection of the pool, and every
    other tenant's requests would wait for them."""
    check_size(state, metadata, max_bytes)
    values = {
        "id": new_id(),
        "tenant": tenant,
        "revision": 1,
        "state": state,
        "metadata": metadata,
        "ttl_s": ttl_s,
        "expires_at": _expiry(ttl_s),
    }
    async with turns.turn(tenant, "session create"), engine.begin() as conn:
        await conn.execute(select(func.pg_advisory_xact_lock(func.hashtext(f"sess:{tenant}"))))
        live = await conn.scalar(
            select(func.count()).select_from(
                select(sessions.c.id)
                .where(sessions.c.tenant == tenant, LIVE)
                .limit(max_per_tenant)
                .subquery()
            )
        )
        if (live or 0) >= max_per_tenant:
            raise SessionLimitReached(
                f"a tenant may hold {max_per_tenant} live sessions", max_sessions=max_per_tenant
            )
        row = (await conn.execute(insert(sessions).values(values).returning(sessions))).one()
        await conn.execute(_revision_kept(row, task_id=None))
    return render(row)


async def get(engine: AsyncEngine, tenant: str, session_id: str) -> dict[str, Any]:
    async with engine.connect() as conn:
        row = await conn.run_sync(live, tenant, session_id)
    return render(row)


async def list_live(
    engine: AsyncEngine, tenant: str, *, limit: int, cursor: str | None, max_bytes: int
) -> tuple[list[dict[str, Any]], str | None]:
    """The tenant's live sessions, newest first, a page at a time (``broker.db.paging``: a
    session's id is random, so its pages go by creation time), with at most ``max_bytes`` of
    state and metadata (and at least one session)."""
    query = select(sessions).where(sessions.c.tenant == tenant, LIVE)
    budget = Budget(max_bytes, json_bytes("state", "metadata"))
    async with engine.connect() as conn:
        rows, next_cursor = await newest_created_first(
            conn,
            query,
            sessions.c.created_at,
            sessions.c.id,
            limit=limit,
            cursor=cursor,
            budget=budget,
        )
    return [render(SimpleNamespace(**row)) for row in rows], next_cursor


def _nameable(session_id: str) -> str:
    """``session_id`` when a session could have it; SessionNotFound otherwise, before any
    query: a NUL (which Postgres refuses in text, a 422 as if the id were the caller's to
    fix) or more characters than any id has."""
    if len(session_id) > ID_MAX or "\x00" in session_id:
        raise SessionNotFound("no such session")
    return session_id


def live(conn: Connection, tenant: str, session_id: str, *, for_update: bool = False) -> Any:
    """The session's row while it is live and the tenant's; SessionNotFound otherwise. On a
    connection of either kind (async callers: ``AsyncConnection.run_sync``), like
    ``compare_and_set``: the API and the workers share one implementation. ``for_update``
    holds the row until the transaction ends."""
    query = select(sessions).where(
        sessions.c.tenant == tenant,
        sessions.c.id == _nameable(session_id),
        LIVE,
    )
    row = conn.execute(query.with_for_update() if for_update else query).first()
    if row is None:
        raise SessionNotFound("no such session")
    return row


async def write(
    engine: AsyncEngine,
    tenant: str,
    session_id: str,
    *,
    revision: int | frozenset[int] | None,
    state: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    patch: dict[str, Any] | None = None,
    max_bytes: int,
    revisions_kept: int,
) -> dict[str, Any]:
    """``compare_and_set`` for the API, in a transaction of its own."""
    async with engine.begin() as conn:
        row = await conn.run_sync(
            lambda sync: compare_and_set(
                sync,
                tenant,
                session_id,
                revision=revision,
                state=state,
                metadata=metadata,
                patch=patch,
                max_bytes=max_bytes,
                revisions_kept=revisions_kept,
            )
        )
    return render(row)


def compare_and_set(
    conn: Connection,
    tenant: str,
    session_id: str,
    *,
    revision: int | frozenset[int] | None,
    state: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    patch: dict[str, Any] | None = None,
    max_bytes: int,
    revisions_kept: int,
    task_id: uuid.UUID | None = None,
    attempt: int | None = None,
) -> Any:
    """The next revision's row: ``state`` (and ``metadata``) replaced, or ``patch`` (RFC
    7396) applied to the session, only while ``revision`` is the current one (one of them,
    for a set; any, for ANY_REVISION: RevisionConflict otherwise). Extends the idle TTL;
    keeps the revision, naming ``task_id`` when a task wrote it, and then only while that
    task is running at ``attempt`` (TaskNotRunning otherwise): a cancelled turn's agent,
    still at work, cannot write under the next turn, nor can an attempt taken for lost
    write under the one that replaced it. Deletes the revisions older than the last
    ``revisions_kept``. Call it in a transaction; it commits with the caller's."""
    if task_id is not None:
        _hold_running(conn, task_id, attempt)
    # Held, so the revision read is the one written over: ``*`` and a list match what is
    # there when the write happens, and a second writer waits, then reads the first's.
    current = live(conn, tenant, session_id, for_update=True)
    expected = {revision} if isinstance(revision, int) else revision
    if expected is not ANY_REVISION and current.revision not in expected:
        raise RevisionConflict(
            f"the session is at revision {current.revision}, which If-Match does not name",
            current_revision=current.revision,
        )
    if patch is not None:
        merged = merge_patch({"state": current.state, "metadata": current.metadata}, patch)
        # Both are objects: a patch that removes one (null) leaves it empty.
        state, metadata = merged.get("state", {}), merged.get("metadata", {})
    new_state = current.state if state is None else state
    new_metadata = current.metadata if metadata is None else metadata
    if not isinstance(new_state, dict) or not isinstance(new_metadata, dict):
        raise SessionInvalid("state and metadata are JSON objects")
    check_size(new_state, new_metadata, max_bytes)
    row = conn.execute(  # the row is held: the update finds it as read
        update(sessions)
        .where(sessions.c.tenant == tenant, sessions.c.id == current.id)
        .values(
            revision=current.revision + 1,
            state=new_state,
            metadata=new_metadata,
            updated_at=func.now(),
            expires_at=_expiry(sessions.c.ttl_s),
        )
        .returning(sessions)
    ).one()
    conn.execute(_revision_kept(row, task_id=task_id))
    conn.execute(_revisions_past(row, kept=revisions_kept))
    return row


def _hold_running(conn: Connection, task_id: uuid.UUID, attempt: int | None) -> None:
    """The task is running (at ``attempt``, when given) and not past its deadline, and stays
    running until the caller's transaction ends: a cancel waits for the write, so the next
    turn, released after it, reads what was written. The task is marked as having written
    its session (``session_written_at``), in the write's transaction: a claim of it again
    fails it (``workers.runner``). A handler that runs on past its deadline (a sync one on
    the threads pool, which nothing can stop mid-call) ends ``expired`` whatever it returns,
    and its session write is refused with it: kept, it was a turn's effect from a task that
    failed, written while the turns behind it expired."""
    late = func.coalesce(tasks.c.deadline_at <= func.now(), False)
    query = (
        update(tasks)
        .where(tasks.c.id == task_id, tasks.c.status == RUNNING)
        .values(session_written_at=func.coalesce(tasks.c.session_written_at, func.now()))
        .returning(late)
    )
    if attempt is not None:
        query = query.where(tasks.c.attempts == attempt)
    held = conn.execute(query).first()
    if held is None:
        raise TaskNotRunning("the task is no longer running: its session write is refused")
    if held[0]:
        raise TaskPastDeadline("the task is past its deadline: its session write is refused")


def snapshot_of(session_id: Any, tenant: Any, written: Any) -> Any:
    """``{"revision", "state", "written"}`` of the live session ``session_id`` of ``tenant``
    (columns of an enclosing statement), or null: what a claim reads for ``ctx.session``.
    ``written``: the claimed task wrote its session already (its ``session_written_at``), so
    an earlier attempt of it applied its turn (``workers.runner``: it is not run again)."""
    return (
        select(
            func.jsonb_build_object(
                "revision",
                sessions.c.revision,
                "state",
                sessions.c.state,
                "written",
                written,
                type_=JSONB,
            )
        )
        .where(
            sessions.c.id == session_id,
            sessions.c.tenant == tenant,
            LIVE,
        )
        .scalar_subquery()
    )


async def remove(engine: AsyncEngine, tenant: str, session_id: str) -> None:
    async with engine.begin() as conn:
        gone = await conn.execute(
            delete(sessions).where(
                sessions.c.tenant == tenant,
                sessions.c.id == _nameable(session_id),
                LIVE,
            )
        )
    if not gone.rowcount:
        raise SessionNotFound("no such session")


async def history(
    engine: AsyncEngine, tenant: str, session_id: str, *, limit: int, max_bytes: int
) -> list[dict[str, Any]]:
    """The last ``limit`` revisions, newest first, each with the task that wrote it; fewer
    when their states would pass ``max_bytes`` (the newest one always), or when fewer are
    kept (``revisions_kept`` of the writes)."""
    budget = Budget(max_bytes, json_bytes("state"))
    async with engine.connect() as conn:
        current = await conn.run_sync(live, tenant, session_id)
        query = select(revisions).where(revisions.c.session_id == current.id)
        rows, _ = await first_rows(conn, query, [revisions.c.revision], limit=limit, budget=budget)
    return [
        {
            "revision": r["revision"],
            "state": r["state"],
            "task_id": str(r["task_id"]) if r["task_id"] else None,
            "created_at": iso(cast(datetime, r["created_at"])),
        }
        for r in rows
    ]


def _revision_kept(row: Any, *, task_id: Any) -> Any:
    return insert(revisions).values(
        session_id=row.id,
        revision=row.revision,
        tenant=row.tenant,
        state=row.state,
        task_id=task_id,
    )


def _revisions_past(row: Any, *, kept: int) -> Any:
    """Deletes the session's revisions older than its last ``kept``: each write adds the next
    revision number, so they are those at or below ``revision - kept``, a range of the
    primary key (one row a write, once the session has that many)."""
    return delete(revisions).where(
        revisions.c.session_id == row.id, revisions.c.revision <= row.revision - kept
    )


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396: a patch object's members replace the target's, ``null`` removes one, and
    anything that is not an object replaces the target whole."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


_PURGE = delete(sessions).where(
    sessions.c.id.in_(
        picked_once(
            select(sessions.c.id)
            .where(
                sessions.c.expires_at <= func.now(),  # not ``~LIVE``: its index is read
                ~HELD_BY_A_TURN,
                ~IDLE_SINCE_ITS_LAST_TURN,
                ~func.coalesce(JUST_ENDED, False),
            )
            .order_by(sessions.c.expires_at)
            .limit(bindparam("batch"))
            .with_for_update(skip_locked=True)
        )
    )
)


def purge_expired(engine: Engine, *, batch: int) -> int:
    """Delete the expired sessions no turn holds (and their revisions, by cascade), one batch
    per short transaction, until none is left; the janitor's, after the tasks."""
    removed = 0
    while True:
        with engine.begin() as conn:
            count = conn.execute(_PURGE, {"batch": batch}).rowcount
        removed += count
        if count < batch:
            return removed
