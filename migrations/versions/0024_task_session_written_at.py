"""task session_written_at: when a task first wrote its session, so a task that wrote it is
never run again

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-08 01:00:00

A turn whose worker was lost after its session write is delivered again; run, it applied
itself a second time to the revision it had written. The claim read whether a revision the
task wrote was kept, but a session keeps its last ``REACH_SESSION_REVISIONS_KEPT`` and
writes through the API in between let it go. The mark is on the task's row, set by the
write's own transaction.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A nullable column without a default: no row is rewritten.
    op.add_column(
        "tasks", sa.Column("session_written_at", sa.DateTime(timezone=True), nullable=True)
    )
    # The unfinished tasks whose write the revisions still show are marked, as the claim
    # found them before (a turn that wrote before the upgrade and is delivered again after
    # it). The revisions are read whole, the tasks by their key.
    op.execute(
        """
        UPDATE tasks SET session_written_at = written.at
        FROM (
            SELECT task_id, min(created_at) AS at FROM session_revisions
            WHERE task_id IS NOT NULL GROUP BY task_id
        ) AS written
        WHERE tasks.id = written.task_id AND tasks.status IN ('queued', 'running')
        """
    )


def downgrade() -> None:
    op.drop_column("tasks", "session_written_at")
