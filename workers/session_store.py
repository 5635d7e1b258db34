"""The reads and writes behind one task's ``ctx.session``, through ``broker.sessions``.

The domain's errors become what an agent can act on: a stale revision is SessionConflict;
a session gone, a state too large or not JSON Postgres keeps, or a task no longer running fail
the task with that code.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from broker import sessions
from broker.errors import AgentFailure
from workers.sdk.session import Session, SessionConflict, State

_FAILURES = (
    sessions.SessionNotFound,
    sessions.SessionTooLarge,
    sessions.SessionInvalid,
    sessions.TaskNotRunning,
    sessions.TaskPastDeadline,
)


@dataclass(frozen=True)
class SessionStore:
    engine: Engine
    tenant: str
    session_id: str
    task_id: uuid.UUID
    max_bytes: int
    revisions_kept: int
    attempt: int | None = None  # the attempt writing: a stale one's writes are refused

    def session(self, snapshot: dict[str, Any]) -> Session:
        """The task's ``ctx.session``, at the snapshot its claim read."""
        return Session(
            session_id=self.session_id,
            revision=snapshot["revision"],
            state=snapshot["state"],
            _write=self.write,
            _read=self.read,
        )

    def write(self, revision: int, state: State) -> tuple[int, State]:
        try:
            with self.engine.begin() as conn:
                row = sessions.compare_and_set(
                    conn,
                    self.tenant,
                    self.session_id,
                    revision=revision,
                    state=state,
                    max_bytes=self.max_bytes,
                    revisions_kept=self.revisions_kept,
                    task_id=self.task_id,
                    attempt=self.attempt,
                )
        except sessions.RevisionConflict as exc:
            current = exc.details.get("current_revision")
            raise SessionConflict(exc.message, current_revision=current) from None
        except _FAILURES as exc:
            raise AgentFailure(exc.message, code=exc.code) from None
        return row.revision, row.state

    def read(self) -> tuple[int, State]:
        try:
            with self.engine.connect() as conn:
                row = sessions.live(conn, self.tenant, self.session_id)
        except sessions.SessionNotFound as exc:
            raise AgentFailure(exc.message, code=exc.code) from None
        return row.revision, row.state
