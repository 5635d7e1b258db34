"""Turns: the tasks of one session run one at a time, in the order they were accepted.

- Accepting a session task takes the session's next turn (``ALLOCATE``) in the transaction
  that inserts the task. Concurrent submits to one session wait for each other on the
  session's row, so turn order is commit order is acceptance order, and no turn becomes
  visible before the turns below it.
- A session holds at most ``REACH_SESSION_MAX_UNFINISHED_TURNS`` turns queued or running
  (``UNFINISHED``, counted under that same lock, so concurrent submits cannot pass it
  together); one more is refused (``SessionTurnsExceeded``) and takes no turn. A waiting
  turn holds no message in its queue (below), so no queue bound counts it.
- A claim succeeds only when the task's turn is due (``IS_DUE``): no earlier turn of its
  session is queued or running. A message whose claim fails so is dropped and its task stays
  ``queued``, parked: it holds no worker slot while it waits.
- Whoever moves a session task to a final state publishes, after the commit, the run message
  of the session's next turn (``next_due``). A turn submitted meanwhile needs no message from
  it: its own message goes out after its commit, so its claim sees the final state. A second
  message is harmless: one claim from ``queued`` wins.
- The sweeper republishes a queued task that is due and was accepted a while ago
  (``execution.stale_queued``): the safety net for a release lost between commit and publish.
  It does so for any task when its queue is empty; in a busy queue only for one whose message
  a worker dropped (``mark_dropped``), once per drop, so a queue nobody consumes never fills
  with copies. The mark goes when the task is final. A parked task past its deadline is
  expired by the sweeper too, which releases the next.

An earlier turn stops holding the line when it is final, or when its row has expired (it
reads as gone everywhere, and the janitor deletes it).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
from sqlalchemy import CTE, Connection, bindparam, exists, func, or_, select, true, update

from broker.db.models import sessions_table as sessions
from broker.db.models import tasks_table as tasks
from broker.errors import ReachError
from broker.tasks.resource import QUEUED, RUNNING

DROPPED_KEY = "reach:dropped:{}"
DROPPED_TTL_S = 24 * 3600  # longer than any turn waits for the one before it to finish

RETRY_AFTER_S = 5  # a refused turn may try again once the session's turns move on


class SessionTurnsExceeded(ReachError):
    """The session holds its most unfinished turns: wait until some finish."""

    code = "session_turns_exceeded"


# The statements below imply the predicate of ``ix_tasks_session_id_session_turn_unfinished``
# (``broker.db.models.UNFINISHED_TURNS``), so they read only a session's unfinished turns, not
# its whole history: change one with the other.
def _waiting_or_running(table: Any) -> Any:
    return (
        or_(table.c.status == QUEUED, table.c.status == RUNNING),
        table.c.expires_at > func.now(),
    )


# Its last turn's end (NULL while that turn is unfinished, or without turns). Turns end in
# order, so the last turn (an index probe) is the one that ended last.
_last_turn_ended_at = (
    select(tasks.c.finished_at)
    .where(tasks.c.session_id == sessions.c.id, tasks.c.session_turn.is_not(None))
    .order_by(tasks.c.session_turn.desc())
    .limit(1)
    .scalar_subquery()
)
IDLE_AGAIN = func.now() + func.make_interval(0, 0, 0, 0, 0, 0, sessions.c.ttl_s)

# A session is live before its expiry, and past it while a turn of it is queued or running:
# its TTL is idle time, and a turn is use. Otherwise a turn running past the session's TTL
# found its session gone (its writes refused, the turns behind it failed), and the janitor
# deleted the state the conversation was in.
HELD_BY_A_TURN = exists().where(tasks.c.session_id == sessions.c.id, *_waiting_or_running(tasks))
# ... and its idle time counts from its last turn's end. The final write and the session's
# release (``ended``, which moves ``expires_at``) are two transactions: between them, a
# client that saw the turn final and sent the next found a session its turn had held past
# its TTL gone (422 ``session_not_found``, ``GET /sessions/{id}`` 404).
IDLE_SINCE_ITS_LAST_TURN = func.coalesce(
    _last_turn_ended_at > func.now() - func.make_interval(0, 0, 0, 0, 0, 0, sessions.c.ttl_s),
    False,
)
LIVE = or_(sessions.c.expires_at > func.now(), HELD_BY_A_TURN, IDLE_SINCE_ITS_LAST_TURN)
# Its last turn ended within ``ENDED_GRACE_S``: the janitor leaves it for its release even
# when its TTL is shorter (a release that comes late starts its idle time again).
ENDED_GRACE_S = 300
JUST_ENDED = _last_turn_ended_at > func.now() - func.make_interval(0, 0, 0, 0, 0, 0, ENDED_GRACE_S)

# The session's next turn, while the session is live and the caller's; no row otherwise.
# Its row stays locked until the insert commits: the next submit to the session waits. A
# turn is use: its session's idle TTL starts again, as a write's does.
ALLOCATE = (
    update(sessions)
    .where(
        sessions.c.id == bindparam("turn_session"),
        sessions.c.tenant == bindparam("turn_tenant"),
        LIVE,
    )
    .values(turns=sessions.c.turns + 1, expires_at=IDLE_AGAIN)
    .returning(sessions.c.turns)
)

_earlier = tasks.alias("earlier")
# True for a task without a session, or whose session has no earlier turn left to run.
IS_DUE = or_(
    tasks.c.session_id.is_(None),
    ~exists().where(
        _earlier.c.session_id == tasks.c.session_id,
        _earlier.c.session_turn < tasks.c.session_turn,
        *_waiting_or_running(_earlier),
    ),
)

# The session's unfinished turns, counted up to ``cap``: at most ``cap`` entries of the index.
UNFINISHED = select(func.count()).select_from(
    select(tasks.c.id)
    .where(tasks.c.session_id == bindparam("session"), *_waiting_or_running(tasks))
    .limit(bindparam("cap"))
    .subquery()
)

_HEAD = (
    select(
        tasks.c.id,
        tasks.c.status,
        tasks.c.session_turn,
        tasks.c.queue,
        tasks.c.trace_id,
        tasks.c.deadline_at,
        tasks.c.tenant,
    )
    .where(
        tasks.c.session_id == bindparam("session"),
        tasks.c.session_turn.is_not(None),
        *_waiting_or_running(tasks),
    )
    .order_by(tasks.c.session_turn)
    .limit(1)
)


def session_heads() -> CTE:
    """The lowest unfinished turn of each session that has one: the one ``IS_DUE`` lets run
    when it is queued. A loose scan of the unfinished turns' index, one probe a session,
    however many turns wait behind each (Postgres has no skip scan)."""
    first = (
        select(
            tasks.c.id,
            tasks.c.session_id,
            tasks.c.status,
            tasks.c.tenant,
            tasks.c.queue,
            tasks.c.trace_id,
            tasks.c.deadline_at,
            tasks.c.created_at,
        )
        .where(tasks.c.session_id.is_not(None), tasks.c.session_turn.is_not(None))
        .where(*_waiting_or_running(tasks))
        .order_by(tasks.c.session_id, tasks.c.session_turn)
        .limit(1)
    )
    found = first.cte("session_heads", recursive=True)
    after = first.where(tasks.c.session_id > found.c.session_id).lateral("next_head")
    return found.union_all(select(after).select_from(found.join(after, true())))


@dataclass(frozen=True)
class Due:
    """The turn to publish: what its run message carries."""

    task_id: uuid.UUID
    queue: str
    trace_id: str
    deadline_at: datetime | None
    tenant: str


def due_after(finished_turn: int, head: Any) -> Due | None:
    """The session's lowest unfinished turn (``head``, or None) is due now that turn
    ``finished_turn`` is final, when it is queued and comes after it. A head below it is
    another's to release (it was the line, not the finished one); a running head is going."""
    if head is None or head.status != QUEUED or head.session_turn <= finished_turn:
        return None
    return Due(head.id, head.queue, head.trace_id, head.deadline_at, head.tenant)


def next_due(conn: Connection, session_id: str, finished_turn: int) -> Due | None:
    """The turn to publish after ``finished_turn`` of ``session_id`` went final (committed
    before this is called), if any. Async callers run it with ``AsyncConnection.run_sync``."""
    head = conn.execute(_HEAD, {"session": session_id}).first()
    return due_after(finished_turn, head)


def ended(conn: Connection, session_id: str) -> None:
    """A turn of ``session_id`` went final: its session's idle TTL starts again, as at a
    write (the turn held it while it ran, ``LIVE``; without this, a session whose turn ran
    past its TTL went the moment the turn ended). Call it in a transaction."""
    conn.execute(update(sessions).where(sessions.c.id == session_id).values(expires_at=IDLE_AGAIN))


def of_row(row: Any) -> tuple[str, int] | None:
    """(session, turn) of a final task row whose release may be due; None for a task
    outside any session's order."""
    if row["session_id"] is None or row["session_turn"] is None:
        return None
    return row["session_id"], row["session_turn"]


def mark_dropped(client: redis.Redis, task_id: uuid.UUID) -> None:
    """A worker dropped a message of this task without running it, the task not final:
    parked, most likely (or already running, by another message)."""
    client.set(DROPPED_KEY.format(task_id), 1, ex=DROPPED_TTL_S)


def take_dropped(client: redis.Redis, task_id: uuid.UUID) -> bool:
    """Whether a message of this task was dropped since this was last asked; the mark is
    gone after. Whoever makes a session task final asks too, so a final task's mark does not
    stay ``DROPPED_TTL_S``: a day long, that was a key for every turn that ever waited."""
    return bool(client.delete(DROPPED_KEY.format(task_id)))
